"""The chat-template environment (sandbox, helpers) and reading model directories."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenize_fixture_model import build_model_dir

from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.model_dir import load_model_dir, load_template_override
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.router.tokenize.spec import TokenizerSpec
from kvroute.router.tokenize.template import (
    ChatTemplate,
    RenderInput,
    choose_template,
    make_environment,
)

MSGS = [{"role": "user", "content": "hi"}]


def render(
    source: str,
    messages: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
    **kw: Any,
) -> str:
    tpl = ChatTemplate(source, make_environment())
    inp = RenderInput(
        messages=MSGS if messages is None else messages,
        tools=kw.pop("tools", None),
        documents=None,
        add_generation_prompt=kw.pop("add_generation_prompt", False),
        continue_final_message=kw.pop("continue_final_message", False),
        kwargs={**kw, **(extra or {})},
    )
    return tpl.render(inp, {"bos_token": "<s>"})


def test_sandbox_blocks_python_internals() -> None:
    # unsafe attributes are hidden (undefined), calling through them is refused
    assert render("{{ ''.__class__ }}{{ messages.__class__ }}") == ""
    for source in (
        "{{ ''.__class__.__mro__() }}",
        "{{ messages.pop() }}",
        "{% set ns = namespace(_x=1) %}",
        "{% set ns = namespace() %}{% set ns._y = 2 %}",
    ):
        with pytest.raises(TokenizeError):
            render(source)


def test_helpers_behave_like_transformers() -> None:
    assert render("{{ raise_exception('nope') if false else 'ok' }}") == "ok"
    with pytest.raises(TokenizeError, match="no system"):
        render("{{ raise_exception('no system please') }}")
    assert render("{{ {'k': 'é東'} | tojson }}") == '{"k": "é東"}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}") == '{"a": 2, "b": 1}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"
    assert render("{{ '<b>' | tojson }}") == '"<b>"'  # no HTML escaping
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    assert render("{{ dict(a=1)['a'] }}{{ dict.fromkeys(['x'], 2)['x'] }}") == "12"
    counting = "{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}"
    assert render(counting + "{% endfor %}{{ ns.n }}") == "3"
    skip = "{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}"
    assert render("{% for i in range(5) %}" + skip + "{{ i }}{% endfor %}") == "02"
    assert render("{% generation %}kept{% endgeneration %}") == "kept"
    assert render("{{ bos_token }}{{ messages[0].content }}") == "<s>hi"
    # keywords override special tokens; trim_blocks / lstrip_blocks; no trailing newline kept
    assert render("{{ bos_token }}", bos_token="[B]") == "[B]"
    assert render("  {% if true %}\nx\n{% endif %}\n") == "x\n"


def test_messages_as_transformers_passes_them() -> None:
    # None-valued keys are dropped; reasoning is also offered as thinking / reasoning_content
    msgs = [{"role": "assistant", "content": "a", "tool_calls": None, "reasoning": "r"}]
    m0 = "messages[0]"
    fields = ("tool_calls is defined", "thinking", "reasoning_content")
    out = render("|".join(f"{{{{ {m0}.{f} }}}}" for f in fields), msgs)
    assert out == "False|r|r"
    with pytest.raises(TokenizeError):
        render("x", [])
    with pytest.raises(TokenizeError):
        render("{{ messages }}", MSGS, extra={"messages": []})


def test_continue_final_message() -> None:
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    assert (
        render(tpl, msgs, continue_final_message=True) == "<user>q</user>\n<assistant>The answer is"
    )
    trimming = "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}"
    msgs2 = [{"role": "assistant", "content": "Well "}]
    assert render(trimming, msgs2, continue_final_message=True) == "[Well"
    parts = [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        }
    ]
    assert (
        render(
            "{% for p in messages[0].content %}{{ p.text }}|{% endfor %}",
            parts,
            continue_final_message=True,
        )
        == "A|B"
    )
    with pytest.raises(TokenizeError):
        render("{{ 'constant' }}", msgs, continue_final_message=True)
    with pytest.raises(TokenizeError):
        render("{% for m in messages %}{{ m.role }}{% endfor %}", msgs, continue_final_message=True)


def test_compile_errors() -> None:
    with pytest.raises(ValueError):
        ChatTemplate("{% for %}", make_environment())


def test_choose_template() -> None:
    named = {"default": "D", "tool_use": "T", "rag": "R"}
    assert choose_template(named, None, has_tools=False) == "D"
    assert choose_template(named, None, has_tools=True) == "T"
    assert choose_template(named, "rag", has_tools=True) == "R"
    assert choose_template(named, "{{ literal }}", has_tools=False) == "{{ literal }}"
    assert choose_template({}, None, has_tools=False) is None


# ---- model directories -------------------------------------------------------------------------


def _dir(tmp_path: Path, **config: Any) -> Path:
    d = build_model_dir(tmp_path / "m", "chatml")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(config)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_template_files_take_priority(tmp_path: Path) -> None:
    d = _dir(tmp_path)
    (d / "chat_template.jinja").write_text("FILE{{ messages[0].content }}")
    extra = d / "additional_chat_templates"
    extra.mkdir()
    (extra / "tool_use.jinja").write_text("TOOLS")
    files = load_model_dir(d)
    assert files.templates == {"default": "FILE{{ messages[0].content }}", "tool_use": "TOOLS"}


def test_named_templates_in_config(tmp_path: Path) -> None:
    d = _dir(
        tmp_path,
        chat_template=[{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}],
    )
    assert load_model_dir(d).templates == {"default": "A", "tool_use": "B"}


def test_special_tokens_and_missing_ones(tmp_path: Path) -> None:
    d = _dir(
        tmp_path,
        bos_token={"content": "<|im_start|>", "__type": "AddedToken"},
        unk_token="<|brand_new|>",
    )
    files = load_model_dir(d)
    assert files.special_tokens["bos_token"] == "<|im_start|>"
    # a named special token missing from the vocabulary is added, as transformers does
    assert files.tokenizer.token_to_id("<|brand_new|>") is not None
    assert "bos_token" not in load_model_dir(_dir(tmp_path / "x", bos_token=None)).special_tokens


def test_split_special_tokens_disables_special_anchors(tmp_path: Path) -> None:
    d = _dir(tmp_path, split_special_tokens=True)
    tok = LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(d)), cache=PrefixCache(8, 1 << 20)
    )
    text = "<|im_start|>user\nhi<|im_end|>\n" * 20
    ids, _ = tok.text_ids(text, add_special_tokens=False)
    assert ids == tok.encoder.encode(text)
    assert tok.encoder._tok.token_to_id("<|im_start|>") not in ids


def test_override_template(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("X{{ messages[0].content }}")
    assert load_template_override(str(f)) == "X{{ messages[0].content }}"
    assert load_template_override("{{ 1 }}") == "{{ 1 }}"
    with pytest.raises(ValueError):
        load_template_override(str(tmp_path / "missing.jinja"))
    d = _dir(tmp_path)
    tok = LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(d), chat_template=str(f)), cache=PrefixCache(8, 1 << 20)
    )
    text, _ = tok.render_chat({"messages": MSGS})
    assert text == "Xhi"


def test_unusable_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        load_model_dir(tmp_path)
    d = _dir(tmp_path, chat_template="{% for %}")
    with pytest.raises(ValueError):
        LocalTokenizer.from_spec(TokenizerSpec("local", path=str(d)), cache=PrefixCache(8, 1 << 20))


def test_directory_without_template_gives_no_chat_ids(tmp_path: Path) -> None:
    from kvroute.router.tokenize.chat_request import NotExact

    d = _dir(tmp_path)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(d)), cache=PrefixCache(8, 1 << 20)
    )
    with pytest.raises(NotExact):
        tok.chat_ids({"messages": MSGS})
    assert tok.completion_ids({"prompt": "hello"})[0] == tok.encoder.encode(
        "hello", add_special_tokens=True
    )


def test_request_templates_are_kept_within_a_bound(tmp_path: Path) -> None:
    from kvroute.router.tokenize import local as local_mod

    d = _dir(tmp_path)
    spec = TokenizerSpec("local", path=str(d), trust_request_chat_template=True)
    tok = LocalTokenizer.from_spec(spec, cache=PrefixCache(8, 1 << 20))
    bound = local_mod._REQUEST_TEMPLATES_KEPT
    for i in range(bound + 5):
        text, _ = tok.render_chat(
            {"messages": MSGS, "chat_template": f"T{i}{{{{ messages[0].content }}}}"}
        )
        assert text == f"T{i}hi"
    assert len(tok._request_compiled) == bound
    assert "T0{{ messages[0].content }}" not in tok._request_compiled  # the oldest went first
