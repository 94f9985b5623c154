"""A simulated engine followed by a real kvroute bridge: what a router subscribing sees."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.client import subscribe
from kvroute.bridge.discovery import ranked_endpoints
from kvroute.proto.events_pb2 import KvGroupEvent, SubscribeResponse
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.publisher import PublisherConfig
from kvroute.sim.server import start_engine

PROMPT = "a hybrid model keeps Mamba state only where a sibling can resume " * 6


async def _next(it: Any, timeout: float = 5.0) -> SubscribeResponse:
    msg: SubscribeResponse = await asyncio.wait_for(anext(it), timeout)
    return msg


async def _scenario() -> None:
    config = EngineConfig(speed=100, profile="mamba", num_blocks=512, max_model_len=1024)
    running = await start_engine(config, PublisherConfig(topic="kv"))
    assert running.events and running.replay
    bridge = Bridge(
        BridgeConfig(
            engines=tuple(ranked_endpoints(running.events, running.replay, "kv", 1)),
            listen="127.0.0.1:0",
        )
    )
    await bridge.start()
    stream = subscribe(f"127.0.0.1:{bridge.grpc_port}")
    try:
        first = await _next(stream)
        assert first.HasField("snapshot")
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=running.url, timeout=20) as c:

            async def post(i: int) -> dict[str, Any]:
                body = {"prompt": f"{i} {PROMPT}", "max_tokens": 3, "ignore_eos": True}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200
                out: dict[str, Any] = r.json()
                return out

            await post(0)
            batches = []
            while True:
                msg = await _next(stream)
                assert msg.HasField("batch"), msg
                batches.append(msg.batch)
                if any(e.kind == "mamba" and e.block_size == 16 for e in msg.batch.events):
                    break
            stores = [e for b in batches for e in b.events if e.operation == KvGroupEvent.STORE]
            assert {e.kind for e in stores} == {"full_attention", "mamba"}
            # The Mamba group's partial entry (hash unit 16 inside a 64-token block).
            assert any(e.group_id == 1 and e.block_size == 16 for e in stores)
            last_seq = batches[-1].sequence

            # A dropped batch is a gap the bridge fills from the replay socket.
            await c.post("/sim/faults", json={"drop_batches": 1})
            await post(1)
            await post(2)
            seqs = []
            while len(seqs) < 2:
                msg = await _next(stream)
                assert msg.HasField("batch"), "a replayable gap must not force a snapshot"
                seqs.append(msg.batch.sequence)
            assert seqs == [last_seq + 1, last_seq + 2]

            # An engine restart (sequence back to 0) makes the bridge resend a snapshot.
            await c.post("/sim/faults", json={"restart": True})
            await post(3)
            msg = await _next(stream)
            while not msg.HasField("snapshot"):
                msg = await _next(stream)
            assert not [e for e in msg.snapshot.events if e.block_hashes]
    finally:
        await stream.aclose()
        await bridge.stop()
        await running.aclose()


def test_bridge_follows_the_simulated_engine() -> None:
    asyncio.run(asyncio.wait_for(_scenario(), 60))
