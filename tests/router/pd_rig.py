"""A real `kvroute serve` in front of `kvroute sim fleet --workers 1 --prefill 2 --decode 2`
(engines with vLLM's P/D protocol, each with its bridge), on loopback, for the P/D tests.
The mixed engine `sim-0` starts drained: tests undrain it when they need the mixed pool."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvroute.testbed.procs import ProcessGroup, free_port, wait_http
from kvroute.testbed.sim_fleet import start_fleet

ADMIN = "pd-test-admin-token"
AUTH = {"authorization": f"Bearer {ADMIN}"}


@dataclass
class PdRig:
    url: str
    port: int
    model: str
    engines: dict[str, str]  # worker name -> engine URL

    def decisions(self) -> list[dict[str, Any]]:
        resp = httpx.get(self.url + "/admin/decisions?limit=200", headers=AUTH, timeout=10)
        out: list[dict[str, Any]] = resp.json()["decisions"]
        return out

    def last(self) -> dict[str, Any]:
        return self.decisions()[-1]

    def state(self, worker: str) -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(self.engines[worker] + "/sim/state", timeout=5).json()
        return out

    def faults(self, worker: str, **settings: Any) -> None:
        url = self.engines[worker] + "/sim/faults"
        assert httpx.post(url, json=settings, timeout=5).status_code == 200

    def drain(self, *workers: str, undrain: bool = False) -> None:
        for w in workers:
            action = "undrain" if undrain else "drain"
            url = f"{self.url}/admin/workers/{w}/{action}"
            assert httpx.post(url, headers=AUTH, timeout=5).status_code == 200

    def wait_ready(self, *workers: str, timeout_s: float = 20.0) -> None:
        """Until each worker's breaker is closed and it is healthy (earlier faults forgotten)."""
        deadline = time.monotonic() + timeout_s
        for w in workers:
            url = f"{self.url}/admin/workers/{w}"
            while httpx.get(url, headers=AUTH, timeout=5).json()["status"] != "ready":
                assert time.monotonic() < deadline, f"{w} did not become ready"
                time.sleep(0.2)

    def metric(self, name: str, label: str = "") -> float:
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and label in line and not line.startswith("#")
        )


@contextlib.contextmanager
def pd_rig(run_dir: Path) -> Iterator[PdRig]:
    """The router and fleet, up until the block ends."""
    with ProcessGroup(run_dir) as pg:
        extra = ["--workers", "1", "--prefill", "2", "--decode", "2", "--speed", "100",
                 "--max-model-len", "4096", "--num-blocks", "2048"]  # fmt: skip
        rig = serve_fleet(pg, run_dir, "dense", extra)
        rig.drain("sim-0")  # the mixed pool only serves the reference answers
        yield rig


def serve_fleet(pg: ProcessGroup, run_dir: Path, profile: str, extra: list[str]) -> PdRig:
    """`kvroute sim fleet --model-profile PROFILE EXTRA...` and `kvroute serve` on the config it
    writes (health checked every 0.5 s), both in `pg`; the roles are checked against the
    engines' names."""
    fleet = start_fleet(pg, workers=0, profile=profile, run_dir=run_dir, extra_args=extra)
    cfg = yaml.safe_load(Path(fleet.config_path).read_text())
    roles = {"prefill": "prefill", "decode": "decode"}  # by name: prefill-N, decode-N, sim-N
    for w in cfg["workers"]:
        assert w.get("role", "both") == roles.get(w["name"].split("-")[0], "both"), w
    cfg["health"] = {"interval_s": 0.5}
    config = run_dir / "router.yaml"
    config.write_text(yaml.safe_dump(cfg))
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(config)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    env = {"KVROUTE_ADMIN__TOKEN": ADMIN, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    child = pg.start("router", cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60.0, child.popen)
    return PdRig(url, port, fleet.model, {e.name: e.url for e in fleet.engines})
