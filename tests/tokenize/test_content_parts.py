"""One set of chat content-part types for every parser, and it is vLLM's.

The chat parser (exact ids) and the check of ids a request carries once disagreed: one took a
`file` part for multimodal data, the other did not. vLLM 0.33 has no `file` part: it refuses
one as an unsupported part type, so the router refuses it the same way.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tokenize_helpers import vllm_python

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.content_parts import (
    MEDIA_PART_TYPES,
    TEXT_CONTENT_PART_TYPES,
    TEXT_FIELDS,
)
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.router.tokenize.request_ids import engine_ids
from kvroute.router.tokenize.spec import TokenizerSpec

CHAT = "/v1/chat/completions"


def _chat_ids(model_dir: Path, part: dict[str, Any]) -> Any:
    tok = LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(model_dir)), cache=PrefixCache(64, 1 << 24)
    )
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    return tok.chat_ids(body)


def _carried_ids(part: dict[str, Any]) -> Any:
    body = {
        "messages": [{"role": "user", "content": [part]}],
        "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]},
    }
    return engine_ids(CHAT, body)


@pytest.mark.parametrize("ptype", sorted(MEDIA_PART_TYPES))
def test_media_parts_have_no_exact_ids_in_either_parser(
    model_dirs: dict[str, Path], ptype: str
) -> None:
    with pytest.raises(NotExact):
        _chat_ids(model_dirs["chatml"], {"type": ptype, ptype: {"url": "http://x/y"}})
    with pytest.raises(NotExact):  # untyped part holding a media key
        _chat_ids(model_dirs["chatml"], {ptype: {"url": "http://x/y"}})
    assert _carried_ids({"type": ptype, ptype: {}}) is None
    assert _carried_ids({ptype: {}}) is None


def test_a_file_part_is_refused_as_vllm_refuses_it(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(TokenizeError, match="Unsupported chat content part type: 'file'"):
        _chat_ids(model_dirs["chatml"], {"type": "file", "file": {"file_id": "f"}})
    with pytest.raises(TokenizeError, match="Missing 'type' field"):
        _chat_ids(model_dirs["chatml"], {"file": {"file_id": "f"}})
    # ids a request carries are not trusted for a part vLLM would not render
    assert _carried_ids({"type": "file", "file": {"file_id": "f"}}) is None


def test_text_parts_keep_carried_ids() -> None:
    for ptype in sorted(TEXT_FIELDS):
        assert _carried_ids({"type": ptype, TEXT_FIELDS[ptype]: "a"}) is not None
    assert "tool_reference" in TEXT_CONTENT_PART_TYPES
    assert not MEDIA_PART_TYPES & TEXT_CONTENT_PART_TYPES


VLLM_SETS = """
import json
from vllm.renderers.chat_utils import chat_message as m
print(json.dumps({
    "parsed": sorted(m.MM_PARSER_MAP),
    "text": sorted(m.TEXT_PART_TYPES),
    "text_content": sorted(m._TEXT_CONTENT_PART_TYPES),
    "media_keys": sorted(m._MEDIA_CONTENT_PART_KEYS),
}))
"""


@pytest.mark.vllm
def test_the_sets_are_vllms() -> None:
    out = subprocess.run(
        [vllm_python(), "-c", VLLM_SETS],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    vllm = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(TEXT_FIELDS) == vllm["text"]
    assert sorted(TEXT_CONTENT_PART_TYPES) == vllm["text_content"]
    assert sorted(MEDIA_PART_TYPES) == vllm["media_keys"]
    assert sorted(MEDIA_PART_TYPES | TEXT_CONTENT_PART_TYPES) == vllm["parsed"]
