"""The two halves of a disaggregated request on the wire, as vLLM 0.33 takes them.

The prefill half is the client's request with `kv_transfer_params: {"do_remote_decode": true}`,
one output token and no streaming; the prefill worker's answer carries `kv_transfer_params`
naming itself and the blocks that hold the prompt. The decode half is the client's request
unchanged but for those params, which the decode worker uses to pull the blocks.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvroute.router.edge.openai_request import CHAT, COMPLETIONS

PREFILL_PARAMS = {"do_remote_decode": True}
# What a decode worker needs to pull (vLLM's NIXL connector checks the same keys and, without
# them, computes the whole prompt itself, silently).
HANDOFF_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")

_decode_obj = msgspec.json.Decoder(dict[str, Any])


def splittable(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether a request can be split into prefill and decode: chat or completions with one
    prompt and one choice (the prefill answers for one sequence only)."""
    if endpoint not in (CHAT, COMPLETIONS) or body.get("n", 1) not in (None, 1):
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list)
                and len(prompt) > 1)  # fmt: skip


class HandoffError(ValueError):
    """The prefill worker's answer cannot be handed to a decode worker; says why."""


def prefill_body(body: bytes) -> bytes:
    """The prefill half of a request body (see the module doc)."""
    d = _decode_obj.decode(body)
    d["stream"] = False
    d.pop("stream_options", None)
    d.pop("min_tokens", None)  # would exceed the single token
    d["max_tokens"] = 1
    if "max_completion_tokens" in d:
        d["max_completion_tokens"] = 1
    d["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return msgspec.json.encode(d)


def decode_body(body: bytes, params: dict[str, Any]) -> bytes:
    """The decode half: the request as the client sent it, with the prefill's params."""
    d = _decode_obj.decode(body)
    d["kv_transfer_params"] = params
    return msgspec.json.encode(d)


def handoff_params(answer: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill worker's answer; HandoffError when the answer
    has none a decode worker could use (e.g. the engine runs without a KV connector)."""
    try:
        d = _decode_obj.decode(answer)
    except msgspec.DecodeError as exc:
        raise HandoffError(f"the prefill answer is not a JSON object: {exc}") from None
    params = d.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise HandoffError(
            "the prefill answer has no kv_transfer_params (is the engine started with a "
            "kv_producer KV connector?)"
        )
    missing = [k for k in HANDOFF_KEYS if k not in params]
    if missing or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        raise HandoffError(
            "the prefill answer's kv_transfer_params cannot start a decode (missing "
            f"{', '.join(missing) or 'do_remote_prefill / remote_block_ids'})"
        )
    return params
