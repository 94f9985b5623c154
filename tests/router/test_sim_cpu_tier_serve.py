"""Real processes on loopback: `kvroute sim fleet` (two simulated engines with a CPU tier, each
with its bridge) and `kvroute serve` in front of them. A prompt pushed out of one engine's small
GPU pool by others is still in that engine's CPU tier: `/admin/score` credits those tokens as
CPU tokens on that worker, exactly as many as the engine reports when the request is sent."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvroute.testbed.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "cpu-tier-test-admin"
MODEL = "kvroute-sim"
PROMPTS = {name: list(range(base, base + 600)) for name, base in (("a", 1000), ("b", 2000))}
PROMPTS["c"] = list(range(3000, 3600))


def _start_fleet(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "kvroute", "sim", "fleet", "--workers", "2", "--speed", "20",
        "--num-blocks", "80", "--max-model-len", "1024", "--cpu-offload-gib", "1",
        "--config-out", str(tmp_path / "fleet.yaml"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if line.startswith("{") and json.loads(line).get("fleet_ready"):
                return proc, json.loads(line)
        assert proc.poll() is None, f"fleet exited with {proc.returncode}"
    proc.kill()
    raise AssertionError("fleet did not become ready")


def _start_router(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    config = yaml.safe_load((tmp_path / "fleet.yaml").read_text())
    port = free_port()
    config.update(host="127.0.0.1", port=port, log_level="warning")
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVROUTE_ADMIN__TOKEN": ADMIN}
    cmd = [sys.executable, "-m", "kvroute", "serve", "--config", str(tmp_path / "router.yaml")]
    return subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"


def _score(router: httpx.Client, prompt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    resp = router.post(
        "/admin/score?endpoint=/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": 1},
    )
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer, {w["worker"]: w for w in answer["workers"]}


def _until(check: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
            if got:
                return got
        except (httpx.HTTPError, AssertionError, KeyError):
            pass
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _complete(url: str, prompt: str) -> dict[str, Any]:
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"model": MODEL, "prompt": PROMPTS[prompt], "max_tokens": 1},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    usage: dict[str, Any] = resp.json()["usage"]
    return usage


def _cached_by_source(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def test_the_router_credits_a_sim_engines_cpu_tier(tmp_path: Path) -> None:
    fleet, info = _start_fleet(tmp_path)
    router_proc, router_url = _start_router(tmp_path)
    try:
        w0, w1 = info["workers"]
        with httpx.Client(
            base_url=router_url, timeout=10, headers={"authorization": f"Bearer {ADMIN}"}
        ) as router:
            _until(
                lambda: all(w["events_live"] for w in _score(router, "a")[1].values()),
                "the router never saw both workers' events live",
            )
            # a on w0, then b and c push most of a out of w0's GPU pool (80 blocks)
            for prompt in ("a", "b", "c"):
                assert _complete(w0["url"], prompt)["prompt_tokens_details"]["cached_tokens"] == 0
            probe = httpx.post(
                f"{w0['url']}/sim/probe", json={"model": MODEL, "prompt_token_ids": PROMPTS["a"]}
            ).json()
            (gpu,) = probe["per_group"]  # the GPU alone
            assert gpu < 200 and probe["cached_tokens"] == 592  # the CPU tier holds the rest

            def credited() -> dict[str, Any] | None:
                answer, by = _score(router, "a")
                return answer if by[w0["name"]]["tier_tokens"]["cpu"] else None

            answer = _until(credited, "the router never credited w0's CPU tier")
            by = {w["worker"]: w for w in answer["workers"]}
            assert by[w0["name"]]["tier_tokens"] == {
                "gpu": gpu, "cpu": 592 - gpu, "storage": 0, "prefill": 8,
            }  # fmt: skip
            assert by[w0["name"]]["terms"]["tier_load"] > 0
            assert by[w1["name"]]["tier_tokens"]["cpu"] == 0
            assert answer["chosen"] == w0["name"]

            # the routed request lands on w0, which loads the tokens the router predicted
            before = _cached_by_source(w0["url"])
            resp = router.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPTS["a"], "max_tokens": 1}
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 592
            after = _cached_by_source(w0["url"])
            assert after["host"] - before["host"] == 592 - gpu
            assert after["device"] - before["device"] == gpu
    finally:
        for proc in (router_proc, fleet):
            proc.send_signal(signal.SIGTERM)
        for proc in (router_proc, fleet):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
