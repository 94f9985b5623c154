"""Time as a GPU spends it: TTFT grows with uncached tokens, queues form under load."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from sim_testkit import FA16

from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheRequest, CacheSpec
from kvroute.sim.engine.core import Engine, EngineConfig, GenerateRequest, RequestHandle
from kvroute.sim.engine.scheduler import Scheduler
from kvroute.sim.server import SimEngineThread
from kvroute.sim.timing import DEFAULT_GPU, chunk_context


def test_model_is_monotonic_and_roughly_calibrated() -> None:
    g = DEFAULT_GPU
    prefill = [g.step_seconds(n, chunk_context(0, n), 0, 0) for n in (128, 512, 2048)]
    assert prefill == sorted(prefill) and prefill[0] < prefill[-1]
    decode = [g.step_seconds(0, 0, b, b * 1024) for b in (1, 8, 64, 256)]
    assert decode == sorted(decode)
    assert 0.004 < decode[0] < 0.010  # ~7 ms per token at batch 1
    assert 8_000 < 256 / decode[-1] < 16_000  # ~10k tok/s saturated
    assert 0.02 < prefill[-1] < 0.2  # a 2k-token chunk: tens of milliseconds
    assert g.step_seconds(0, 0, 0, 0) == 0.0


def _ttft(client: httpx.Client, prompt: list[int]) -> float:
    t0 = time.monotonic()
    with client.stream(
        "POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "stream": True}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.monotonic() - t0
    raise AssertionError("no token")


def test_more_uncached_tokens_mean_longer_ttft() -> None:
    # speed 2: a 3000-token prefill is ~50 ms, a 100-token one ~4 ms.
    config = EngineConfig(speed=2, num_blocks=2048, max_model_len=4096)
    with SimEngineThread(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as c:
        short = [1000 + i for i in range(100)]
        long_ = [5000 + i for i in range(3000)]
        t_short = _ttft(c, short)
        t_long = _ttft(c, long_)
        t_long_cached = _ttft(c, long_)  # 2992 of 3000 tokens now come from the cache
    assert t_long > t_short * 2
    assert t_long_cached < t_long / 2


def test_busier_engine_means_longer_queue() -> None:
    config = EngineConfig(speed=4, num_blocks=2048, max_model_len=2048, max_num_seqs=2)
    with SimEngineThread(config) as sim:

        async def one(client: httpx.AsyncClient, i: int) -> float:
            t0 = time.monotonic()
            body = {"prompt": [100 + i] * 200, "max_tokens": 40, "ignore_eos": True}
            await client.post("/v1/completions", json=body)
            return time.monotonic() - t0

        async def burst(n: int) -> list[float]:
            async with httpx.AsyncClient(base_url=sim.url, timeout=60) as client:
                return list(await asyncio.gather(*(one(client, i) for i in range(n))))

        alone = asyncio.run(burst(1))[0]
        crowd = asyncio.run(burst(8))
        metrics = httpx.get(f"{sim.url}/metrics").text
    # With 2 slots, 8 requests run in 4 waves: the last ones wait ~3 waves in the queue.
    assert max(crowd) > 2.5 * alone
    assert sorted(crowd)[-1] > sorted(crowd)[1] * 1.5
    queue_lines = [
        x for x in metrics.splitlines() if x.startswith("vllm:request_queue_time_seconds_sum")
    ]
    assert queue_lines and float(queue_lines[0].split()[-1]) > 0


@pytest.mark.parametrize("budget", [64, 512])
def test_chunked_prefill_respects_the_token_budget(budget: int) -> None:
    cache = SimCache(CacheSpec(groups=(FA16,), num_blocks=256, max_num_scheduled_tokens=budget))
    sched = Scheduler(cache, max_num_seqs=4, max_num_scheduled_tokens=budget)
    for i in range(3):
        sched.add(CacheRequest(f"r{i}", tuple(range(i * 1000, i * 1000 + 700)), max_tokens=3))
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        assert plan.num_tokens <= budget
        assert len(plan.scheduled) <= 4
        sched.complete(plan, lambda _r: 7, lambda _r, _t: False)
        steps += 1
    assert steps >= (3 * 700) // budget


def test_batch_limit_and_preemption_when_the_pool_is_full() -> None:
    # 24 usable blocks of 16 tokens; three 100-token requests decoding 200 tokens cannot fit.
    cache = SimCache(CacheSpec(groups=(FA16,), num_blocks=25, max_model_len=400))
    sched = Scheduler(cache, max_num_seqs=2, max_num_scheduled_tokens=512)
    for i in range(3):
        sched.add(CacheRequest(f"r{i}", tuple(range(i * 1000, i * 1000 + 100)), max_tokens=200))
    done: list[str] = []
    while sched.has_work():
        plan = sched.schedule()
        assert sched.num_running <= 2
        done += sched.complete(plan, lambda _r: 7, lambda _r, _t: False).finished
    assert sorted(done) == ["r0", "r1", "r2"]
    assert sched.num_preemptions > 0
    assert cache.usage() == 0.0


def test_admission_waits_for_requests_that_arrived_in_time() -> None:
    """`schedule(admissible)`: a waiting request that may not join stops admission there
    (FCFS), and joins a later step."""
    cache = SimCache(CacheSpec(groups=(FA16,), num_blocks=256))
    sched = Scheduler(cache, max_num_seqs=4, max_num_scheduled_tokens=2048)
    for i in range(3):
        sched.add(CacheRequest(f"r{i}", tuple(range(i * 1000, i * 1000 + 64)), max_tokens=5))
    plan = sched.schedule(lambda rid: rid == "r0")
    assert [s.request_id for s in plan.scheduled] == ["r0"]
    sched.complete(plan, lambda _r: 7, lambda _r, _t: False)
    plan = sched.schedule(lambda rid: rid != "r2")  # r1 may join now; r2 not yet
    assert [(s.request_id, s.new) for s in plan.scheduled] == [("r0", False), ("r1", True)]
    sched.complete(plan, lambda _r: 7, lambda _r, _t: False)
    assert "r2" in [s.request_id for s in sched.schedule().scheduled]


def _engine_decoding(speed: float) -> tuple[Engine, RequestHandle]:
    engine = Engine(EngineConfig(profile="dense", speed=speed, seed=0))
    handle = engine.submit(
        GenerateRequest("long", list(range(100, 164)), max_tokens=100_000, ignore_eos=True)
    )
    return engine, handle


def test_a_blocked_event_loop_does_not_stretch_the_gpus_steps() -> None:
    """The API side may hold the event loop (vLLM tokenizes in another process than its
    EngineCore): the modelled GPU keeps its step schedule meanwhile, and catches up after."""

    async def go() -> tuple[int, float]:
        engine, handle = _engine_decoding(speed=1.0)
        await engine.start()
        await asyncio.sleep(0.05)
        started, steps0 = time.monotonic(), engine.steps
        for _ in range(4):
            time.sleep(0.05)  # a request being parsed and tokenized on the loop
            await asyncio.sleep(0.02)
        elapsed = time.monotonic() - started
        done = engine.steps - steps0
        await engine.stop()
        assert handle.admitted_at is not None
        return done, elapsed

    done, elapsed = asyncio.run(go())
    step_s = DEFAULT_GPU.step_seconds(0, 0, 1, 100)
    # one step per modelled step time over the whole period, blocked parts included (the
    # loop ran only ~30% of it; with stretched steps it would be far fewer)
    assert done >= 0.8 * elapsed / step_s, (done, elapsed, step_s)


def test_a_request_that_arrives_after_a_step_began_waits_for_the_next() -> None:
    """The loop is held across a step's end (an API handler tokenizing); the request it then
    submits arrived after the next step began, so it joins the one after (vLLM's busy loop
    reads new requests between steps), about a step later, not at once."""
    speed = 0.01  # decode steps of ~0.6 s

    async def go() -> tuple[float, float]:
        engine, _ = _engine_decoding(speed)
        await engine.start()
        steps = engine.steps
        while engine.steps == steps:  # a step has just ended and the next begun
            await asyncio.sleep(0.001)
        step_s = DEFAULT_GPU.step_seconds(0, 0, 1, 70) / speed
        await asyncio.sleep(step_s - 0.05)
        time.sleep(0.1)  # held across that step's end
        late = engine.submit(GenerateRequest("late", list(range(500, 520)), max_tokens=1))
        while late.admitted_at is None:
            await asyncio.sleep(0.005)
        await engine.stop()
        return late.admitted_at - late.arrival, step_s

    waited, step_s = asyncio.run(go())
    assert 0.5 * step_s <= waited <= 1.05 * step_s, (waited, step_s)
