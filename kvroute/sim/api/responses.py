"""/v1/responses answers in vLLM 0.33's shapes: one `response` object, or its SSE event
stream (response.created ... response.completed), for a model without tool or reasoning
parsers (the answer is one assistant message of output text).

The request is prefilled and decoded like a chat completion; the usage block carries the
engine's cached tokens (`input_tokens_details.cached_tokens`), which the router reads.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from kvroute.sim.api.errors import server_error
from kvroute.sim.api.openai import Generation
from kvroute.sim.api.responses_request import ParsedResponses
from kvroute.sim.engine.core import RequestHandle


def _usage(prompt: int, output: int, cached: int, written: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": written,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": prompt + output,
    }


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _event(kind: str, seq: int, **fields: Any) -> str:
    body = json.dumps({**fields, "sequence_number": seq, "type": kind}, ensure_ascii=False)
    return f"event: {kind}\ndata: {body}\n\n"


class ResponsesAnswer:
    """Runs a parsed Responses request on the engine and shapes the answer."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    def _written(self, handle: RequestHandle) -> int:
        """Prompt tokens this request newly wrote to the prefix cache (whole blocks)."""
        block = self.gen.engine.cache.spec.hash_block_size
        full = len(handle.request.prompt_ids) // block * block
        return max(0, full - handle.cached_tokens)

    def _response(
        self,
        req: ParsedResponses,
        rid: str,
        created: int,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        return {
            "id": rid,
            "created_at": created,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": req.run.model,
            "object": "response",
            "output": output,
            "status": status,
            "usage": usage,
            **req.echo,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    async def answer(self, req: ParsedResponses) -> Response:
        """Answer /v1/responses, streaming or not."""
        rid, handles, fail_mode = await self.gen.start(req.run, "resp", sep="_")
        created = int(time.time())
        if req.run.stream:
            return self._stream(req, rid, created, handles[0], fail_mode)
        h = handles[0]
        r = await self.gen.collect(h, fail_mode)
        status = _item_status(r.finish_reason)
        content = [_part(r.text, None)] if r.text else []
        output = [_message(f"msg_{uuid.uuid4().hex}", content, status)]
        usage = _usage(r.prompt_len, len(r.token_ids), r.cached_tokens, self._written(h))
        return JSONResponse(self._response(req, rid, created, status, output, usage))

    def _stream(
        self,
        req: ParsedResponses,
        rid: str,
        created: int,
        handle: RequestHandle,
        fail_mode: str | None,
    ) -> StreamingResponse:
        engine = self.gen.engine

        async def events() -> AsyncIterator[str]:
            seq = 0

            def emit(kind: str, **fields: Any) -> str:
                nonlocal seq
                seq += 1
                return _event(kind, seq - 1, **fields)

            try:
                initial = self._response(req, rid, created, "in_progress", [], None)
                yield emit("response.created", response=initial)
                yield emit("response.in_progress", response=initial)
                item_id = f"msg_{uuid.uuid4().hex}"
                text, count, opened = "", 0, False
                while True:
                    out = await handle.queue.get()
                    if out.token_id is not None:
                        count += 1
                        if fail_mode == "stream":
                            engine.abort(handle.request_id)
                            yield _error(seq, "injected failure mid-stream")
                            return
                    if out.finished and out.finish_reason in ("error", "abort"):
                        yield _error(seq, out.error or "request aborted")
                        return
                    if out.text:
                        if not opened:
                            opened = True
                            at = {"output_index": 0}
                            yield emit(
                                "response.output_item.added",
                                item=_message(item_id, [], "in_progress"), **at,
                            )  # fmt: skip
                            yield emit(
                                "response.content_part.added", content_index=0,
                                item_id=item_id, part=_part("", []), **at,
                            )  # fmt: skip
                        text += out.text
                        yield emit(
                            "response.output_text.delta", content_index=0, delta=out.text,
                            item_id=item_id, logprobs=[], output_index=0,
                        )  # fmt: skip
                    if out.finished:
                        break
                status = _item_status(out.finish_reason)
                output: list[dict[str, Any]] = []
                if opened:
                    part = _part(text, None)
                    where: dict[str, Any] = {"item_id": item_id, "output_index": 0}
                    yield emit(
                        "response.output_text.done", content_index=0, logprobs=[],
                        text=text, **where,
                    )  # fmt: skip
                    yield emit("response.content_part.done", content_index=0, part=part, **where)
                    item = _message(item_id, [part], status)
                    output.append(item)
                    yield emit("response.output_item.done", item=item, output_index=0)
                usage = _usage(
                    len(handle.request.prompt_ids), count, handle.cached_tokens,
                    self._written(handle),
                )  # fmt: skip
                final = self._response(req, rid, created, status, output, usage)
                terminal = "response.incomplete" if status == "incomplete" else "response.completed"
                yield emit(terminal, response=final)
            finally:
                if handle.finish_reason is None:
                    engine.abort(handle.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")


def _error(seq: int, message: str) -> str:
    """The stream's error event (vLLM ends a failed Responses stream with one)."""
    err = server_error(message)
    return _event("error", seq, code=str(err.status), message=err.message, param=None)
