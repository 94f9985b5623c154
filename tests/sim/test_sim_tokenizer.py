"""The shipped model directory is a real, reproducible Hugging Face tokenizer."""

from __future__ import annotations

import json

import pytest

from kvroute.sim.model import MODEL_DIR
from kvroute.sim.model.build import build_tokenizer, main
from kvroute.sim.tokenizer import ChatTemplateError, SimTokenizer


def test_committed_files_match_the_build_script() -> None:
    assert main(["--check"]) == 0


def test_build_is_deterministic() -> None:
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_model_directory_layout() -> None:
    config = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (MODEL_DIR / "chat_template.jinja").read_text()
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|end_of_text|>"


def test_completion_encoding_adds_bos_and_roundtrips() -> None:
    tok = SimTokenizer()
    ids = tok.encode("The router caches 123 tokens!")
    assert ids[0] == tok.encode("", add_special_tokens=True)[0]
    assert tok.decode(ids) == "The router caches 123 tokens!"
    assert ids[1:] == tok.encode("The router caches 123 tokens!", add_special_tokens=False)


def test_chat_template_roles_tools_and_generation_prompt() -> None:
    tok = SimTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"x":  1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = tok.render_chat(messages, tools=[{"type": "function", "function": {"name": "f"}}])
    assert text.startswith("<|begin_of_text|><|im_start|>system\nBe brief.\n\n# Tools")
    assert "<|im_start|>user\na\nb<|im_end|>\n" in text
    # vLLM parses string arguments into objects before rendering
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text
    assert "<tool_response>42</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_prompt = tok.render_chat(messages[:2], add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")
    ids = tok.chat_ids(messages[:2])
    assert ids.count(tok.encode("", add_special_tokens=True)[0]) == 1  # BOS once


def test_chat_template_rejects_bad_conversations() -> None:
    tok = SimTokenizer()
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"role": "wizard", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
    with pytest.raises(ChatTemplateError):
        tok.render_chat([{"content": "no role"}])


def test_continue_final_message() -> None:
    tok = SimTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    text = tok.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I")
    with pytest.raises(ChatTemplateError):
        tok.render_chat(messages, add_generation_prompt=True, continue_final_message=True)
