"""The command line of each router a benchmark can start (one builder per router kind)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvroute.testbed import routers
from kvroute.testbed.peers import Peers
from kvroute.testbed.routers import ROUTERS, RouterSpec, RouterUnavailable, command

FLEET: Any = SimpleNamespace(
    engines=[SimpleNamespace(url="http://127.0.0.1:1"), SimpleNamespace(url="http://127.0.0.1:2")],
    config_path=Path("fleet.yaml"),
)
PD_FLEET: Any = SimpleNamespace(
    engines=[
        SimpleNamespace(url="http://127.0.0.1:1", role="prefill"),
        SimpleNamespace(url="http://127.0.0.1:2", role="decode"),
    ],
    config_path=Path("fleet.yaml"),
)
PEERS = Peers(Path("peers/smg"), Path("peers/vllm-router"))


@pytest.fixture(autouse=True)
def _fixed_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routers, "free_port", lambda: 4242)


def test_every_router_has_a_command() -> None:
    for spec in ROUTERS.values():
        argv = command(spec, 9000, PD_FLEET if spec.pd else FLEET, PEERS)
        assert "9000" in argv and spec.policy in argv, spec.name


def test_peer_routers_take_the_same_flags_but_two() -> None:
    smg = command(ROUTERS["smg-cache-aware"], 9000, FLEET, PEERS)
    vr = command(ROUTERS["vllm-router"], 9000, FLEET, PEERS)
    assert smg[:2] == ["peers/smg", "launch"] and vr[0] == "peers/vllm-router"
    assert smg[-2:] == ["--log-level", "warn"] and vr[-2:] == ["--log-level", "warning"]
    assert smg[2:-1] == vr[1:-1]
    urls = smg[smg.index("--worker-urls") + 1 : smg.index("--policy")]
    assert urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def test_kvroute_and_proxy_commands() -> None:
    kv = command(ROUTERS["kvroute"], 9000, FLEET, PEERS)
    assert kv[1:4] == ["-m", "kvroute", "serve"] and kv[kv.index("--config") + 1] == "fleet.yaml"
    assert kv[kv.index("--admin-token") + 1] == routers.ADMIN_TOKEN
    proxy = command(ROUTERS["oracle"], 9000, FLEET, PEERS)
    assert proxy[1:3] == ["-m", "bench.proxy"]
    assert proxy[proxy.index("--engines") + 1] == "http://127.0.0.1:1,http://127.0.0.1:2"


def test_missing_peers_and_unknown_kinds() -> None:
    with pytest.raises(RouterUnavailable, match="no peers venv"):
        command(ROUTERS["smg-cache-aware"], 9000, FLEET, Peers(None, None, "no peers venv"))
    with pytest.raises(RouterUnavailable, match="vllm-router not installed"):
        command(ROUTERS["vllm-router"], 9000, FLEET, Peers(Path("smg"), None))
    with pytest.raises(ValueError, match="unknown router kind"):
        command(RouterSpec("x", "x", "nope", "p"), 9000, FLEET, PEERS)
