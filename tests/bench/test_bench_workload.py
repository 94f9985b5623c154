"""Workload generator, text synthesis and trace formats (no network)."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.sim.tokenizer import SimTokenizer
from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import (
    MOONCAKE_BLOCK_TOKENS,
    TraceError,
    TraceHeader,
    TraceRequest,
    from_mooncake,
    parse_mooncake_line,
    read_jsonl,
    read_mooncake,
    write_jsonl,
)
from kvroute.testbed.workload import (
    PRESETS,
    ChatSpec,
    WorkloadSpec,
    generate,
    live_working_set_tokens,
)


@pytest.fixture(scope="module")
def space() -> TokenSpace:
    return TokenSpace.discover()


@pytest.fixture(scope="module")
def tok() -> SimTokenizer:
    return SimTokenizer()


def test_space_uses_the_sim_tokenizer_and_lengths_are_exact(space: TokenSpace) -> None:
    assert space.exact, "the sim's tokenizer.json should be found"
    for n in (1, 7, 300, 2000):
        assert space.count_tokens(space.text(("k", n), n)) == n
    # Concatenated blocks stay additive: what Mooncake replay relies on.
    a, b = space.text(("a",), 512), space.text(("b",), 100)
    assert space.count_tokens(a + b) == 612


def test_space_is_deterministic_and_prefix_closed(space: TokenSpace) -> None:
    assert space.text(("x", 1), 50) == TokenSpace.discover().text(("x", 1), 50)
    assert space.text(("x", 1), 80).startswith(space.text(("x", 1), 50))
    assert space.text(("x", 1), 50) != space.text(("x", 2), 50)


def test_fallback_space_approximates_with_words() -> None:
    fb = TokenSpace.fallback()
    assert not fb.exact
    assert len(fb.text(("k",), 40).split()) == 40
    assert fb.count_tokens("abc") is None


def test_generate_is_seeded(space: TokenSpace) -> None:
    spec = PRESETS["smoke"]
    a = generate(spec, space)
    b = generate(spec, space)
    c = generate(replace(spec, seed=spec.seed + 1), space)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    assert [r.to_json() for r in a] != [r.to_json() for r in c]
    assert [r.t for r in a] == sorted(r.t for r in a)


def _sessions(reqs: list[TraceRequest]) -> dict[str, list[TraceRequest]]:
    out: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        out.setdefault(r.session, []).append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r.turn)
    return out


def test_sessions_grow_with_history_and_keep_their_tenant(space: TokenSpace) -> None:
    reqs = generate(PRESETS["default"], space)
    sessions = _sessions(reqs)
    kinds = {r.kind for r in reqs}
    assert kinds == {"chat", "agent", "burst"}
    multi = [s for s in sessions.values() if len(s) > 1]
    assert multi
    for turns in multi:
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in itertools.pairwise(turns):
            assert prev.messages is not None and cur.messages is not None
            n = len(prev.messages)
            # The next turn resends the previous request, then the answer, then new input.
            assert cur.messages[:n] == prev.messages
            assert cur.messages[n]["role"] == "assistant"
            assert cur.t >= prev.t
            assert cur.prompt_tokens > prev.prompt_tokens
            assert cur.cache_salt == prev.cache_salt
            assert cur.user == prev.user
    agents = [s for s in multi if s[0].kind == "agent"]
    assert agents
    for turns in agents:
        # Tool output makes the context grow by hundreds of tokens per turn.
        growth = [b.prompt_tokens - a.prompt_tokens for a, b in itertools.pairwise(turns)]
        assert min(growth) >= 200
        assert turns[-1].prompt_tokens <= PRESETS["default"].agent.max_context_tokens


def test_tenants_salts_and_shared_prefixes(space: TokenSpace) -> None:
    spec = PRESETS["default"]
    reqs = generate(spec, space)
    salts = {r.cache_salt for r in reqs}
    assert None in salts
    assert len(salts - {None}) >= 2
    # All chat sessions of one tenant share one system prompt; tenants differ.
    system_by_tenant: dict[str, set[str]] = {}
    for r in reqs:
        if r.kind == "chat" and r.messages is not None and r.user is not None:
            tenant = r.user.split("/")[0]
            system_by_tenant.setdefault(tenant, set()).add(r.messages[0]["content"])
    assert all(len(v) == 1 for v in system_by_tenant.values())
    assert len({next(iter(v)) for v in system_by_tenant.values()}) == len(system_by_tenant)
    # A burst's requests share a long document and arrive within the burst window.
    bursts = [r for r in reqs if r.kind == "burst" and r.session.startswith("burst-00-")]
    assert len(bursts) == spec.burst.size
    docs = {r.messages[0]["content"][:1000] for r in bursts if r.messages}
    assert len(docs) == 1
    assert max(r.t for r in bursts) - min(r.t for r in bursts) <= spec.burst.window_s


def test_prompt_tokens_match_the_sim_tokenizer(space: TokenSpace, tok: SimTokenizer) -> None:
    reqs = generate(PRESETS["smoke"], space)
    for r in reqs[:20]:
        assert r.messages is not None
        ids = tok.chat_ids(r.messages)
        # Template overhead: a few tokens per message.
        assert r.prompt_tokens <= len(ids) <= r.prompt_tokens + 8 * len(r.messages) + 8


def test_jsonl_round_trip_and_errors(space: TokenSpace, tmp_path: Path) -> None:
    reqs = generate(PRESETS["smoke"], space)
    path = tmp_path / "t.jsonl"
    assert write_jsonl(path, reqs, TraceHeader("test", 1, {"a": 1})) == len(reqs)
    back = read_jsonl(path)
    assert [r.to_json() for r in back] == [r.to_json() for r in reqs]

    bad = tmp_path / "bad.jsonl"
    good_line = json.dumps(reqs[0].to_json())
    for line, msg in [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({**reqs[0].to_json(), "color": "red"}), "unknown fields"),
        (json.dumps({**reqs[0].to_json(), "prompt": "x"}), "exactly one"),
        (json.dumps({**reqs[0].to_json(), "max_tokens": 0}), "max_tokens"),
        (json.dumps({"id": "x"}), "missing"),
    ]:
        bad.write_text(good_line + "\n" + line + "\n")
        with pytest.raises(TraceError, match=msg) as exc:
            read_jsonl(bad)
        assert ":2:" in str(exc.value)


def _mc(ts: int, n_in: int, ids: list[int], n_out: int = 10) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_mooncake_equal_hash_ids_give_equal_tokens(
    space: TokenSpace, tok: SimTokenizer, tmp_path: Path
) -> None:
    lines = [
        _mc(3000, 1100, [1, 2, 3]),
        _mc(1000, 1024, [1, 2]),
        _mc(2000, 700, [1, 9]),
        _mc(2500, 300, [1]),
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = from_mooncake(read_mooncake(path), space, model="m", time_scale=2.0)
    assert [r.t for r in reqs] == [0.0, 0.5, 0.75, 1.0]  # sorted, relative, scaled
    by_len = {r.prompt_tokens: r for r in reqs}
    ids = {n: tok.encode(by_len[n].prompt or "", add_special_tokens=False) for n in by_len}
    for n, toks in ids.items():
        assert len(toks) == n
    b = MOONCAKE_BLOCK_TOKENS
    assert ids[1100][: 2 * b] == ids[1024]  # blocks 1, 2 shared
    assert ids[700][:b] == ids[1024][:b]  # block 1 shared
    assert ids[700][b:] != ids[1024][b:700]  # block 9 differs from block 2
    assert ids[300] == ids[1024][:300]  # a partial block is a prefix of the full one


def test_mooncake_line_errors(tmp_path: Path) -> None:
    for obj, msg in [
        ({"timestamp": 1, "input_length": 10, "output_length": 1}, "hash_ids"),
        (_mc(1, 1000, [1]), "expected 2 blocks"),
        (_mc(-1, 10, [1]), "timestamp"),
        ({**_mc(1, 10, [1]), "hash_ids": [True]}, "hash_ids"),
        ({**_mc(1, 10, [1]), "input_length": "10"}, "input_length"),
    ]:
        with pytest.raises(TraceError, match=msg):
            parse_mooncake_line(obj)
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps(_mc(1, 10, [1])) + "\n{oops\n")
    with pytest.raises(TraceError, match=":2:"):
        list(read_mooncake(path))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)
_fields = st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "x"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(_fields, _json | st.lists(st.integers(), max_size=4)) | _json)
def test_mooncake_parser_only_raises_trace_error(obj: object) -> None:
    try:
        rec = parse_mooncake_line(obj)
    except TraceError:
        return
    assert rec.input_length >= 0 and len(rec.hash_ids) * MOONCAKE_BLOCK_TOKENS >= rec.input_length


def test_spec_defaults_are_sane() -> None:
    spec = WorkloadSpec()
    assert 0 <= spec.salted_fraction <= 1
    assert spec.agent.tool_output_tokens[0] >= 100


def test_pool_pressure_preset_is_long_conversations_within_the_context(
    space: TokenSpace, tok: SimTokenizer
) -> None:
    reqs = generate(PRESETS["pool-pressure"], space)
    spec = PRESETS["pool-pressure"].chat
    assert {r.kind for r in reqs} == {"chat"} and all(r.cache_salt is None for r in reqs)
    turns: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        turns.setdefault(r.session, []).append(r)
    assert len(turns) == spec.sessions
    for rs in turns.values():
        assert len(rs) <= spec.turns[1]
        # a conversation stops early only where its next turn would outgrow the context
        last = max(rs, key=lambda r: r.turn)
        assert last.prompt_tokens + last.max_tokens <= spec.max_context_tokens
    longest = max(reqs, key=lambda r: r.prompt_tokens)
    assert 5000 < longest.prompt_tokens < spec.max_context_tokens
    # what the engine's chat template makes of it still fits its 8,192-token context
    rendered = tok.chat_ids(longest.messages or [])
    assert len(rendered) + longest.max_tokens <= 8192
    assert sum(len(rs) >= spec.turns[0] for rs in turns.values()) > len(turns) // 2


def test_chat_context_cap_ends_a_conversation_early(space: TokenSpace) -> None:
    chat = ChatSpec(sessions=3, turns=(12, 12), user_tokens=(300, 300), answer_tokens=(50, 50))
    spec = WorkloadSpec(chat=chat, agent=replace(WorkloadSpec().agent, sessions=0))
    spec = replace(spec, burst=replace(spec.burst, bursts=0))
    full = generate(spec, space)
    capped = generate(replace(spec, chat=replace(chat, max_context_tokens=2500)), space)
    assert len(full) == 36
    assert 0 < len(capped) < len(full)
    assert all(r.prompt_tokens + r.max_tokens <= 2500 for r in capped)
    # the turns kept are the same requests as without the cap
    assert {r.id: r for r in full}.keys() >= {r.id for r in capped}
    assert all(r == next(f for f in full if f.id == r.id) for r in capped)


def test_live_working_set_is_clients_times_the_mean_conversation() -> None:
    def req(session: str, turn: int, tokens: int) -> TraceRequest:
        return TraceRequest(
            id=f"{session}-{turn}", t=0.0, session=session, turn=turn, kind="chat", model=None,
            messages=None, prompt="x", max_tokens=1, cache_salt=None, think_time=0.0,
            user=None, prompt_tokens=tokens,
        )  # fmt: skip

    reqs = [req("a", 0, 100), req("a", 1, 300), req("b", 0, 1000)]
    # a averages 200 tokens over its turns, b 1000: a client holds 600 on average
    assert live_working_set_tokens(reqs, 1) == pytest.approx(600)
    assert live_working_set_tokens(reqs, 2) == pytest.approx(1200)
    assert live_working_set_tokens(reqs, 5) == pytest.approx(1200)  # only two conversations
    assert live_working_set_tokens([], 4) == 0.0
