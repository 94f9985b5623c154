"""Lower tiers from engine to router on loopback: a fake engine publishes GPU and CPU events
(vLLM 0.33 frames, self-describing CPU chunks as in spec section 10.3) over real ZMQ, a real
bridge follows it, and the router's event subscriptions (real gRPC) feed its index, which then
answers per tier; a late router gets the tiers from the snapshot, and a removed worker's tiers
are forgotten."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from bridge_testkit import FakeEngine, eventually, store

from kvroute.bridge import vllm_schema as s
from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, Snapshot, Tier
from kvroute.router.config import BreakerConfig, EventsConfig, WorkerSpec
from kvroute.router.fleet.event_subscriptions import LIVE, EventSubscriptions
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.fleet_index_view import FleetIndexView
from kvroute.router.routing.index_view import TierReuse

PROMPT = list(range(7000, 7000 + 193))  # 12 blocks of 16 tokens and one more
CHUNK = 4  # GPU blocks per offloaded chunk (OffloadingConnector's blocks_per_chunk)


def cpu_chunk(first: int) -> s.BlockStored:
    """A self-describing CPU store of the chunk of blocks first..first+CHUNK-1: the GPU
    blocks' own hashes, the chunk's tokens, the GPU block size, the parent before it."""
    return store(
        list(range(first + 1, first + CHUNK + 1)),
        first or None,
        PROMPT[16 * first : 16 * (first + CHUNK)],
        medium="CPU",
    )


class Router:
    """A router's event subscriptions over its real index, following one worker's bridge."""

    def __init__(self, bridge: Bridge, index: FleetIndexView | None = None) -> None:
        self.index = index or FleetIndexView(16)
        cfg = EventsConfig(reconnect_initial_s=0.05, reconnect_max_s=0.1)
        self.events = EventSubscriptions(self.index, cfg, RouterMetrics())
        self.registry = WorkerRegistry(BreakerConfig())
        self.registry.listen(self.events)
        self.registry.add(
            WorkerSpec(name="w0", url="http://127.0.0.1:1", bridge=f"127.0.0.1:{bridge.grpc_port}")
        )

    def answer(self, n: int = len(PROMPT)) -> tuple[int | None, TierReuse | None]:
        gpu = self.index.score(PROMPT[:n])
        return gpu["w0"], self.index.tiers(PROMPT[:n], gpu).get("w0")

    async def live(self) -> None:
        await eventually(lambda: getattr(self.events.status("w0"), "state", None) == LIVE)


@contextlib.asynccontextmanager
async def rig() -> AsyncIterator[tuple[FakeEngine, Callable[..., Router]]]:
    ctx = zmq.asyncio.Context()
    routers: list[Router] = []

    def router(index: FleetIndexView | None = None) -> Router:
        routers.append(Router(bridge, index))
        return routers[-1]

    engine = FakeEngine(ctx)
    bridge = Bridge(
        BridgeConfig(engines=(engine.endpoints(),), http="127.0.0.1:0", listen="127.0.0.1:0")
    )
    await bridge.start()
    try:
        await eventually(lambda: bridge.ready)
        await asyncio.sleep(0.3)  # let the SUB subscription reach the PUB socket
        yield engine, router
    finally:
        for r in routers:
            await r.events.stop()
        await bridge.stop()
        await engine.close()
        ctx.destroy(linger=0)


def test_cpu_tier_events_reach_the_routers_index_per_tier() -> None:
    async def main() -> None:
        async with rig() as (engine, make_router):
            router = make_router()
            await router.events.start()
            await router.live()
            # The GPU held 12 blocks and offloaded them as three chunks; then it evicted
            # the last 10 blocks (newest first), keeping 32 tokens on GPU.
            await engine.publish([store(list(range(1, 13)), None, PROMPT[:192])])
            await engine.publish([cpu_chunk(0), cpu_chunk(4), cpu_chunk(8)])
            await engine.publish([s.BlockRemoved([h], group_idx=0) for h in range(12, 2, -1)])
            # From the chunk holding the GPU hit, as vLLM looks it up: 160 more from CPU.
            await eventually(lambda: router.answer() == (32, TierReuse(cpu=160)))
            # A shorter prompt gets the whole chunks it covers (the first chunk's rest and
            # the second chunk), and less than a chunk beyond the GPU hit gives nothing.
            assert router.answer(150) == (32, TierReuse(cpu=96))
            assert router.answer(60) == (32, None)

            # The CPU tier evicts the third chunk: the first two remain.
            await engine.publish(
                [s.BlockRemoved([h], medium="CPU", group_idx=0) for h in range(9, 13)]
            )
            await eventually(lambda: router.answer() == (32, TierReuse(cpu=96)))
            assert router.index.tier_blocks("w0") == {Tier.CPU: 8}

            # A router that subscribes now gets the tiers in its snapshot, and the chunk
            # with them (the snapshot joins the two chunks into one run).
            late = make_router()
            await late.events.start()
            await late.live()
            await eventually(lambda: late.index.tier_blocks("w0") == {Tier.CPU: 8})
            assert late.answer() == (32, TierReuse(cpu=96))
            assert late.answer(150) == (32, TierReuse(cpu=96))
            await engine.publish([cpu_chunk(8)])  # the third chunk offloaded again
            await eventually(lambda: late.answer() == (32, TierReuse(cpu=160)))
            await eventually(lambda: router.answer() == (32, TierReuse(cpu=160)))

            # A removed worker's tiers are forgotten with it.
            router.registry.remove("w0")
            assert router.index.tier_blocks("w0") == {}
            assert router.index.tiers(PROMPT, {"w0": 32}) == {}

    asyncio.run(asyncio.wait_for(main(), 60))


OP = KvGroupEvent


def tier_store(first: int, count: int, tier: int) -> KvGroupEvent:
    """Proto stores as the bridge sends them: blocks first..first+count-1 of PROMPT."""
    return OP(
        operation=OP.STORE,
        block_hashes=[(first + i + 1).to_bytes(8, "big") for i in range(count)],
        parent_block_hash=first.to_bytes(8, "big") if first else b"",
        token_ids=PROMPT[16 * first : 16 * (first + count)],
        block_size=16,
        kind="full_attention",
        tier=tier,
    )


def test_each_workers_tiers_are_bounded_like_its_gpu_view() -> None:
    view = FleetIndexView(16, max_entries_per_worker=8, max_pending_per_worker=4)
    view.apply("w0", KvEventBatch(sequence=0, events=[tier_store(0, 2, Tier.GPU)]))
    for seq in range(1, 6):  # 5 unrelated 4-block chains of another conversation each
        other = tier_store(0, 4, Tier.CPU)
        other.block_hashes[:] = [(100 * seq + i).to_bytes(8, "big") for i in range(4)]
        other.token_ids[:] = [seq] * 64
        view.apply("w0", KvEventBatch(sequence=seq, tier_events=[other]))
    assert view.tier_blocks("w0")[Tier.CPU] <= 8
    assert view.index.stats("w0").entries == 2  # the GPU view is untouched


def test_a_snapshot_replaces_the_tiers_and_a_stepped_one_waits_for_its_end() -> None:
    view = FleetIndexView(16)
    gpu = tier_store(0, 2, Tier.GPU)
    chunks = [tier_store(c, 4, Tier.CPU) for c in (0, 4, 8)]
    view.apply("w0", KvEventBatch(sequence=0, events=[gpu], tier_events=chunks))
    full = view.score(PROMPT)
    assert view.tiers(PROMPT, full) == {"w0": TierReuse(cpu=160)}
    snap = Snapshot(sequence=5, has_sequence=True, events=[gpu])  # the CPU tier is empty now
    steps = view.apply_snapshot_steps("w0", snap, 1)
    next(steps)
    assert view.tiers(PROMPT, full) == {"w0": TierReuse(cpu=160)}  # the old view answers
    for _ in steps:
        pass
    assert view.tiers(PROMPT, view.score(PROMPT)) == {}
    # a stepped snapshot overtaken by a later batch leaves the tiers to that batch
    steps = view.apply_snapshot_steps("w0", snap, 1)
    next(steps)
    view.apply("w0", KvEventBatch(sequence=6, tier_events=chunks[:2]))
    for _ in steps:
        pass
    assert view.tiers(PROMPT, {"w0": 32}) == {"w0": TierReuse(cpu=96)}
