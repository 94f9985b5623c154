"""Policy decisions on constructed candidates (predicted reuse given directly; the index has
its own tests)."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import BreakerConfig, PolicyConfig, WorkerSpec
from kvroute.router.fleet.load import EngineMetrics, LoadTicket
from kvroute.router.fleet.workers import Worker, WorkerRegistry
from kvroute.router.routing.index_view import GroupReuse, ReuseExplanation
from kvroute.router.routing.policy import (
    CACHE,
    LEAST_LOAD,
    ROUND_ROBIN,
    SESSION,
    SPILL,
    Decision,
    LoadModel,
    RouteInput,
    make_policy,
    session_key,
)


def fleet(n: int) -> list[Worker]:
    reg = WorkerRegistry(BreakerConfig())
    return [reg.add(WorkerSpec(name=f"w{i}", url=f"http://127.0.0.1:{9000 + i}")) for i in range(n)]


def policy(name: str = "ttft", **kw: object) -> tuple[PolicyConfig, LoadModel]:
    cfg = PolicyConfig(name=name, **kw)  # type: ignore[arg-type]
    return cfg, LoadModel(cfg, lambda: 1000.0, stale_after_s=5.0)


def test_prefers_reuse_when_loads_equal() -> None:
    cfg, lm = policy()
    p = make_policy(cfg, lm)
    ws = fleet(3)
    d = p.decide(ws, RouteInput(4000, {"w0": 0, "w1": 3200, "w2": 1600}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == CACHE
    assert d.predicted_reuse == 3200
    by = {c.name: c for c in d.candidates}
    assert by["w1"].uncached == 800 and by["w0"].uncached == 4000
    assert by["w1"].est_ttft_s < by["w2"].est_ttft_s < by["w0"].est_ttft_s


def test_queue_outweighs_small_reuse() -> None:
    cfg, lm = policy(prefill_tokens_per_s=10_000.0, saturation_queue_s=100.0)
    p = make_policy(cfg, lm)
    ws = fleet(2)
    LoadTicket(ws[0].load, 50_000)  # 5 s of prefill queued on w0
    d = p.decide(ws, RouteInput(4000, {"w0": 2000, "w1": 0}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1"  # 0.4 s beats 5.2 s
    d = p.decide(ws, RouteInput(100_000, {"w0": 90_000, "w1": 0}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w0"  # 6 s beats 10 s


def test_queue_weight_keeps_requests_with_their_cache_longer() -> None:
    ws = fleet(2)
    LoadTicket(ws[0].load, 3000)  # 0.3 s of prefill queued on w0, which holds 2,000 tokens
    req = RouteInput(4000, {"w0": 2000, "w1": 0}, None)
    for weight, expected in ((1.0, "w1"), (0.25, "w0")):
        cfg, lm = policy(prefill_tokens_per_s=10_000.0, queue_weight=weight)
        d = make_policy(cfg, lm).decide(ws, req, 0.0)
        # weight 1: 0.3 + 0.2 s on w0 against 0.4 s on w1; weight 0.25: 0.075 + 0.2 s
        assert d.chosen is not None and d.chosen.name == expected, weight


def test_spill_when_cache_best_is_saturated() -> None:
    cfg, lm = policy(max_running_per_worker=4)
    p = make_policy(cfg, lm)
    ws = fleet(3)
    for _ in range(4):
        LoadTicket(ws[0].load, 0).prefill_done()  # 4 running decodes: saturated
    d = p.decide(ws, RouteInput(8000, {"w0": 7984, "w1": 16, "w2": 0}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == SPILL
    assert "w0 saturated" in d.detail
    cfg2, lm2 = policy(max_running_per_worker=4, spill=False)
    d = make_policy(cfg2, lm2).decide(ws, RouteInput(8000, {"w0": 7984, "w1": 16}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w0"  # spill off: stays


def test_kv_usage_from_metrics_saturates() -> None:
    cfg, lm = policy()
    ws = fleet(2)
    ws[0].load.engine = EngineMetrics(1, 0, 0.99, at=0.0, own_running_at=0, own_prefilling_at=0)
    d = make_policy(cfg, lm).decide(ws, RouteInput(1000, {"w0": 900, "w1": 0}, None), 1.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == SPILL


def test_other_replicas_load_from_metrics() -> None:
    _, lm = policy()
    ws = fleet(1)
    w = ws[0]
    LoadTicket(w.load, 500)  # one own request, still prefilling
    w.load.engine = EngineMetrics(5, 3, 0.1, at=10.0, own_running_at=1, own_prefilling_at=1)
    c = lm.candidate(w, 0, 100, now=11.0)
    # engine had 8 requests, we sent 1: 7 are others'; 2 of its 3 waiting are others'
    assert c.running == 1 + 7
    assert c.queued_tokens == 500 + 2 * 1000
    stale = lm.candidate(w, 0, 100, now=100.0)  # scrape too old: own accounting only
    assert stale.running == 1 and stale.queued_tokens == 500


def test_cold_requests_use_session_then_least_load() -> None:
    cfg, lm = policy()
    p = make_policy(cfg, lm)
    ws = fleet(4)
    picks = {p.decide(ws, RouteInput(100, {}, "alice"), 0.0).chosen.name for _ in range(5)}  # type: ignore[union-attr]
    assert len(picks) == 1  # sticky
    d = p.decide(ws, RouteInput(100, {"w0": 0}, "alice"), 0.0)
    assert d.reason == SESSION
    spread = collections.Counter(
        p.decide(ws, RouteInput(100, {}, f"user-{i}"), 0.0).chosen.name  # type: ignore[union-attr]
        for i in range(400)
    )
    assert len(spread) == 4
    d = p.decide(ws, RouteInput(100, {}, None), 0.0)
    assert d.reason == LEAST_LOAD
    names = [p.decide(ws, RouteInput(100, {}, None), 0.0).chosen.name for _ in range(8)]  # type: ignore[union-attr]
    assert set(names) == {"w0", "w1", "w2", "w3"}  # equal workers take turns
    LoadTicket(ws[2].load, 10)
    LoadTicket(ws[3].load, 10)
    LoadTicket(ws[0].load, 10)
    assert p.decide(ws, RouteInput(100, {}, None), 0.0).chosen.name == "w1"  # type: ignore[union-attr]


def test_ties_take_turns() -> None:
    """A prompt whose only reuse is a prefix every worker holds ties everywhere: keyless
    requests take turns, keyed ones follow their session's hash (and stay there)."""
    cfg, lm = policy()
    p = make_policy(cfg, lm)
    ws = fleet(4)
    shared = {w.name: 512 for w in ws}
    names = [p.decide(ws, RouteInput(4000, shared, None), 0.0).chosen.name for _ in range(8)]  # type: ignore[union-attr]
    assert collections.Counter(names) == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}
    keyed = collections.Counter(
        p.decide(ws, RouteInput(4000, shared, f"user-{i}"), 0.0).chosen.name  # type: ignore[union-attr]
        for i in range(400)
    )
    assert len(keyed) == 4 and min(keyed.values()) > 40
    again = {p.decide(ws, RouteInput(4000, shared, "alice"), 0.0).chosen.name for _ in range(5)}  # type: ignore[union-attr]
    assert len(again) == 1
    d = p.decide(ws, RouteInput(4000, {**shared, "w3": 1024}, None), 0.0)
    assert d.chosen is not None and d.chosen.name == "w3" and d.reason == CACHE  # no tie


def test_session_moves_off_an_overloaded_home() -> None:
    cfg, lm = policy()
    p = make_policy(cfg, lm)
    ws = fleet(3)
    home = p.decide(ws, RouteInput(100, {}, "bob"), 0.0).chosen
    assert home is not None
    for _ in range(6):
        LoadTicket(home.worker.load, 0)
    moved = p.decide(ws, RouteInput(100, {}, "bob"), 0.0).chosen
    assert moved is not None and moved.name != home.name


def cold_session_after_a_queue_at_home(queued: int, **kw: object) -> tuple[str, Decision]:
    """Route a cold 2,000-token session request once (its hash's home), queue `queued`
    prefill tokens at home and one running request everywhere else (so the hash's bounded
    load sees equal counts), and route the session's next cold request: (home, decision)."""
    cfg, lm = policy(prefill_tokens_per_s=10_000.0, saturation_queue_s=100.0, **kw)
    p = make_policy(cfg, lm)
    ws = fleet(3)
    home = p.decide(ws, RouteInput(2000, {}, "carol"), 0.0).chosen
    assert home is not None
    for w in ws:
        LoadTicket(w.load, queued if w is home.worker else 0)
    return home.name, p.decide(ws, RouteInput(2000, {}, "carol"), 0.0)


def test_cold_session_leaves_its_hash_for_a_worker_without_a_queued_prefill() -> None:
    # 4,000 tokens queued at home: 0.4 s more than elsewhere
    home, d = cold_session_after_a_queue_at_home(4000)
    assert d.chosen is not None and d.chosen.name != home and d.reason == SESSION
    by = {c.name: c for c in d.candidates}
    slack_s = PolicyConfig().session_slack_tokens / 10_000  # at the test's rate
    assert by[home].est_ttft_s - d.chosen.est_ttft_s > slack_s
    # within the slack (100 tokens: 10 ms) the hash still decides
    home, d = cold_session_after_a_queue_at_home(100)
    assert d.chosen is not None and d.chosen.name == home
    # a large slack is the hash with bounded load alone, as before the slack existed
    home, d = cold_session_after_a_queue_at_home(4000, session_slack_tokens=1e12)
    assert d.chosen is not None and d.chosen.name == home


def test_baseline_policies() -> None:
    ws = fleet(3)
    cfg, lm = policy("round_robin")
    rr = make_policy(cfg, lm)
    seq = [rr.decide(ws, RouteInput(10, {"w0": 9}, None), 0.0) for _ in range(6)]
    assert [d.chosen.name for d in seq] == ["w1", "w2", "w0", "w1", "w2", "w0"]  # type: ignore[union-attr]
    assert seq[0].reason == ROUND_ROBIN
    cfg, lm = policy("random", seed=7)
    a = [
        make_policy(cfg, lm).decide(ws, RouteInput(10, {}, None), 0.0).chosen.name for _ in range(1)
    ]  # type: ignore[union-attr]
    r = make_policy(cfg, lm)
    picks = collections.Counter(
        r.decide(ws, RouteInput(10, {}, None), 0.0).chosen.name for _ in range(300)
    )  # type: ignore[union-attr]
    assert len(picks) == 3 and a
    cfg, lm = policy("least_load")
    LoadTicket(ws[0].load, 5000)
    d = make_policy(cfg, lm).decide(ws, RouteInput(10, {"w0": 10}, None), 0.0)
    assert d.chosen is not None and d.chosen.name != "w0"  # ignores the cache
    cfg, lm = policy("session")
    s = make_policy(cfg, lm)
    assert s.decide(ws, RouteInput(10, {}, "k"), 0.0).reason == SESSION
    assert s.decide(ws, RouteInput(10, {}, None), 0.0).reason == LEAST_LOAD


def test_no_candidates() -> None:
    cfg, lm = policy()
    d = make_policy(cfg, lm).decide([], RouteInput(10, {}, None), 0.0)
    assert d.chosen is None and d.reason == "no_worker"


def test_full_attention_only_view() -> None:
    groups = [
        GroupReuse(0, "full_attention", 16, 0, 4096),
        GroupReuse(1, "sliding_window", 16, 1024, 0),
    ]
    exp = ReuseExplanation(0, groups, 16, "swa group has no window at 4096")
    assert exp.full_attention_only() == 4096  # what llm-d/Dynamo would predict
    assert ReuseExplanation(None, []).full_attention_only() is None


def test_session_key_sources() -> None:
    cfg = PolicyConfig()
    assert session_key({"x-session-id": "h"}, {"user": "u"}, cfg) == "h"
    assert session_key({}, {"user": "u"}, cfg) == "u"
    assert session_key({}, {"user": ""}, cfg) is None
    dotted = PolicyConfig(session_header="", session_field="metadata.session")
    assert session_key({"x-session-id": "h"}, {"metadata": {"session": 12}}, dotted) == "12"
    assert session_key({}, {"metadata": "x"}, dotted) is None


def test_affinity_when_nothing_is_reusable() -> None:
    cfg, lm = policy()
    p = make_policy(cfg, lm)
    ws = fleet(3)
    coverage = {"w0": 0, "w1": 3000, "w2": 1000}
    d = p.decide(ws, RouteInput(4000, {"w0": 0, "w1": 0, "w2": 0}, "u", coverage), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == "affinity"
    assert {c.name: c.affinity for c in d.candidates} == coverage
    # a busy w1 loses its affinity credit once its queue outweighs it
    LoadTicket(ws[1].load, 40_000)  # 2 s of queued prefill vs 1.5 * 3000 tokens of credit
    d = p.decide(ws, RouteInput(4000, {}, None, coverage), 0.0)
    assert d.chosen is not None and d.chosen.name == "w2"
    # no coverage anywhere, or the feature off: session / least load as before
    d = p.decide(ws, RouteInput(4000, {}, "u", {"w0": 0}), 0.0)
    assert d.reason == "session"
    cfg0, lm0 = policy(affinity_weight=0.0)
    d = make_policy(cfg0, lm0).decide(ws, RouteInput(4000, {}, None, coverage), 0.0)
    assert d.reason == "least_load"
    # with reuse somewhere: w1 reuses less now but would store the junction at 3500, 2500
    # beyond the fleet's best (1.5 * 2500 tokens of credit outweigh 1000 extra uncached)
    warm = {"w0": 1000, "w1": 0, "w2": 0}
    d = p.decide(fleet(3), RouteInput(4000, warm, None, {"w1": 3500}), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == "affinity"
    assert d.chosen.affinity == 2500
    # a junction only 500 tokens beyond the best reuse (1.5 * 500 = 750) is not worth 1000
    # extra now
    d = p.decide(fleet(3), RouteInput(4000, warm, None, {"w1": 1500}), 0.0)
    assert d.chosen is not None and d.chosen.name == "w0" and d.reason == "cache"
    # coverage equal to the reuse earns nothing; weight 0 is greedy on reuse now
    d = p.decide(fleet(3), RouteInput(4000, warm, None, {"w0": 1000}), 0.0)
    assert d.chosen is not None and d.chosen.name == "w0" and d.chosen.affinity == 0
    d = make_policy(cfg0, lm0).decide(fleet(3), RouteInput(4000, warm, None, {"w1": 3500}), 0.0)
    assert d.chosen is not None and d.chosen.name == "w0" and d.reason == "cache"


def test_junction_credit_is_for_what_others_share_beyond_the_fleets_best() -> None:
    cfg, lm = policy(affinity_weight=2.0)
    p = make_policy(cfg, lm)
    # w0 reuses 3,000 already: a junction at 3,500 on w1 makes only 500 more reusable, and
    # 2 * 500 tokens of credit do not pay for 3,000 extra uncached now
    d = p.decide(
        fleet(3), RouteInput(4000, {"w0": 3000, "w1": 0, "w2": 0}, None, {"w1": 3500}), 0.0
    )
    assert d.chosen is not None and d.chosen.name == "w0" and d.reason == "cache"
    assert {c.name: c.affinity for c in d.candidates} == {"w0": 0, "w1": 500, "w2": 0}
    cold = {"w0": 0, "w1": 0, "w2": 0}
    # the whole prompt is the conversation's own history: no credit
    d = p.decide(fleet(3), RouteInput(4000, cold, "s", {"w1": 3000}, own_from=0), 0.0)
    assert d.reason == "session" and all(c.affinity == 0 for c in d.candidates)
    # its own history starts at 2,000 tokens (before: a prefix others asked for too)
    d = p.decide(fleet(3), RouteInput(4000, cold, "s", {"w1": 3000}, own_from=2000), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.reason == "affinity"
    assert d.chosen.affinity == 2000
    # the rule before: any covered prefix, counted from the worker's own reuse
    old_cfg, old_lm = policy(affinity_weight=2.0, junction_shared_only=False)
    old = make_policy(old_cfg, old_lm)
    d = old.decide(fleet(3), RouteInput(4000, cold, "s", {"w1": 3000}, own_from=0), 0.0)
    assert d.chosen is not None and d.chosen.name == "w1" and d.chosen.affinity == 3000
    d = old.decide(
        fleet(3), RouteInput(4000, {"w0": 3000, "w1": 0, "w2": 0}, None, {"w1": 3500}), 0.0
    )
    assert d.chosen is not None and d.chosen.name == "w1" and d.chosen.affinity == 3500


def test_running_requests_cost_the_same_where_the_conversation_lives() -> None:
    """w0 holds a follow-up's conversation and runs 5 requests, w1 holds only the shared
    system prompt and runs 2: both pay 100 tokens a running request, so the 144 tokens w0
    saves do not outweigh its 300 tokens more of running load."""
    ws = fleet(2)
    for _ in range(5):
        LoadTicket(ws[0].load, 0)
    for _ in range(2):
        LoadTicket(ws[1].load, 0)
    cfg, lm = policy(tokens_per_running=100)
    follow_up = RouteInput(1000, {"w0": 800, "w1": 656}, "s")
    d = make_policy(cfg, lm).decide(ws, follow_up, 0.0)
    by = {c.name: c for c in d.candidates}
    # 200 + 500 tokens on w0 against 344 + 200 on w1, at 20,000 tokens/s
    assert by["w0"].terms["running"] == pytest.approx(500 / 20_000)
    assert by["w0"].est_ttft_s == pytest.approx(700 / 20_000)
    assert by["w1"].est_ttft_s == pytest.approx(544 / 20_000)
    assert d.chosen is not None and d.chosen.name == "w1"
    # with w1 as loaded as w0 the conversation stays
    for _ in range(3):
        LoadTicket(ws[1].load, 0)
    d = make_policy(cfg, lm).decide(ws, follow_up, 0.0)
    assert d.chosen is not None and d.chosen.name == "w0"


def test_a_cold_request_waits_a_queue_in_full() -> None:
    """Where a worker reuses nothing of the request its queue counts in full: two cold
    re-prefills whose full-attention blocks sit on one busy worker do not stack there for
    the junction credit (they did under the 0.25 queue weight)."""
    cfg, lm = policy()
    ws = fleet(2)
    LoadTicket(ws[0].load, 6900)  # another cold 6,900-token prefill in flight on w0
    # an agent's own history from 2,500 tokens (other sessions asked for the first 2,500)
    req = RouteInput(6900, {"w0": 0, "w1": 0}, None, {"w0": 6800}, own_from=2500)
    d = make_policy(cfg, lm).decide(ws, req, 0.0)
    # w0: 6,900 queued + 6,900 own (+ 5 ms for the running one), less 1.5 * 2,500 tokens of
    # junction credit = 10,150 tokens; w1: 6,900
    assert d.chosen is not None and d.chosen.name == "w1"
    by = {c.name: c.est_ttft_s for c in d.candidates}
    assert abs(by["w0"] - (13_800 / 20_000 + 0.005)) < 1e-9
    off, lm_off = policy(full_queue_without_reuse=False)
    d = make_policy(off, lm_off).decide(ws, req, 0.0)
    # the old weighting: 0.25 * 6,900 + 6,900 + 100 - 3,750 = 4,975 tokens, under w1's 6,900
    assert d.chosen is not None and d.chosen.name == "w0" and d.reason == "affinity"
    # with reuse there the queue keeps its weight (a request stays with its cache)
    warm = RouteInput(6900, {"w0": 3000, "w1": 0}, None)
    c0 = next(c for c in make_policy(cfg, lm).decide(ws, warm, 0.0).candidates if c.name == "w0")
    # its running request is charged 100 tokens (5 ms)
    assert abs(c0.est_ttft_s - ((0.25 * 6900 + 3900) / 20_000 + 0.005)) < 1e-9


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_ranking_does_not_depend_on_the_configured_rate(data: st.DataObject) -> None:
    """Every term of the estimate is in prefill tokens, so a fleet's true
    rate changes the seconds, not the choice (saturation, a wall-time bound, set aside).
    Rates a power of two apart scale every product exactly, so near-ties cannot flip."""
    n = data.draw(st.integers(2, 5))
    n_tokens = data.draw(st.integers(16, 8000))
    reuse = {f"w{i}": data.draw(st.none() | st.integers(0, n_tokens)) for i in range(n)}
    coverage = {f"w{i}": data.draw(st.integers(0, n_tokens)) for i in range(n)}
    own_from = data.draw(st.none() | st.integers(0, n_tokens // 16).map(lambda b: b * 16))
    session = data.draw(st.sampled_from([None, "alice"]))
    loads = [(data.draw(st.integers(0, 6)), data.draw(st.integers(0, 20_000))) for _ in range(n)]
    req = RouteInput(n_tokens, reuse, session, data.draw(st.none() | st.just(coverage)), own_from)
    choices = []
    for rate in (16_384.0, 4_096.0):
        cfg, lm = policy(prefill_tokens_per_s=rate, saturation_queue_s=1e9)
        ws = fleet(n)
        for w, (running, queued) in zip(ws, loads, strict=True):
            for j in range(running):
                LoadTicket(w.load, queued if j == 0 else 0)
        d = make_policy(cfg, lm).decide(ws, req, 0.0)
        assert d.chosen is not None
        choices.append((d.chosen.name, d.reason))
    assert choices[0] == choices[1]
