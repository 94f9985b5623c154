"""The router's event subscriptions to a bridge that asks for a token and serves TLS (mutual):
configured from files, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import grpc.aio
import pytest

from kvroute.bridge.auth import ServerTls
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.server import kv_events_handler, start_grpc_server
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream
from kvroute.router.config import BreakerConfig, EventsConfig, RouterConfig, WorkerSpec
from kvroute.router.config_load import validate
from kvroute.router.fleet.event_subscriptions import LIVE, EventSubscriptions, default_transport
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics
from tests.common.throwaway_pki import Pki, make_pki
from tests.router.fakes import ScriptedIndex
from tests.router.test_events import batch, until

TOKEN = b"router-side-bridge-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


Following = tuple[ScriptedIndex, EventSubscriptions, grpc.aio.Server]


async def follow(cfg: EventsConfig, tls: ServerTls) -> Following:
    """A bridge (token + mutual TLS) with one cached batch, and the router following it."""
    stream = RankStream(0, "auth-bridge", EngineState(0), BridgeMetrics())
    stream.apply(batch(1, 0))
    handler = kv_events_handler(lambda rank: stream, token=TOKEN)
    server, port = await start_grpc_server("127.0.0.1:0", handler, tls)
    index = ScriptedIndex()
    events = EventSubscriptions(
        index, cfg, RouterMetrics(), functools.partial(default_transport, cfg=cfg)
    )
    registry = WorkerRegistry(BreakerConfig())
    registry.listen(events)
    registry.add(WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{port}"))
    await events.start()
    return index, events, server


async def close(events: EventSubscriptions, server: grpc.aio.Server) -> None:
    await events.stop()
    await server.stop(grace=None)


def test_router_sends_the_token_from_its_file_over_mutual_tls(tmp_path: Path, pki: Pki) -> None:
    token_file = tmp_path / "bridge-token"
    token_file.write_bytes(TOKEN + b"\n")
    tls = ServerTls(pki.server_cert, pki.server_key, client_ca_file=pki.ca)
    base = dict(reconnect_initial_s=0.05, reconnect_max_s=0.1)
    good = EventsConfig(
        **base,  # type: ignore[arg-type]
        bridge_token_file=str(token_file),
        bridge_ca_file=pki.ca,
        bridge_cert_file=pki.client_cert,
        bridge_key_file=pki.client_key,
    )
    no_token = EventsConfig(
        **base,  # type: ignore[arg-type]
        bridge_ca_file=pki.ca,
        bridge_cert_file=pki.client_cert,
        bridge_key_file=pki.client_key,
    )

    async def go() -> None:
        index, events, server = await follow(good, tls)
        try:
            await until(lambda: index.snapshots == [("w0", "initial")])
            await until(lambda: events.status("w0").state == LIVE)  # type: ignore[union-attr]
        finally:
            await close(events, server)
        index, events, server = await follow(no_token, tls)
        try:
            status = events.status("w0")
            assert status is not None
            await until(lambda: status.reconnects >= 2)
            assert status.last_error.startswith("UNAUTHENTICATED")
            assert index.snapshots == [] and "w0" in events.unusable()
        finally:
            await close(events, server)

    asyncio.run(asyncio.wait_for(go(), 30))


def test_bridge_secret_files_are_validated(tmp_path: Path, pki: Pki) -> None:
    worker = [WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge="127.0.0.1:1")]

    def problems(**events: str) -> list[str]:
        return validate(RouterConfig(workers=worker, events=EventsConfig(**events)))  # type: ignore[arg-type]

    assert problems(bridge_ca_file=pki.ca, bridge_token_file=pki.ca) == []
    assert problems(bridge_token_file=str(tmp_path / "missing")) == [
        f"events.bridge_token_file: no such file {tmp_path / 'missing'}"
    ]
    assert any(
        "go together" in p
        for p in problems(bridge_ca_file=pki.ca, bridge_cert_file=pki.client_cert)
    )
    assert any(
        "needs events.bridge_ca_file" in p
        for p in problems(bridge_cert_file=pki.client_cert, bridge_key_file=pki.client_key)
    )
