"""The local tokenizer gives exactly vLLM's ids: compared with vLLM's own rendering and
tokenization (transformers' apply_chat_template inside) on random conversations."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenize_helpers import conversations, metaspace_conversations, plain_text, text, tools

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.router.tokenize.spec import TokenizerSpec

pytestmark = pytest.mark.vllm
SETTINGS = settings(
    max_examples=int(os.environ.get("KVROUTE_TOKENIZE_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
CHAT = "/v1/chat/completions"


def _local(model_dir: Path, **spec: Any) -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(model_dir), **spec), cache=PrefixCache(64, 1 << 24)
    )


def _compare(
    tok: LocalTokenizer,
    oracle: Any,
    model_dir: Path,
    body: dict[str, Any],
    server: dict[str, Any] | None = None,
    allow_not_exact: bool = False,
) -> None:
    before = copy.deepcopy(body)
    want = oracle.ask(model_dir, CHAT, body, server)
    try:
        ids, _ = tok.chat_ids(body)
    except NotExact:
        # No ids (the router routes without evidence); allowed only where vLLM is ambiguous.
        assert allow_not_exact or want.get("ids") == [], "no ids for a request vLLM renders"
        return
    except TokenizeError as exc:
        assert "error" in want, f"we refused ({exc}) but vLLM rendered {want.get('text')!r}"
        return
    assert body == before, "the request body was mutated"
    assert "error" not in want, f"vLLM refused ({want['error']}) but we rendered"
    if ids != want["ids"]:
        text, _ = tok.render_chat(body)
        assert text == want["text"]
    assert ids == want["ids"]


@st.composite
def chat_bodies(
    draw: st.DrawFn, convs: st.SearchStrategy[list[dict[str, Any]]], with_tools: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": draw(convs)}
    last = body["messages"][-1]
    if last["role"] == "assistant" and draw(st.booleans()):
        body["add_generation_prompt"] = False
        body["continue_final_message"] = True
    elif draw(st.booleans()):
        body["add_generation_prompt"] = draw(st.booleans())
    if with_tools and draw(st.booleans()):
        body["tools"] = draw(tools)
    if draw(st.integers(0, 3)) == 0:
        body["reasoning_effort"] = draw(st.sampled_from(["none", "low", "high"]))
    if draw(st.integers(0, 3)) == 0:
        body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
    if draw(st.integers(0, 5)) == 0:
        body["add_special_tokens"] = True
    if draw(st.integers(0, 4)) == 0:
        body["documents"] = [{"title": draw(plain_text), "text": draw(plain_text)}]
    return body


@SETTINGS
@given(body=chat_bodies(conversations()))
def test_chatml_matches_vllm(
    model_dirs: dict[str, Path], oracle: Any, body: dict[str, Any]
) -> None:
    _compare(_local(model_dirs["chatml"]), oracle, model_dirs["chatml"], body)


@SETTINGS
@given(body=chat_bodies(conversations()))
def test_llama3_openai_content_format_matches_vllm(
    model_dirs: dict[str, Path], oracle: Any, body: dict[str, Any]
) -> None:
    _compare(_local(model_dirs["llama3"]), oracle, model_dirs["llama3"], body)


SIM_MODEL = Path(__file__).resolve().parents[2] / "kvroute" / "sim" / "model"


@SETTINGS
@given(body=chat_bodies(conversations()))
def test_sim_model_matches_vllm(oracle: Any, body: dict[str, Any]) -> None:
    """The simulated engine's shipped model directory (kvroute/sim/model) as the router would use
    it."""
    _compare(_local(SIM_MODEL), oracle, SIM_MODEL, body)


@SETTINGS
@given(body=chat_bodies(metaspace_conversations(), with_tools=False))
def test_metaspace_matches_vllm(
    model_dirs: dict[str, Path], oracle: Any, body: dict[str, Any]
) -> None:
    _compare(_local(model_dirs["metaspace"]), oracle, model_dirs["metaspace"], body)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(["chatml", "llama3", "metaspace"]),
    prompt=st.one_of(text, st.lists(text, min_size=1, max_size=3)),
    add_special=st.one_of(st.none(), st.booleans()),
)
def test_completions_match_vllm(
    model_dirs: dict[str, Path], oracle: Any, kind: str, prompt: Any, add_special: bool | None
) -> None:
    body: dict[str, Any] = {"model": "m", "prompt": prompt}
    if add_special is not None:
        body["add_special_tokens"] = add_special
    want = oracle.ask(model_dirs[kind], "/v1/completions", body)
    tok = _local(model_dirs[kind])
    if "error" in want:
        with pytest.raises(TokenizeError):
            tok.completion_ids(body)
        return
    try:
        ids, _ = tok.completion_ids(body)
    except NotExact:
        assert want["ids"] == []  # an empty prompt: the engine has nothing to prefill either
        return
    assert ids == want["ids"]


EDGE_BODIES: list[dict[str, Any]] = [
    # developer role: the chatml template does not know it, so it becomes system (merged)
    {"messages": [{"role": "user", "content": "a"}, {"role": "developer", "content": "dev"}]},
    {
        "messages": [
            {"role": "system", "content": "s"},
            {"role": "developer", "content": [{"type": "text", "text": "d"}]},
            {"role": "user", "content": "u"},
        ]
    },
    # billing header lines are dropped from system text
    {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1\nreal system"},
            {"role": "user", "content": "u"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "x-anthropic-billing-header: cch=1"},
            {"role": "user", "content": "u"},
        ]
    },
    # content parts: refusal / thinking / None text skipped
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "refusal", "refusal": "no"},
                    {"type": "thinking", "thinking": "hm"},
                ],
            },
            {"role": "user", "content": "c"},
        ]
    },
    # empty text parts: dropped in the string format, kept in the OpenAI format
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": ""}, {"type": "text", "text": "a"}],
            },
            {"role": "user", "content": [{"type": "text", "text": ""}]},
        ]
    },
    # extra keys on text parts survive in the OpenAI content format
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
            }
        ]
    },
    # arguments: invalid JSON and non-objects become {}
    {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{not json"},
                    },
                    {
                        "id": "2",
                        "type": "function",
                        "function": {"name": "g", "arguments": "[1, 2]"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "1", "content": "r"},
        ]
    },
    # arguments must be a string in the API (vLLM refuses an object)
    {
        "messages": [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            },
        ]
    },
    # empty tool_calls list is dropped
    {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "tool_calls": []},
            {"role": "user", "content": "q2"},
        ]
    },
    # name on messages; reasoning under both names
    {
        "messages": [
            {"role": "user", "content": "q", "name": "bob"},
            {"role": "assistant", "content": "a", "reasoning": "r1"},
            {"role": "user", "content": "q2"},
        ]
    },
    # tools with strict / defer_loading flags and no description
    {
        "messages": [{"role": "user", "content": "q"}],
        "tools": [
            {"type": "function", "function": {"name": "f", "strict": True}, "defer_loading": True}
        ],
    },
    # chat_template_kwargs that the template does not use are ignored
    {
        "messages": [{"role": "user", "content": "q"}],
        "chat_template_kwargs": {"unused": 1, "enable_thinking": False},
    },
    # reasoning_effort "none" turns thinking off unless the kwargs say otherwise
    {
        "messages": [{"role": "user", "content": "q"}],
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": True},
    },
    # errors vLLM also refuses
    {
        "messages": [{"role": "user", "content": "q"}],
        "add_generation_prompt": True,
        "continue_final_message": True,
    },
    {"messages": []},
    {"messages": [{"role": "oracle", "content": "q"}]},
    {"messages": [{"role": "user", "content": [{"type": "mystery", "x": 1}]}]},
    {"messages": [{"role": "user", "content": [{"no_type": 1}]}]},
    {"messages": [{"role": "user", "content": "q"}], "tools": []},
    {"messages": [{"role": "user", "content": "q"}], "chat_template": "{{ messages }}"},
    {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
]


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
@pytest.mark.parametrize("body", EDGE_BODIES)
def test_edge_cases_match_vllm(
    model_dirs: dict[str, Path], oracle: Any, kind: str, body: dict[str, Any]
) -> None:
    _compare(_local(model_dirs[kind]), oracle, model_dirs[kind], {"model": "m", **body})


PARTS: dict[str, Any] = {
    "text": {"type": "text", "text": "a"},
    "input_text": {"type": "input_text", "text": "a"},
    "output_text": {"type": "output_text", "text": "a"},
    "refusal": {"type": "refusal", "refusal": "a"},
    "thinking": {"type": "thinking", "thinking": "a"},
    "tool_reference": {"type": "tool_reference", "name": "a"},
    "bare": "a",
    "text_extra": {"type": "text", "text": "a", "zz": 1},
    "no_type": {"text": "a"},
}


# The chatml fixture template refuses unknown roles by design, so custom roles use llama3.
ROLE_KINDS = [
    (role, kind)
    for role in ("system", "developer", "user", "assistant", "tool", "custom")
    for kind in ("chatml", "llama3")
    if not (role == "custom" and kind == "chatml")
]


@pytest.mark.parametrize(("role", "kind"), ROLE_KINDS)
@pytest.mark.parametrize("part", sorted(PARTS))
def test_content_parts_by_role_match_vllm(
    model_dirs: dict[str, Path], oracle: Any, kind: str, role: str, part: str
) -> None:
    msg: dict[str, Any] = {"role": role, "content": [PARTS[part], PARTS["text"]]}
    if role == "tool":
        msg["tool_call_id"] = "1"
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}, msg]}
    _compare(_local(model_dirs[kind]), oracle, model_dirs[kind], body, allow_not_exact=True)
    if part in ("text", "refusal", "thinking", "tool_reference", "text_extra"):
        assert _local(model_dirs[kind]).chat_ids(body)[0]  # these always give ids


def test_multimodal_parts_give_no_ids(model_dirs: dict[str, Path]) -> None:
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
            }
        ],
    }
    with pytest.raises(NotExact):
        _local(model_dirs["chatml"]).chat_ids(body)


@pytest.mark.parametrize(
    "part", [{"type": "file", "file": {"file_id": "f"}}, {"file": {"file_id": "f"}}]
)
def test_file_parts_are_refused_like_vllm(
    model_dirs: dict[str, Path], oracle: Any, part: dict[str, Any]
) -> None:
    """vLLM has no `file` part type: it refuses the request, and so does the router."""
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    _compare(_local(model_dirs["chatml"]), oracle, model_dirs["chatml"], body)


LOOP = "{% for p in m.content %}{{ p.text }}{% endfor %}"
TEMPLATES = {
    "string": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "loop_over_content": "{% for m in messages %}" + LOOP + "{% endfor %}",
    "alias_slice": "{% set rest = messages[1:] %}{% for m in rest %}"
    + "{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
    "namespace_alias": "{% set ns = namespace(msgs=messages) %}{% for m in ns.msgs %}"
    + LOOP
    + "{% endfor %}",
    "macro": "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    + "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
    "content_var": "{% for m in messages %}{% set content = m.content %}"
    + "{% for p in content %}{{ p.text }}{% endfor %}{% endfor %}",
    "filtered_loop": "{% for m in messages | reverse %}"
    + "{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}",
    "string_checks": "{% for m in messages %}{% if m.content is string %}"
    + "{{ m.content }}{% endif %}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_detection_matches_vllm(
    model_dirs: dict[str, Path], oracle: Any, name: str
) -> None:
    template = TEMPLATES[name]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}, {"role": "user", "content": parts}]
    body = {"model": "m", "messages": msgs}
    want = oracle.ask(model_dirs["chatml"], CHAT, body, {"chat_template": template})
    assert want["ids"]
    tok = _local(model_dirs["chatml"], chat_template=template)
    fmt = tok._template(None, False).content_format
    assert fmt == want["content_format"]
    _compare(tok, oracle, model_dirs["chatml"], body, {"chat_template": template})
