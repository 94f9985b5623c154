"""Check a local model directory against a running engine before routing with it.

    python -m kvroute.router.tokenize.check --model-dir DIR --engine http://127.0.0.1:8000 [--model
    NAME]

Sends a set of sample chat and completion requests to the engine's render endpoints (or
`/tokenize`) and compares the ids with what the router computes locally from DIR. Exit status
0 when every sample matches, 1 when one differs (the first difference is printed), 2 when the
engine or the directory cannot be used. Samples that need features the local mode does not
cover are not sent.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from kvroute.router.tokenize.chat_request import NotExact
from kvroute.router.tokenize.errors import TokenizeError
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.router.tokenize.render_client import AiohttpPoster, JsonPoster, RenderClient
from kvroute.router.tokenize.spec import TokenizerSpec

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

SAMPLES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat: one user turn",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hello!"}]},
    ),
    (
        "chat: system and turns",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three rivers."},
                {"role": "assistant", "content": "Nile, Amazon, Yangtze."},
                {"role": "user", "content": "And in Europe?  \n\nThanks."},
            ]
        },
    ),
    (
        "chat: text parts and unicode",
        "/v1/chat/completions",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "café 東京 😀"},
                        {"type": "text", "text": "12345"},
                    ],
                }
            ]
        },
    ),
    (
        "chat: tools and a tool call",
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "23 C, sunny"},
            ],
            "tools": [_TOOL],
            "tool_choice": "none",  # "auto" needs the engine's tool-parser flags
        },
    ),
    (
        "chat: no generation prompt",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False},
    ),
    ("completion: text", "/v1/completions", {"prompt": "The quick brown fox"}),
    (
        "completion: no special tokens",
        "/v1/completions",
        {"prompt": "The quick brown fox", "add_special_tokens": False},
    ),
]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


async def run_check(local: LocalTokenizer, engine_url: str, model: str, poster: JsonPoster) -> int:
    client = RenderClient(poster, timeout_s=30.0)
    failures = errors = 0
    for name, endpoint, sample in SAMPLES:
        body = {"model": model, **sample}
        try:
            if endpoint == "/v1/chat/completions":
                mine, _ = local.chat_ids(body)
            else:
                mine, _ = local.completion_ids(body)
        except (NotExact, TokenizeError) as exc:
            print(f"skip  {name}: not computed locally ({exc})")
            continue
        res = await client.ids(endpoint, body, engine_url)
        if res.ids is None:
            print(f"error {name}: the engine gave no ids ({res.reason})")
            errors += 1
            continue
        if res.ids == mine:
            print(f"ok    {name}: {len(mine)} tokens")
            continue
        failures += 1
        at = _first_difference(mine, res.ids)
        print(
            f"DIFF  {name}: local {len(mine)} tokens, engine {len(res.ids)}; first difference at "
            f"{at}: local {mine[at : at + 8]} engine {res.ids[at : at + 8]}"
        )
    return 1 if failures else 2 if errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare local token ids with an engine's.")
    parser.add_argument("--model-dir", required=True, help="model directory (tokenizer.json, ...)")
    parser.add_argument(
        "--engine", required=True, help="engine base URL, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument("--model", default=None, help="served model name (default: the directory)")
    parser.add_argument("--chat-template", default=None, help="as the engine's --chat-template")
    args = parser.parse_args(argv)
    try:
        local = LocalTokenizer.from_spec(
            TokenizerSpec("local", path=args.model_dir, chat_template=args.chat_template),
            cache=PrefixCache(0, 0),
        )
    except Exception as exc:  # whatever is wrong with the directory, say it and stop
        print(f"cannot load {args.model_dir}: {exc}", file=sys.stderr)
        return 2

    async def go() -> int:
        poster = AiohttpPoster()
        try:
            return await run_check(
                local, args.engine.rstrip("/"), args.model or args.model_dir, poster
            )
        finally:
            await poster.aclose()

    return asyncio.run(go())


if __name__ == "__main__":
    raise SystemExit(main())
