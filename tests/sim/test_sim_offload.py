"""The simulated CPU tier (`kvroute.sim.offload`): the tier against a plain model of its rule,
the scheduler's loads and stores, and its events rebuilding it in the router's own index."""

from __future__ import annotations

import random
from collections import Counter

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bridge.convert import convert_batch
from kvroute.bridge.vllm_schema import BatchDecoder, encode_batch
from kvroute.indexer import FleetIndex, TierIndex, content_keys
from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheRequest, CacheSpec, GroupSpec
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.metrics import CACHE_HIT_SOURCES
from kvroute.sim.engine.scheduler import Scheduler
from kvroute.sim.events import BlockRemoved, BlockStored, KvEvent
from kvroute.sim.offload import ChunkInfo, CpuTier, OffloadConfig, OffloadConnector
from kvroute.sim.server import SimEngineThread

BYTES_PER_TOKEN = 10.0


def chunk(key: int) -> ChunkInfo:
    return ChunkInfo(key, 16 * (key + 1), (key,), None, tuple(range(16)), 16)


class ModelTier:
    """vLLM's `lru` rule stated plainly: every chunk has a rank, the lowest evictable one goes
    first (see kvroute/sim/offload/tier.py for the rule)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rank: dict[int, tuple[int, int]] = {}
        self.ready: set[int] = set()
        self.pins: Counter[int] = Counter()
        self.prepared: list[int] = []
        self.in_flight: list[int] = []
        self.counter = 0

    def new_rank(self) -> int:
        self.counter += 1
        return self.counter

    def offer(self, keys: list[int], rank: int) -> None:
        for k in keys:
            if k in self.ready and self.rank[k] < (rank, -chunk(k).end):
                self.rank[k] = (rank, -chunk(k).end)
        new = [k for k in keys if k not in self.rank]
        if not new:
            return
        need = len(new) - (self.capacity - len(self.rank))
        if need > 0:
            free = sorted(
                (k for k in self.rank if k in self.ready and not self.pins[k] and k not in keys),
                key=self.rank.__getitem__,
            )
            if len(free) < need:
                return
            for k in free[:need]:
                del self.rank[k]
                self.ready.discard(k)
        for k in new:
            self.rank[k] = (rank, -chunk(k).end)
        self.prepared.extend(new)

    def finish(self, keys: list[int]) -> None:
        for k in sorted(keys, reverse=True):  # the tail first, the head most recent
            if k in self.rank:
                self.rank[k] = (self.new_rank(), 0)

    def end_step(self) -> None:
        self.ready.update(k for k in self.in_flight if k in self.rank)
        self.in_flight, self.prepared = self.prepared, []

    def order(self) -> list[int]:
        return sorted((k for k in self.rank if k in self.ready), key=self.rank.__getitem__)


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("offer"),
            st.integers(0, 3),
            st.lists(st.integers(0, 11), min_size=1, max_size=5),
        ),
        st.tuples(st.just("finish"), st.integers(0, 3), st.just([])),
        st.tuples(st.just("pin"), st.integers(0, 11), st.just([])),
        st.tuples(st.just("unpin"), st.integers(0, 11), st.just([])),
        st.tuples(st.just("step"), st.just(0), st.just([])),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 6), ops=OPS)
def test_the_tier_follows_the_plain_model_and_its_events_rebuild_it(
    capacity: int, ops: list[tuple[str, int, list[int]]]
) -> None:
    tier, model = CpuTier(capacity), ModelTier(capacity)
    ranks: dict[int, int] = {}  # request -> rank (both sides number requests alike)
    used: dict[int, set[int]] = {}
    rebuilt: set[int] = set()

    def replay(events: list[KvEvent]) -> None:
        for event in events:
            assert event.medium == "CPU"  # type: ignore[union-attr]
            if isinstance(event, BlockStored):
                rebuilt.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved):
                rebuilt.difference_update(event.block_hashes)  # type: ignore[arg-type]

    for op, n, keys in ops:
        if op == "offer":
            keys = sorted(set(keys))  # a request offers its chunks in prompt order
            if n not in ranks:
                ranks[n] = tier.new_rank()
                assert model.new_rank() == ranks[n]
            tier.prepare_store([chunk(k) for k in keys], ranks[n])
            model.offer(keys, ranks[n])
            used.setdefault(n, set()).update(keys)
        elif op == "finish" and n in ranks:
            done = sorted(used.pop(n))
            tier.finish([chunk(k) for k in done])
            model.finish(done)
            del ranks[n]
        elif op == "pin" and tier.is_hit(n):
            tier.pin([n])
            model.pins[n] += 1
        elif op == "unpin" and model.pins[n]:
            tier.unpin([n])
            model.pins[n] -= 1
        elif op == "step":
            model.end_step()
            replay(tier.end_step())
        assert len(tier) <= capacity
        assert [c.key for c in tier.ready_chunks()] == model.order()
    replay(tier.flush())
    assert rebuilt == {c.key for c in tier.ready_chunks()}


SPEC = CacheSpec(groups=(GroupSpec("full_attention", 16),), num_blocks=12, max_model_len=160)


class Rig:
    """Scheduler + sim cache + CPU tier, one request at a time; loads finish at once."""

    def __init__(self, chunk_blocks: int, cpu_chunks: int, num_blocks: int = 12) -> None:
        spec = CacheSpec(SPEC.groups, num_blocks=num_blocks, max_model_len=160)
        self.cache = SimCache(spec)
        cpu_bytes = int(cpu_chunks * 16 * chunk_blocks * BYTES_PER_TOKEN)
        config = OffloadConfig(cpu_bytes, chunk_blocks=chunk_blocks)
        self.offload = OffloadConnector(config, spec, self.cache, BYTES_PER_TOKEN)
        self.sched = Scheduler(self.cache, max_num_scheduled_tokens=64, offload=self.offload)
        self.batches: list[list[KvEvent]] = []
        self.token = 50_000

    def run(self, rid: str, tokens: list[int]) -> tuple[int, int]:
        """(GPU hit, tokens loaded from the CPU tier) of the request."""
        self.sched.add(CacheRequest(rid, tuple(tokens), max_tokens=2))
        gpu = cpu = 0
        while self.sched.has_work():
            plan = self.sched.schedule()
            for r, _ in plan.loads:
                self.sched.load_done(r)
            for s in plan.scheduled:
                if s.new:
                    gpu, cpu = s.cached_tokens, s.tier

            def sample(_: str) -> int:
                self.token += 1
                return self.token

            result = self.sched.complete(plan, sample, lambda _r, _t: False)
            self.batches.append(result.events)
        self.batches.append(self.sched.flush_offload())
        return gpu, cpu


def test_a_prompt_evicted_from_the_gpu_comes_back_from_the_cpu_tier() -> None:
    rig = Rig(chunk_blocks=2, cpu_chunks=20, num_blocks=9)
    a, b = list(range(100, 196)), list(range(300, 396))  # 7 blocks each, 8 in the pool
    assert rig.run("a", a) == (0, 0)
    assert rig.run("b", b) == (0, 0)  # evicts most of a from the GPU
    gpu, cpu = rig.run("a2", a)
    # the lookup starts at the chunk holding the GPU hit and goes to the prompt's end
    assert gpu < 32 and gpu + cpu == 96 and cpu >= 64
    stores = [e for batch in rig.batches for e in batch if e.medium == "CPU"]  # type: ignore[union-attr]
    assert all(isinstance(e, BlockStored) for e in stores)
    # self-describing: two GPU blocks per chunk, their tokens, the GPU block size
    assert {len(e.block_hashes) for e in stores} == {2}  # type: ignore[union-attr]
    assert {len(e.token_ids) for e in stores} == {32}  # type: ignore[union-attr]
    assert {e.block_size for e in stores} == {16}  # type: ignore[union-attr]
    for batch in rig.batches:  # a batch's CPU events follow its GPU events
        media = [e.medium for e in batch if not isinstance(e, type(None))]  # type: ignore[union-attr]
        assert media == sorted(media, key=lambda m: m == "CPU")


def test_less_than_a_chunk_beyond_the_gpu_hit_loads_nothing() -> None:
    rig = Rig(chunk_blocks=4, cpu_chunks=20, num_blocks=40)
    a = list(range(100, 164))  # exactly one 64-token chunk
    rig.run("a", a)
    # a prompt that extends a: the GPU holds a's blocks, the CPU tier has nothing past them
    gpu, cpu = rig.run("a+", [*a, *range(700, 716)])
    assert (gpu, cpu) == (64, 0)


def test_a_full_prompt_hit_is_reported_whole_and_the_last_token_recomputed() -> None:
    rig = Rig(chunk_blocks=1, cpu_chunks=40, num_blocks=9)
    a = list(range(100, 196))
    rig.run("a", a)
    rig.run("b", list(range(300, 396)))
    rig.sched.add(CacheRequest("a2", tuple(a), max_tokens=1))
    plan = rig.sched.schedule()
    ((rid, tokens),) = plan.loads
    rig.sched.load_done(rid)
    plan = rig.sched.schedule()
    (s,) = plan.scheduled
    assert s.tier == tokens and s.cached_tokens + s.tier == 96  # every prompt token cached
    assert s.num_tokens - s.external == 1  # and computes the last one again


def test_a_full_tier_evicts_least_recent_first_and_pinned_chunks_stay() -> None:
    tier = CpuTier(3)
    older = tier.new_rank()
    tier.prepare_store([chunk(1), chunk(2), chunk(3)], older)  # a live request: tail first
    tier.flush()
    assert [c.key for c in tier.ready_chunks()] == [3, 2, 1]
    tier.pin([3])
    tier.prepare_store([chunk(4)], tier.new_rank())
    events = tier.flush()
    assert isinstance(events[0], BlockRemoved) and events[0].block_hashes == [2]
    assert [c.key for c in tier.ready_chunks()] == [3, 1, 4]
    tier.finish([chunk(3), chunk(1)])  # the older request ends: its chunks most recent
    assert [c.key for c in tier.ready_chunks()] == [4, 3, 1]
    tier.pin([1])
    tier.pin([4])
    assert tier.prepare_store([chunk(5)], tier.new_rank()) is None  # nothing evictable
    assert tier.store_failures == 1 and not tier.flush()


def _index_of(batches: list[list[KvEvent]]) -> tuple[FleetIndex, TierIndex]:
    decoder, fleet, tiers = BatchDecoder(), FleetIndex(16), TierIndex(16)
    for seq, events in enumerate(b for b in batches if b):
        decoded = decoder.decode(encode_batch(0.0, events, None, "0.33"))
        batch = convert_batch(decoded, seq)
        fleet.apply("w", batch)
        tiers.apply("w", batch)
    return fleet, tiers


@pytest.mark.parametrize("chunk_blocks", [1, 2, 4])
def test_the_router_rebuilds_the_tier_from_the_events(chunk_blocks: int) -> None:
    """Random conversations through a small GPU pool: after each request, what the router's
    indexer makes of the published events gives every prompt the CPU tokens the engine would
    load."""
    rng = random.Random(chunk_blocks)
    rig = Rig(chunk_blocks=chunk_blocks, cpu_chunks=24 // chunk_blocks, num_blocks=14)
    prompts = [[rng.randrange(1000, 9000) for _ in range(rng.randrange(20, 150))] for _ in range(8)]
    credited = 0
    for i in range(40):
        p = rng.choice(prompts)
        rig.run(f"r{i}", p)
        fleet, tiers = _index_of(rig.batches)
        for q in prompts:
            rig.cache.add_request(CacheRequest("probe", tuple(q)))
            gpu = rig.cache.lookup("probe").hit_tokens
            want = rig.offload.peek("probe", gpu, len(q))
            rig.cache.free("probe")
            keys = content_keys(q, None, 16)
            got = tiers.split("w", fleet.layout("w"), keys, len(q), gpu).cpu
            assert got == want, (i, len(q), gpu)
            credited += want > 0
    assert credited > 20  # the CPU tier had something to give, many times
    assert rig.offload.tier.evicted > 0  # the tier was full and evicted along the way


def test_the_engine_shows_its_tier_and_a_skipped_store_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(chunk_blocks=1, cpu_chunks=2, num_blocks=40)
    rig.run("a", list(range(100, 132)))  # fills the tier's two chunks
    held = [c.key for c in rig.offload.tier.ready_chunks()]
    rig.offload.tier.pin(held)  # as a load in flight does
    with caplog.at_level("WARNING", logger="kvroute.sim.offload.connector"):
        for i in range(3):  # each request's stores find the tier pinned full
            rig.run(f"b{i}", list(range(500 + 50 * i, 540 + 50 * i)))
    state = rig.offload.state()
    assert state["chunks"] == 2 and state["evicted_chunks"] == 0
    assert state["skipped_stores"] >= 3 and state["capacity_chunks"] == 2
    assert sum("store was skipped" in r.getMessage() for r in caplog.records) == 1


def test_options_that_do_not_go_together_are_refused() -> None:
    with pytest.raises(ValueError, match="full-attention"):
        EngineConfig(profile="swa", cpu_offload=OffloadConfig(1 << 30)).cache_spec()
    with pytest.raises(ValueError, match="positive"):
        OffloadConfig(0)


def _series(page: str) -> dict[str, float]:
    """A Prometheus page's samples of the offloading and cache-source series, by name (and
    source), summed over the other labels."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(("vllm:kv_offload", "vllm:prompt_tokens_cached_by_source_total")):
            series, value = line.rsplit(" ", 1)
            name = series.split("{")[0]
            if 'source="' in series:
                name += ":" + series.split('source="')[1].split('"')[0]
            elif 'le="' in series:
                continue
            out[name] = out.get(name, 0.0) + float(value)
    return out


def test_the_engine_exports_vllms_load_series_for_its_tier() -> None:
    """vLLM's names and meaning (offloading/metrics.py): bytes and copy seconds of every
    finished load, and a histogram of load sizes; the tokens in `source="host"`."""
    speed, link = 50.0, 2.0e9  # bytes/s, so that a load of 592 tokens takes 0.78 ms here
    offload = OffloadConfig(1 << 30, bytes_per_s=link, chunk_blocks=1)
    config = EngineConfig(speed=speed, num_blocks=80, max_model_len=1024, cpu_offload=offload)
    prompts = {name: list(range(base, base + 600)) for name, base in (("a", 1000), ("b", 2000))}
    prompts["c"] = list(range(3000, 3600))
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=20) as client:

        def complete(name: str) -> None:
            body = {"model": "kvroute-sim", "prompt": prompts[name], "max_tokens": 1}
            assert client.post("/v1/completions", json=body).status_code == 200

        page = client.get("/metrics").text
        assert "# HELP vllm:kv_offload_load_bytes" in page
        assert not _series(page).keys() - {  # no load yet: declared, with no sample
            f"vllm:prompt_tokens_cached_by_source_total:{source}" for source in CACHE_HIT_SOURCES
        }
        for name in ("a", "b", "c", "a"):  # b and c push a out of the GPU pool
            complete(name)
        got = _series(client.get("/metrics").text)
    host = got["vllm:prompt_tokens_cached_by_source_total:host"]
    assert host > 300
    assert got["vllm:kv_offload_load_bytes_total"] == host * 131072
    assert got["vllm:kv_offload_load_time_total"] == pytest.approx(host * 131072 / link / speed)
    assert got["vllm:kv_offload_load_size_count"] == 1
    assert got["vllm:kv_offload_load_size_sum"] == host * 131072
    # an engine without a CPU tier has none of these series
    with SimEngineThread(EngineConfig(speed=speed)) as plain:
        assert "vllm:kv_offload" not in httpx.get(plain.url + "/metrics").text
