"""Sending a text completion to the engine as a completion of the router's token ids.

The router encodes a `/v1/completions` text prompt anyway (its cache keys are hashes of the
exact ids). A vLLM API server given the text encodes it again before the engine can start,
on the process that serves every other request too (the router's own cold encode of a
12,015-token prompt: 12.6 ms, `bench/results/tokenize.md`). Given the same request with
`prompt` = the ids, it skips that. The endpoint and every other field stay the same, so the
answer needs no conversion.

A request keeps its text when a field means something only for text (`NEEDS_TEXT`): `echo`
returns the prompt's text (vLLM would decode it from the ids, special tokens included),
`suffix` asks for fill-in-the-middle rendering, truncation and token offsets are computed on
the text, and `prompt_embeds` has no ids. A batch of prompts (a list) keeps its text too.
`add_special_tokens` was applied when the router encoded the text, so it is not sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

# Fields whose effect in vLLM depends on the prompt being text (`renderers/params.py`:
# text-side truncation, offsets; `completion/serving.py`: echo, suffix).
NEEDS_TEXT = (
    "echo",
    "suffix",
    "prompt_embeds",
    "truncate_prompt_tokens",
    "truncation_side",
    "return_token_offsets",
)
# Consumed by the router's encoding; vLLM reads it for text prompts only.
CONSUMED = frozenset({"add_special_tokens"})
_encoder = msgspec.json.Encoder()


def completion_ids_body(body: dict[str, Any], ids: Sequence[int]) -> bytes | None:
    """The /v1/completions body that asks the engine for the same answer as `body`, whose one
    text prompt encodes to `ids`, with the ids as its prompt; None when the request keeps
    its text (see the module doc)."""
    if not ids or not isinstance(body.get("prompt"), str):
        return None
    for field in NEEDS_TEXT:
        value = body.get(field)
        if value is not None and value is not False:  # 0 too: `truncate_prompt_tokens: 0`
            return None
    out = {k: v for k, v in body.items() if k not in CONSUMED}
    out["prompt"] = ids if isinstance(ids, list) else list(ids)
    return _encoder.encode(out)
