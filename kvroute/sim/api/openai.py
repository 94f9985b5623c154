"""/v1/completions and /v1/chat/completions, streaming and not, in vLLM's response shapes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from kvroute.sim.api.errors import ApiError, server_error
from kvroute.sim.api.faults import FailurePlan
from kvroute.sim.api.requests import ParsedRequest, check_length
from kvroute.sim.engine.core import (
    Engine,
    EngineOverloaded,
    GenerateRequest,
    RequestHandle,
    TokenOutput,
)


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice of a non-streaming answer."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    cached_tokens: int
    prompt_len: int
    kv_transfer_params: dict[str, Any] | None = None


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }


def _compact(obj: Any) -> Any:
    """Drop None values recursively (pydantic's exclude_none)."""
    if isinstance(obj, dict):
        return {k: _compact(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_compact(v) for v in obj]
    return obj


def engine_timing(handle: RequestHandle, received: float | None) -> dict[str, float | None]:
    """When the engine received a request's headers, queued it (after reading and tokenizing
    it), admitted it and first answered it (CLOCK_MONOTONIC seconds, the clock every process
    on the host shares), so a client on the same host can split its TTFT into the hop to the
    engine, the engine's parsing, the queue, the prefill and the hop back; and the KV blocks
    a decode engine pulled from its prefill peer for the request (0 for any other)."""
    return {
        "received": received,
        "arrival": handle.arrival,
        "admitted": handle.admitted_at,
        "first_token": handle.first_token_at,
        "pulled_blocks": handle.request.pulled_blocks,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class Generation:
    """Runs parsed requests on the engine and shapes the answers."""

    def __init__(self, engine: Engine, failures: FailurePlan, name: str | None = None) -> None:
        self.engine = engine
        self.failures = failures
        self.name = name  # the system_fingerprint (None, as vLLM, unless the engine is named)

    async def _submit(self, req: ParsedRequest, index: int, rid: str) -> RequestHandle:
        """Submit prompt `index` of a request (a decode request first pulls its prompt's KV
        from its prefill peer); 400 if it does not fit, 503 if the engine's queue is full."""
        prompt = req.prompts[index]
        s = req.sampling
        generate = GenerateRequest(
            request_id=rid,
            prompt_ids=prompt,
            max_tokens=check_length(len(prompt), s.max_tokens, self.engine.config.max_model_len),
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            include_stop_str_in_output=s.include_stop_str_in_output,
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            lora_name=req.lora_name,
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
        )
        generate = await self.engine.pull_prompt(generate)
        try:
            return self.engine.submit(generate)
        except EngineOverloaded as exc:
            raise ApiError(str(exc), 503, "ServiceUnavailableError") from exc

    async def collect(self, handle: RequestHandle, fail_mode: str | None) -> ChoiceResult:
        """The whole answer of a submitted request; ApiError (500) if it fails."""
        ids: list[int] = []
        text = ""
        try:
            while True:
                out = await handle.queue.get()
                if out.token_id is not None:
                    ids.append(out.token_id)
                    text += out.text
                    if fail_mode == "stream":
                        self.engine.abort(handle.request_id)
                        raise server_error("injected failure: the engine failed mid-request")
                if out.finished:
                    if out.finish_reason in ("error", "abort"):
                        raise server_error(out.error or f"request {out.finish_reason}ed")
                    return ChoiceResult(
                        text, ids, out.finish_reason, out.stop_reason,
                        handle.cached_tokens, len(handle.request.prompt_ids),
                        handle.kv_transfer_params,
                    )  # fmt: skip
        except asyncio.CancelledError:
            self.engine.abort(handle.request_id)
            raise

    async def start(
        self, req: ParsedRequest, prefix: str, sep: str = "-"
    ) -> tuple[str, list[RequestHandle], str | None]:
        """Submit every prompt: (request id, handles, injected failure mode for the answer);
        ApiError for an injected HTTP failure, a prompt too long or a full queue."""
        fail_mode = self.failures.take()
        if fail_mode == "http":
            raise server_error("injected failure: the engine could not process the request")
        base = f"{prefix}{sep}{uuid.uuid4().hex}"
        handles = []
        try:
            for i in range(len(req.prompts)):
                rid = base if len(req.prompts) == 1 else f"{base}-{i}"
                handles.append(await self._submit(req, i, rid))
        except ApiError:
            for h in handles:
                self.engine.abort(h.request_id)
            raise
        return base, handles, fail_mode

    # ---- completions ------------------------------------------------------------------
    async def completion(self, req: ParsedRequest, received: float | None = None) -> Response:
        """Answer /v1/completions (one choice per prompt), streaming or not."""
        rid, handles, fail_mode = await self.start(req, "cmpl")
        created = int(time.time())
        if req.stream:
            return self._stream(req, rid, created, handles, fail_mode, False, received)
        results = await asyncio.gather(*(self.collect(h, fail_mode) for h in handles))
        choices = []
        for i, r in enumerate(results):
            prompt_text = req.prompt_texts[i] if i < len(req.prompt_texts) else None
            text = (prompt_text or "") + r.text if req.echo else r.text
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    "token_ids": r.token_ids if req.return_token_ids else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": req.prompts[i] if req.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            )
        prompt_tokens = sum(r.prompt_len for r in results)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": req.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.name,
            "usage": _usage(
                prompt_tokens,
                sum(len(r.token_ids) for r in results),
                sum(r.cached_tokens for r in results),
            ),
            # vLLM answers with the first prompt's params
            "kv_transfer_params": results[0].kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return JSONResponse(body)

    # ---- chat ---------------------------------------------------------------------------
    async def chat(self, req: ParsedRequest, received: float | None = None) -> Response:
        """Answer /v1/chat/completions, streaming or not."""
        rid, handles, fail_mode = await self.start(req, "chatcmpl")
        created = int(time.time())
        if req.stream:
            return self._stream(req, rid, created, handles, fail_mode, True, received)
        r = await self.collect(handles[0], fail_mode)
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": r.text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    "token_ids": r.token_ids if req.return_token_ids else None,
                    "routed_experts": None,
                    "weight_versions": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": self.name,
            "usage": _usage(r.prompt_len, len(r.token_ids), r.cached_tokens),
            "prompt_logprobs": None,
            "prompt_token_ids": req.prompts[0] if req.return_token_ids else None,
            "prompt_text": None,
            "kv_transfer_params": r.kv_transfer_params,
            "ec_transfer_params": None,
            "metrics": None,
        }
        return JSONResponse(body)

    # ---- streaming (both endpoints) -----------------------------------------------------------
    def _stream(
        self,
        req: ParsedRequest,
        rid: str,
        created: int,
        handles: list[RequestHandle],
        fail_mode: str | None,
        chat: bool,
        received: float | None,
    ) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": req.model}
        engine = self.engine

        async def events() -> AsyncIterator[str]:
            counts = [0] * len(handles)
            done = [False] * len(handles)
            try:
                # vLLM sends the role chunk with the engine's first output, i.e. after the
                # prefill (serving.py: `first_iteration` inside `async for res in
                # result_generator`), so a client's first byte marks the end of prefill.
                role_chunk: dict[str, Any] | None = None
                if chat:
                    role_chunk = {
                        **head,
                        "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                        ],
                        "prompt_token_ids": req.prompts[0] if req.return_token_ids else None,
                        "prompt_text": None,
                    }  # fmt: skip
                    if req.continuous_usage:
                        role_chunk["usage"] = _compact(_usage(len(req.prompts[0]), 0, None))
                queue: asyncio.Queue[tuple[int, TokenOutput]] = asyncio.Queue()

                async def pump(i: int, h: RequestHandle) -> None:
                    while True:
                        out = await h.queue.get()
                        await queue.put((i, out))
                        if out.finished:
                            return

                pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
                try:
                    while not all(done):
                        i, out = await queue.get()
                        h = handles[i]
                        if role_chunk is not None:
                            yield _sse(role_chunk)
                            role_chunk = None
                        if out.token_id is not None:
                            counts[i] += 1
                            if fail_mode == "stream":
                                engine.abort(h.request_id)
                                yield _sse(server_error("injected failure mid-stream").body())
                                return
                        if out.finished and out.finish_reason in ("error", "abort"):
                            yield _sse(server_error(out.error or "request aborted").body())
                            return
                        chunk = self._chunk(head, req, i, out, chat, counts[i])
                        if out.finished and h.kv_transfer_params is not None:
                            chunk["kv_transfer_params"] = h.kv_transfer_params  # the last chunk
                        yield _sse(chunk)
                        if out.finished:
                            done[i] = True
                finally:
                    for p in pumps:
                        p.cancel()
                if req.include_usage:
                    prompt = sum(len(p) for p in req.prompts)
                    cached = sum(h.cached_tokens for h in handles)
                    usage = _compact(_usage(prompt, sum(counts), cached))
                    last = {**head, "choices": [], "usage": usage}
                    if self.name is not None:
                        # A named engine is the bench's instrument, not a vLLM stand-in: it
                        # also says where its part of the request's time went.
                        last["system_fingerprint"] = self.name
                        last["kvroute_engine_timing"] = engine_timing(handles[0], received)
                    yield _sse(last)
                yield "data: [DONE]\n\n"
            finally:
                for h in handles:
                    if h.finish_reason is None:
                        engine.abort(h.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @staticmethod
    def _chunk(
        head: dict[str, Any], req: ParsedRequest, i: int, out: TokenOutput, chat: bool, n: int
    ) -> dict[str, Any]:
        ids = [out.token_id] if out.token_id is not None else []
        choice: dict[str, Any] = {"index": i}
        if chat:
            choice["delta"] = {"content": out.text} if (out.text or not out.finished) else {}
        else:
            choice["text"] = out.text
        choice["logprobs"] = None
        choice["finish_reason"] = out.finish_reason if out.finished else None
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        choice["token_ids"] = ids if req.return_token_ids else None
        chunk = {**head, "choices": [choice]}
        if chat:
            chunk["kv_transfer_params"] = None
        if req.continuous_usage:
            chunk["usage"] = _compact(_usage(len(req.prompts[i]), n, None))
        return chunk
