"""Shared fixtures and strategies for the tokenize tests (imported by the test modules)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("chatml", "llama3", "metaspace")


def vllm_python() -> str:
    """The vLLM environment's interpreter, or skip (fail under KVROUTE_REQUIRE_VLLM=1)."""
    candidate = os.environ.get("KVROUTE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if Path(candidate).exists():
        return candidate
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
        pytest.fail(f"vLLM environment required but {candidate} does not exist")
    pytest.skip("no vLLM environment (.venv-vllm); `make test` builds it")


class Oracle:
    """vLLM's own rendering + tokenization, in a long-lived subprocess (see vllm_render_oracle)."""

    def __init__(self, python: str) -> None:
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="ERROR")
        self._proc = subprocess.Popen(
            [python, str(Path(__file__).with_name("vllm_render_oracle.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def ask(
        self,
        model_dir: Path,
        endpoint: str,
        body: dict[str, Any],
        server: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        msg = {"model_dir": str(model_dir), "endpoint": endpoint, "body": body}
        msg["server"] = server or {}
        self._proc.stdin.write(json.dumps(msg) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the vLLM oracle process died")
        out: dict[str, Any] = json.loads(line)
        return out

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


# ---- strategies ------------------------------------------------------------------------------

# Text that stresses tokenization at message boundaries: special-token look-alikes and pieces,
# whitespace runs, non-ASCII, digits.
_PIECES = [
    "Hello",
    " world",
    "the router",
    "cache",
    "12345",
    "3.14",
    "café",
    "東京",
    "😀",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "start|>",
    "<s>",
    "</s>",
    "<tool_call>",
    "[INST]",
    "<|eot_id|>",
    "{",
    '"',
    "}",
    "'s",
]
text = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=6)), max_size=8).map("".join)
plain_text = st.lists(st.sampled_from(_PIECES[:14]), min_size=1, max_size=8).map("".join)


def _parts(t: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": w} for w in t.split("|")] if t else []


content = st.one_of(text, text.map(_parts))

tool_call = st.builds(
    lambda name, args: {
        "id": "call_" + name,
        "type": "function",
        "function": {"name": name, "arguments": args},
    },
    st.sampled_from(["get_weather", "search", "add"]),
    st.one_of(
        st.dictionaries(
            st.sampled_from(["city", "q", "a", "b"]),
            st.one_of(st.integers(), plain_text),
            max_size=3,
        ).map(json.dumps),
        st.sampled_from(["", "{not json", "[1, 2]", "null"]),
    ),
)


@st.composite
def conversations(
    draw: st.DrawFn, roles: tuple[str, ...] = ("user", "assistant", "tool")
) -> list[dict[str, Any]]:
    """A plausible multi-turn conversation (system first or not, then turns)."""
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(content)})
    n = draw(st.integers(min_value=1, max_value=6))
    for i in range(n):
        msgs.append({"role": "user", "content": draw(content)})
        if i == n - 1 and draw(st.booleans()):
            break
        msg: dict[str, Any] = {"role": "assistant", "content": draw(content)}
        if "tool" in roles and draw(st.integers(0, 3)) == 0:
            msg["tool_calls"] = draw(st.lists(tool_call, min_size=1, max_size=2))
            msg["content"] = draw(st.one_of(st.none(), st.just(""), text))
            msgs.append(msg)
            msgs.append({"role": "tool", "tool_call_id": "call_x", "content": draw(content)})
            continue
        if draw(st.integers(0, 4)) == 0:
            msg["reasoning_content"] = draw(plain_text)
        msgs.append(msg)
    return msgs


def metaspace_conversations() -> st.SearchStrategy[list[dict[str, Any]]]:
    """Conversations the Llama-2-like template accepts (string content, alternating roles)."""

    @st.composite
    def build(draw: st.DrawFn) -> list[dict[str, Any]]:
        msgs: list[dict[str, Any]] = []
        if draw(st.booleans()):
            msgs.append({"role": "system", "content": draw(text)})
        for i in range(draw(st.integers(1, 5))):
            msgs.append({"role": "user", "content": draw(text)})
            if i < 4 and draw(st.booleans()):
                msgs.append({"role": "assistant", "content": draw(text)})
        return msgs

    return build()


tools = st.lists(
    st.builds(
        lambda name, desc, props: {
            "type": "function",
            "function": {
                "name": name,
                **({"description": desc} if desc is not None else {}),
                "parameters": {"type": "object", "properties": props},
            },
        },
        st.sampled_from(["get_weather", "search", "add"]),
        st.one_of(st.none(), plain_text),
        st.dictionaries(
            st.sampled_from(["city", "unit", "q"]), st.just({"type": "string"}), max_size=2
        ),
    ),
    min_size=1,
    max_size=2,
)
