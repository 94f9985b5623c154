"""The TTFT policy's fast pass picks what the full pass over every candidate picks.

`TTFTPolicy.pick` finds the least cost at C speed and builds the full ranking key only for
the candidates tied on it, and skips the lower-tier scan when the request has no tiers. On
random fleets with many exact ties (few distinct loads and reuses), the chosen worker must be
one of those `min(candidates, key=(cost, -reuse, running))` ties for, spilled as before, and
every candidate's load must be the worker's own plus what its engine scrape adds.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import BreakerConfig, PolicyConfig, WorkerSpec
from kvroute.router.fleet.load import EngineMetrics
from kvroute.router.fleet.workers import WorkerRegistry
from kvroute.router.routing.cost import LoadModel
from kvroute.router.routing.index_view import TierReuse
from kvroute.router.routing.policy import CACHE, SPILL, TTFTPolicy
from kvroute.router.routing.records import Candidate, RouteInput

STALE_S = 5.0
NOW = 100.0


class _W(NamedTuple):
    running: int
    queued: int
    reuse: int | None
    engine: EngineMetrics | None
    cpu: int


_engine = st.builds(
    EngineMetrics,
    st.sampled_from([0.0, 3.0, 9.0]),
    st.sampled_from([0.0, 2.0]),
    st.sampled_from([None, 0.2, 0.99]),
    st.sampled_from([NOW - 1.0, NOW - 10.0]),  # fresh or stale
    st.just(1),
    st.just(0),
)
_worker = st.builds(
    _W,
    st.sampled_from([0, 1, 4, 40]),
    st.sampled_from([0, 512, 4096, 200_000]),
    st.sampled_from([None, 0, 256, 2048, 4096]),
    st.one_of(st.none(), _engine),
    st.sampled_from([0, 0, 512]),
)


def _full_pass(cands: list[Candidate]) -> list[Candidate]:
    """The candidates the ranking key ties for first place (ties are spread, not broken by
    name: `test_ties_take_turns`)."""

    def rank(c: Candidate) -> tuple[float, int, int]:
        return (c.cost_s, -(c.reuse or 0), c.running)

    top = min(map(rank, cands))
    return [c for c in cands if rank(c) == top]


@settings(max_examples=300, deadline=None)
@given(
    workers=st.lists(_worker, min_size=1, max_size=40),
    spill=st.booleans(),
    with_tiers=st.booleans(),
    shuffle=st.randoms(use_true_random=False),
)
def test_fast_pick_is_the_full_pass(
    workers: list[_W], spill: bool, with_tiers: bool, shuffle: random.Random
) -> None:
    cfg = PolicyConfig(spill=spill)
    policy = TTFTPolicy(LoadModel(cfg, lambda: 1000.0, STALE_S), cfg)
    registry = WorkerRegistry(BreakerConfig())
    fleet = []
    reuse: dict[str, int | None] = {}
    tiers: dict[str, TierReuse] = {}
    for i, w in enumerate(workers):
        worker = registry.add(WorkerSpec(name=f"w{i:02d}", url=f"http://127.0.0.1:{9000 + i}"))
        worker.load.running = w.running
        worker.load.queued_prefill_tokens = w.queued
        worker.load.engine = w.engine
        reuse[worker.name] = w.reuse
        if with_tiers and w.cpu:
            tiers[worker.name] = TierReuse(w.cpu, 0)
        fleet.append(worker)
    shuffle.shuffle(fleet)
    req = RouteInput(4096, reuse, "s", tiers=tiers or None)
    d = policy.decide(fleet, req, NOW)
    assert d.chosen is not None
    for c in d.candidates:
        others_running, _ = c.worker.load.others(NOW, STALE_S)
        assert c.running == c.worker.load.running + others_running
    if any(c.reuse or c.cpu_tokens for c in d.candidates):
        assert d.reason in (CACHE, SPILL)  # reuse, or a lower tier's, is evidence: not cold
    if d.reason not in (CACHE, SPILL) and not any(c.affinity for c in d.candidates):
        return  # the cold path and the affinity step are not the fast pass's
    best = _full_pass(d.candidates)
    calm = [c for c in d.candidates if not c.saturated]
    if best[0].saturated and spill and calm:
        assert d.reason == SPILL
        best = _full_pass(calm)
    assert any(d.chosen is c for c in best)
