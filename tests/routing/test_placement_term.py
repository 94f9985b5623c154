"""The `placement` term against a plain model of an LRU pool, and what it does to decisions:
new conversations go where their working set fits; off, nothing changes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import PolicyConfig
from kvroute.router.routing.policy import CACHE, LoadModel, RouteInput, make_policy
from kvroute.router.routing.records import Candidate, Decision, PlacementInput
from kvroute.router.routing.terms.placement import displaced_tokens
from kvroute.router.routing.working_set import WorkingSet
from tests.router.test_policy import fleet


def resident(pool: list[tuple[str, int]], cap: int) -> dict[str, int]:
    """Tokens each conversation keeps in an LRU pool of `cap` tokens, `pool` newest first
    (the least recently used are evicted first)."""
    out: dict[str, int] = {}
    room = cap
    for name, tokens in pool:
        kept = max(0, min(tokens, room))
        out[name] = out.get(name, 0) + kept
        room -= kept
    return out


def reference_displaced(
    others: list[tuple[str, int]], cap: int, own: str, reuse: int, n: int
) -> int:
    """What placing `own` (holding `reuse` tokens there, `n` after) pushes out of the
    others: their residency before, with `own` holding its reuse on top, minus after."""
    before = resident([(own, reuse), *others], cap)
    after = resident([(own, n), *others], cap)
    return sum(before[name] - after[name] for name, _ in others)


conversations = st.lists(st.integers(1, 3000), min_size=0, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    sizes=conversations,
    cap=st.integers(1, 20000),
    n=st.integers(1, 8000),
    reuse_frac=st.floats(0.0, 1.0),
    own_on_worker=st.booleans(),
)
def test_without_writes_it_is_what_an_lru_pool_evicts(
    sizes: list[int], cap: int, n: int, reuse_frac: float, own_on_worker: bool
) -> None:
    ws = WorkingSet(max_entries=1000, idle_s=1e9, prior_interval_s=60.0)
    for i, tokens in enumerate(sizes):  # oldest first; written 0 tokens: no write rate
        ws.note(f"c{i}", None, "w0", tokens, 0, now=float(i))
    own = ws.note("me", None, "w0" if own_on_worker else "w1", 500, 0, now=float(len(sizes)))
    reuse = int(reuse_frac * n)
    placement = PlacementInput(ws, own, {"w0": cap}, now=float(len(sizes)))
    got = displaced_tokens(placement, "w0", n, reuse)
    newest_first = [(f"c{i}", t) for i, t in reversed(list(enumerate(sizes)))]
    assert got == pytest.approx(reference_displaced(newest_first, cap, "me", reuse, n))


@settings(max_examples=200, deadline=None)
@given(sizes=conversations, cap=st.integers(1, 20000), n=st.integers(1, 8000))
def test_with_writes_each_token_is_weighted_by_its_chance_to_return(
    sizes: list[int], cap: int, n: int
) -> None:
    """Weighted by P(return before it would be evicted anyway): never more than the LRU
    count, and less the faster the worker writes or the slower conversations return."""
    values = []
    for prior, written in ((1.0, 1000), (1.0, 5000), (30.0, 5000)):
        ws = WorkingSet(max_entries=1000, idle_s=1e9, prior_interval_s=prior)
        for i, tokens in enumerate(sizes):
            ws.note(f"c{i}", None, "w0", tokens, written, now=float(i))
        placement = PlacementInput(ws, None, {"w0": cap}, now=float(len(sizes)))
        values.append(displaced_tokens(placement, "w0", n, 0))
    newest_first = [(f"c{i}", t) for i, t in reversed(list(enumerate(sizes)))]
    lru = reference_displaced(newest_first, cap, "me", 0, n)
    assert 0 <= values[0] <= lru + 1e-6
    assert values[1] <= values[0] + 1e-9 and values[2] <= values[1] + 1e-9
    if lru == 0:
        assert values == [0.0, 0.0, 0.0]


def test_a_token_at_the_pools_edge_is_weighted_by_one_minus_exp() -> None:
    ws = WorkingSet(max_entries=10, idle_s=1e9, prior_interval_s=10.0)
    ws.note("a", None, "w0", 1000, 0, now=0.0)
    ws.note("b", None, "w0", 1000, 0, now=0.0)  # written 0: set the rate by hand below
    ws._writes["w0"].rate, ws._writes["w0"].at = 100.0, 0.0  # 100 tokens/s
    placement = PlacementInput(ws, None, {"w0": 2000}, now=0.0)
    # a 1-token prompt pushes out a's last token (position 1999): it would have stayed
    # 1 token / 100 tokens/s = 0.01 s, and a returns every 10 s
    got = displaced_tokens(placement, "w0", 1, 0)
    assert got == pytest.approx(1 - math.exp(-0.01 / 10.0))
    assert displaced_tokens(placement, "w0", 1, 1) == 0.0  # nothing new written
    assert displaced_tokens(placement, "unknown", 1, 0) == 0.0  # no capacity known


def decide(
    reuse: dict[str, int | None], placement: PlacementInput | None, session: str | None, **kw: float
) -> tuple[Decision, dict[str, Candidate]]:
    cfg = PolicyConfig(**kw)  # type: ignore[arg-type]
    policy = make_policy(cfg, LoadModel(cfg, lambda: 1000.0, 5.0))
    d = policy.decide(fleet(2), RouteInput(2000, reuse, session, placement=placement), 0.0)
    return d, {c.name: c for c in d.candidates}


def crowded_w0() -> WorkingSet:
    """w0 holds four 1,000-token conversations that return every 2 s; w1 holds one."""
    ws = WorkingSet(max_entries=100, idle_s=1e9, prior_interval_s=2.0)
    for i in range(4):
        ws.note(f"c{i}", None, "w0", 1000, 0, now=0.0)
    ws.note("c9", None, "w1", 1000, 0, now=0.0)
    return ws


def test_a_new_conversation_leaves_the_worker_whose_pool_is_full() -> None:
    placement = PlacementInput(crowded_w0(), None, {"w0": 4000, "w1": 4000}, now=0.0)
    # w0 holds the system prompt (200 tokens) the request shares: the default takes it there
    reuse: dict[str, int | None] = {"w0": 200, "w1": 0}
    d, _ = decide(reuse, placement, "s")
    assert d.chosen is not None and d.chosen.name == "w0" and d.reason == CACHE
    d, by = decide(reuse, placement, "s", placement_weight=1.0)
    assert d.chosen is not None and d.chosen.name == "w1"
    s = 1 / 20000.0
    assert by["w0"].terms["placement"] == pytest.approx(1800 * s)  # no writes: p = 1
    assert by["w1"].terms["placement"] == 0.0  # 1,000 + 2,000 fit in 4,000
    # a credit like the junction: not part of the estimated time to first token
    assert by["w0"].est_ttft_s < by["w1"].est_ttft_s


def test_a_cold_conversation_goes_where_it_fits_whatever_its_hash() -> None:
    placement = PlacementInput(crowded_w0(), None, {"w0": 4000, "w1": 4000}, now=0.0)
    cold: dict[str, int | None] = {"w0": 0, "w1": 0}
    hashed_to_w0 = []
    for i in range(40):  # sessions whose hash picks w0 without the term
        d, _ = decide(cold, None, f"s{i}")
        if d.chosen is not None and d.chosen.name == "w0":
            hashed_to_w0.append(f"s{i}")
    assert hashed_to_w0
    for session in hashed_to_w0:
        d, _ = decide(cold, placement, session, placement_weight=1.0)
        assert d.chosen is not None and d.chosen.name == "w1"


def test_off_it_prices_nothing_and_the_input_is_not_built() -> None:
    placement = PlacementInput(crowded_w0(), None, {"w0": 4000, "w1": 4000}, now=0.0)
    _, by = decide({"w0": 200, "w1": 0}, placement, "s", placement_weight=0.0)
    assert all(c.terms["placement"] == 0.0 for c in by.values())
