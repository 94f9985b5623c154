"""/v1/embeddings of a pooling engine (`--runner pooling`), in vLLM 0.33's shapes.

vLLM serves /v1/embeddings only for a pooling model (a generate model has no such route: 404).
The simulated one is a decoder with last-token pooling: vLLM keeps prefix caching on for that
kind (`ModelConfig.is_prefix_caching_supported`) and its embed requests read the cache
(`PoolingParams.skip_reading_prefix_cache` is false for task "embed"), so a request is one
prefill that reuses and fills the prefix cache like a generation's, and publishes the same KV
events. Its output is a unit vector drawn from the prompt's ids (the same input, the same
embedding). Usage counts prompt tokens only, as vLLM's (no cached-token details).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import random
import struct
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from kvroute.sim.api.errors import bad_request
from kvroute.sim.api.openai import Generation
from kvroute.sim.api.requests import ParsedRequest, Sampling, int_list, resolve_model
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.tokenizer import SimTokenizer

EMBEDDING_SIZE = 64  # the simulated model's hidden size
_FORMATS = frozenset({"float", "base64"})  # vLLM's JSON formats (bytes ones are not simulated)
_BYTE_ORDER = {"native": sys.byteorder, "little": "little", "big": "big"}


@dataclass(slots=True)
class ParsedEmbeddings:
    """A checked embeddings request, prompts tokenized."""

    run: ParsedRequest  # one prompt per input; one step of the engine each (the prefill)
    encoding_format: str
    byte_order: str


def _prompts(value: Any, tok: SimTokenizer, add_special: bool) -> list[list[int]]:
    if isinstance(value, str):
        return [tok.encode(value, add_special)]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [tok.encode(v, add_special) for v in value]
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [int_list(v, "input") for v in value]
    if isinstance(value, list) and value and not any(isinstance(v, dict) for v in value):
        return [int_list(value, "input")]
    if isinstance(value, list) and value:
        raise bad_request("chat input to embeddings is not simulated", "input")
    raise bad_request("input must be a string, a list of strings or token ids", "input")


def parse_embeddings(body: Any, config: EngineConfig, tok: SimTokenizer) -> ParsedEmbeddings:
    """A /v1/embeddings body, checked and tokenized; ApiError (400, 404) otherwise."""
    if not isinstance(body, Mapping):
        raise bad_request("request body must be a JSON object")
    model, lora = resolve_model(config, body.get("model"))
    if "messages" in body:
        raise bad_request("chat input to embeddings is not simulated", "messages")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
    prompts = _prompts(body.get("input"), tok, add_special)
    if any(not p for p in prompts):
        raise bad_request("input must not be empty", "input")
    for p in prompts:
        # a pooling request generates nothing: the whole context is the prompt's
        if len(p) > config.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {config.max_model_len} tokens. "
                f"However, your prompt contains {len(p)} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the "
                "input prompt.",
                "input_tokens",
            )
    if body.get("dimensions") is not None:
        raise bad_request(
            f"Model {model!r} does not support Matryoshka embeddings; dimensions must be "
            f"unset (received dimensions={body['dimensions']}).",
            "dimensions",
        )
    if body.get("truncate_prompt_tokens") is not None:
        raise bad_request("truncate_prompt_tokens is not simulated", "truncate_prompt_tokens")
    fmt = body.get("encoding_format") or "float"
    if fmt not in _FORMATS:
        raise bad_request(
            f"encoding_format {fmt!r} is not simulated (float, base64)", "encoding_format"
        )
    if (body.get("embed_dtype") or "float32") != "float32":
        raise bad_request("only embed_dtype float32 is simulated", "embed_dtype")
    order = _BYTE_ORDER.get(body.get("endianness") or "native")
    if order is None:
        raise bad_request("endianness must be native, little or big", "endianness")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
    # One token "generated" ends the request at the end of its prefill: the step in which
    # vLLM pools the last hidden state.
    run = ParsedRequest(
        model, lora, prompts, Sampling(max_tokens=1, ignore_eos=True),
        False, False, False, salt, False,
    )  # fmt: skip
    return ParsedEmbeddings(run, fmt, order)


def embedding_of(ids: list[int]) -> list[float]:
    """The simulated embedding of a prompt: a unit vector (float32 values) seeded by its ids."""
    digest = hashlib.blake2b(" ".join(map(str, ids)).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    raw = [rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_SIZE)]
    norm = sum(v * v for v in raw) ** 0.5
    packed = struct.pack(f"<{EMBEDDING_SIZE}f", *(v / norm for v in raw))
    return list(struct.unpack(f"<{EMBEDDING_SIZE}f", packed))


def _encoded(vector: list[float], fmt: str, order: str) -> list[float] | str:
    if fmt == "float":
        return vector
    prefix = "<" if order == "little" else ">"
    return base64.b64encode(struct.pack(f"{prefix}{len(vector)}f", *vector)).decode()


async def answer_embeddings(gen: Generation, req: ParsedEmbeddings) -> Response:
    """Run every input's prefill on the engine; the embeddings in input order."""
    rid, handles, fail_mode = await gen.start(req.run, "embd")
    created = int(time.time())
    await asyncio.gather(*(gen.collect(h, fail_mode) for h in handles))
    data = [
        {
            "index": i,
            "object": "embedding",
            "embedding": _encoded(embedding_of(ids), req.encoding_format, req.byte_order),
        }
        for i, ids in enumerate(req.run.prompts)
    ]
    prompt_tokens = sum(len(p) for p in req.run.prompts)
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    body = {
        "id": rid,
        "object": "list",
        "created": created,
        "model": req.run.model,
        "data": data,
        "usage": usage,
    }
    return JSONResponse(body)
