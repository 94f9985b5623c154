"""The simulated engine's HTTP app: vLLM's OpenAI server surface plus /sim/* admin routes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.sim.api import faults as fault_rules
from kvroute.sim.api.embeddings import answer_embeddings, parse_embeddings
from kvroute.sim.api.errors import ApiError, bad_request, not_found
from kvroute.sim.api.faults import FailurePlan
from kvroute.sim.api.openai import Generation
from kvroute.sim.api.requests import (
    check_length,
    int_list,
    parse_chat,
    parse_completion,
    render_chat,
    resolve_model,
)
from kvroute.sim.api.responses import ResponsesAnswer
from kvroute.sim.api.responses_request import parse_responses
from kvroute.sim.engine.core import Engine, EngineConfig
from kvroute.sim.engine.kv_transfer import PULL_PATH
from kvroute.sim.publisher import EventPublisher

Handler = Callable[[Request], Awaitable[Response]]

VLLM_VERSION = "0.33.0"


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"invalid JSON body: {exc}") from exc


async def _until_disconnect(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, cancelled if the client goes away first (as vLLM's API server cancels a
    request whose client disconnected, which aborts it in the engine); streams start at once
    and notice it themselves."""
    task = asyncio.ensure_future(answer)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    return task.result()


def _answered(handler: Handler) -> Handler:
    """A route whose `ApiError`s are answered in vLLM's error shape."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as err:
            return err.response()

    return wrapped


def build_app(
    engine: Engine,
    publisher: EventPublisher | None = None,
    *,
    served_root: str | None = None,
    fail_seed: int = 0,
    name: str | None = None,
) -> Starlette:
    """The app for one engine. The engine loop starts and stops with the app's lifespan."""
    cfg = engine.config
    failures = FailurePlan(seed=fail_seed)
    gen = Generation(engine, failures, name)
    responses_answer = ResponsesAnswer(gen)
    created = int(time.time())

    def gated(handler: Handler) -> Handler:
        """vLLM-facing routes: frozen while the engine hangs."""
        answer = _answered(handler)

        async def wrapped(request: Request) -> Response:
            await engine.wait_unhung()
            return await answer(request)

        return wrapped

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": _model_cards(cfg, created, served_root)})

    async def completions(request: Request) -> Response:
        received = time.monotonic()
        parsed = parse_completion(await _json(request), cfg, engine.tokenizer)
        return await _until_disconnect(request, gen.completion(parsed, received))

    async def chat(request: Request) -> Response:
        received = time.monotonic()
        parsed = parse_chat(await _json(request), cfg, engine.tokenizer)
        return await _until_disconnect(request, gen.chat(parsed, received))

    async def responses(request: Request) -> Response:
        parsed = parse_responses(await _json(request), cfg, engine.tokenizer)
        return await responses_answer.answer(parsed)

    async def render_responses(request: Request) -> Response:
        req = parse_responses(await _json(request), cfg, engine.tokenizer).run
        ids = req.prompts[0]
        max_tokens = req.sampling.max_tokens or cfg.max_model_len - len(ids)
        return JSONResponse(_generate_request("resp-render", ids, req.model, max_tokens, req))

    async def embeddings(request: Request) -> Response:
        parsed = parse_embeddings(await _json(request), cfg, engine.tokenizer)
        return await answer_embeddings(gen, parsed)

    async def render_completions(request: Request) -> Response:
        req = parse_completion(await _json(request), cfg, engine.tokenizer)
        out = []
        for i, ids in enumerate(req.prompts):
            max_tokens = check_length(len(ids), req.sampling.max_tokens, cfg.max_model_len)
            rid = f"cmpl-render-{i}" if len(req.prompts) > 1 else "cmpl-render"
            out.append(_generate_request(rid, ids, req.model, max_tokens, req))
        return JSONResponse(out)

    async def render_chat_completions(request: Request) -> Response:
        req = parse_chat(await _json(request), cfg, engine.tokenizer)
        ids = req.prompts[0]
        max_tokens = check_length(len(ids), req.sampling.max_tokens, cfg.max_model_len)
        return JSONResponse(_generate_request("chatcmpl-render", ids, req.model, max_tokens, req))

    async def tokenize(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        resolve_model(cfg, body.get("model"))
        tok = engine.tokenizer
        if "messages" in body:
            _, ids = render_chat(body, tok)
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise bad_request("add_special_tokens must be a boolean", "add_special_tokens")
            ids = tok.encode(body["prompt"], special)
        else:
            raise bad_request("either prompt (a string) or messages is required", "prompt")
        strs = None
        if body.get("return_token_strs"):
            strs = [tok.id_to_token(i) or "" for i in ids]
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": cfg.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        resolve_model(cfg, body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise bad_request("tokens must be a list of non-negative integers", "tokens")
        if any(t >= engine.tokenizer.vocab_size for t in tokens):
            raise bad_request("token id out of vocabulary range", "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(tokens)})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def version(_: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def kv_event_sources(_: Request) -> Response:
        if publisher is None:
            return JSONResponse({})
        return JSONResponse({str(publisher.config.dp_rank): publisher.kv_events_config()})

    async def reset_prefix_cache(_: Request) -> Response:
        ok = await engine.reset_prefix_cache()
        return Response(status_code=200 if ok else 400)

    async def kv_pull(request: Request) -> Response:
        """A decode peer read a kept prefill's blocks: free them (vLLM's pull notification).
        404 when this engine keeps no such blocks (never, or no longer: the lease ran out)."""
        body = await _json(request)
        kv = engine.kv
        if kv is None:
            raise not_found("this engine has no KV connector (--kv-role)")
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        rid, eid = body.get("remote_request_id"), body.get("remote_engine_id")
        if not isinstance(rid, str) or not isinstance(eid, str):
            raise bad_request("remote_request_id and remote_engine_id must be strings")
        lease = kv.take(rid, eid)
        if lease is None:
            raise not_found(f"no kept blocks for request {rid!r}")
        engine.wake()
        return JSONResponse({"blocks": sum(len(g) for g in lease.block_ids)})

    # ---- /sim admin: never gated, so a hung engine can be released -----------------------
    async def probe(request: Request) -> Response:
        """Oracle for benchmarks: the hit this request would get now (no side effects)."""
        body = await _json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        _, lora = resolve_model(cfg, body.get("model"))
        ids_field = body.get("prompt_token_ids")
        if ids_field is not None:
            ids = int_list(ids_field, "prompt_token_ids")
            salt = body.get("cache_salt")
        elif "messages" in body:
            parsed = parse_chat(body, cfg, engine.tokenizer)
            ids, salt = parsed.prompts[0], parsed.cache_salt
        else:
            parsed = parse_completion(body, cfg, engine.tokenizer)
            ids, salt = parsed.prompts[0], parsed.cache_salt
        hit, per_group = engine.probe(ids, lora, salt if isinstance(salt, str) else None)
        return JSONResponse(
            {"prompt_tokens": len(ids), "cached_tokens": hit, "per_group": per_group}
        )

    async def get_faults(_: Request) -> Response:
        return JSONResponse(_sim_state(engine, failures, publisher))

    async def post_faults(request: Request) -> Response:
        settings = fault_rules.validate(await _json(request))
        _apply_faults(settings, engine, failures, publisher)
        result: dict[str, Any] = {}
        if settings.get("reset_prefix_cache"):
            result["reset_prefix_cache"] = await engine.reset_prefix_cache()
        return JSONResponse({**_sim_state(engine, failures, publisher), **result})

    @asynccontextmanager
    async def lifespan(_: Starlette) -> Any:
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    # What each runner serves, as vLLM registers its routers by the model's tasks: the
    # generation endpoints, or /v1/embeddings (anything else is FastAPI's plain 404).
    by_runner = {
        "generate": [
            Route("/v1/completions", gated(completions), methods=["POST"]),
            Route("/v1/chat/completions", gated(chat), methods=["POST"]),
            Route("/v1/responses", gated(responses), methods=["POST"]),
            Route("/v1/completions/render", gated(render_completions), methods=["POST"]),
            Route("/v1/responses/render", gated(render_responses), methods=["POST"]),
            Route("/v1/chat/completions/render", gated(render_chat_completions), methods=["POST"]),
        ],
        "pooling": [Route("/v1/embeddings", gated(embeddings), methods=["POST"])],
    }
    if cfg.runner not in by_runner:
        raise ValueError(f"unknown runner {cfg.runner!r} (one of {', '.join(by_runner)})")
    routes = [
        Route("/v1/models", gated(models), methods=["GET"]),
        *by_runner[cfg.runner],
        Route("/tokenize", gated(tokenize), methods=["POST"]),
        Route("/detokenize", gated(detokenize), methods=["POST"]),
        Route("/health", gated(health), methods=["GET"]),
        Route("/version", gated(version), methods=["GET"]),
        Route("/metrics", gated(metrics), methods=["GET"]),
        Route("/kv_event_sources", gated(kv_event_sources), methods=["GET"]),
        Route("/reset_prefix_cache", gated(reset_prefix_cache), methods=["POST"]),
        Route("/sim/faults", get_faults, methods=["GET"]),
        Route("/sim/faults", _answered(post_faults), methods=["POST"]),
        Route("/sim/state", get_faults, methods=["GET"]),
        Route("/sim/probe", _answered(probe), methods=["POST"]),
        Route(PULL_PATH, _answered(kv_pull), methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: _not_found})


async def _not_found(_: Request, __: Exception) -> Response:
    """An unknown path, answered as vLLM's FastAPI app does."""
    return JSONResponse({"detail": "Not Found"}, status_code=404)


def _generate_request(
    rid: str, ids: list[int], model: str, max_tokens: int, req: Any
) -> dict[str, Any]:
    """vLLM's GenerateRequest as the render endpoints return it (token_ids is what matters)."""
    s = req.sampling
    return {
        "request_id": rid,
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {
            "n": 1,
            "max_tokens": max_tokens,
            "stop": s.stop,
            "stop_token_ids": s.stop_token_ids,
            "ignore_eos": s.ignore_eos,
            "seed": s.seed,
            "include_stop_str_in_output": s.include_stop_str_in_output,
        },
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": req.return_token_ids or None,
        "output_mode": "tokens",
        "parse_context": None,
        "stream": req.stream,
        "stream_options": (
            {"include_usage": req.include_usage, "continuous_usage_stats": req.continuous_usage}
            if req.stream
            else None
        ),
        "cache_salt": req.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _model_cards(cfg: EngineConfig, created: int, served_root: str | None) -> list[dict[str, Any]]:
    """GET /v1/models: the base model and one card per LoRA adapter, in vLLM's shape."""

    def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        permission = {
            "id": f"modelperm-{cfg.model}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": max_model_len,
            "permission": [permission],
        }

    base = card(cfg.model, served_root or cfg.model_dir, None, cfg.max_model_len)
    return [base, *(card(n, cfg.lora_path(n), cfg.model, None) for n in cfg.lora_adapters)]


def _sim_state(
    engine: Engine, failures: FailurePlan, publisher: EventPublisher | None
) -> dict[str, Any]:
    """GET /sim/state: layout, load, counters and fault settings of the engine."""
    cfg, s, spec = engine.config, engine.scheduler, engine.cache.spec
    state: dict[str, Any] = {
        "model": cfg.model,
        "profile": cfg.profile,
        "groups": [
            {"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
            for g in spec.groups
        ],
        "hash_block_size": spec.hash_block_size,
        "alignment": spec.alignment,
        "num_blocks": cfg.num_blocks,
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_cache_usage": engine.cache.usage(),
        "prefix_cache_queries": s.prefix_queries,
        "prefix_cache_hits": s.prefix_hits,
        "preemptions": s.num_preemptions,
        "steps": engine.steps,
        "busy_seconds": engine.busy_seconds,
        "speed": cfg.speed,
        "faults": {**failures.state(), "slowdown": engine.slowdown, "hang": engine.hung},
    }
    if publisher is not None:
        state["events"] = publisher.state()
    if engine.kv is not None:
        state["kv_transfer"] = engine.kv.state()
    if s.offload is not None:
        state["cpu_tier"] = {**s.offload.state(), "loading": len(s.loading)}
    return state


def _apply_faults(
    settings: dict[str, Any],
    engine: Engine,
    failures: FailurePlan,
    publisher: EventPublisher | None,
) -> None:
    """Apply validated fault settings (all but reset_prefix_cache, which is awaited);
    ApiError for event faults on an engine without a publisher."""
    for key in ("fail_next", "fail_rate", "fail_mode"):
        if key in settings:
            setattr(failures, key, settings[key])
    if "slowdown" in settings:
        engine.slowdown = settings["slowdown"]
    if "hang" in settings:
        engine.set_hang(settings["hang"])
    if publisher is not None:
        if settings.get("drop_batches"):
            publisher.drop_next(settings["drop_batches"], settings.get("drop_from_replay", False))
        if "malformed" in settings:
            publisher.send_malformed(settings["malformed"])
        if "replay" in settings:
            publisher.set_replay_enabled(settings["replay"])
    elif {"drop_batches", "malformed", "replay"} & set(settings):
        raise bad_request("this engine has no event publisher")
    if settings.get("restart"):
        engine.restart()
