"""The admin API: explain a routing decision, show the fleet, change membership.

All endpoints need `Authorization: Bearer <token>`: the full admin token, or the read-only one
for the endpoints that change nothing (kvroute/router/ops/admin_auth.py). Without any
configured token the admin API is disabled (403). Nothing here changes routing state except the
membership endpoints (add, remove, drain, undrain, resync), which need the full token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvroute.ratelog import RateLimitedLog
from kvroute.router.config import PolicyConfig
from kvroute.router.config_load import ConfigError, worker_from_dict
from kvroute.router.edge.body import read_bounded
from kvroute.router.edge.errors import INVALID_FIELD, NOT_FOUND, RouterError, error_response
from kvroute.router.edge.json_input import decode_json
from kvroute.router.edge.openai_request import CHAT, COMPLETIONS, RESPONSES, parse_request
from kvroute.router.fleet.event_subscriptions import EventFeed
from kvroute.router.fleet.verify import Verifier
from kvroute.router.fleet.workers import PREFILL, Worker, WorkerRegistry
from kvroute.router.ops.admin_auth import AdminTokens, Scope
from kvroute.router.ops.decisions import DecisionLog, candidate_json
from kvroute.router.ops.metrics import RouterMetrics
from kvroute.router.routing.index_view import IndexView, ReuseExplanation
from kvroute.router.routing.pipeline import Routing
from kvroute.router.routing.records import Candidate

log = logging.getLogger(__name__)

_MAX_ADMIN_BODY = 16 * 1024 * 1024
_REFUSED = (401, 403)  # statuses of refused credentials, logged (rate-limited)
_ONE = "/admin/workers/{name:path}"


class Admin:
    def __init__(
        self,
        tokens: AdminTokens,
        registry: WorkerRegistry,
        routing: Routing,
        index: IndexView,
        events: EventFeed,
        verifier: Verifier,
        decisions: DecisionLog,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokens = tokens
        self._registry = registry
        self._routing = routing
        self._index = index
        self._events = events
        self._verifier = verifier
        self._decisions = decisions
        self._metrics = metrics
        self._clock = clock
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    def routes(self) -> list[Route]:
        return [
            Route("/admin/score", self._read(self.score), methods=["POST"]),
            Route("/admin/workers", self._read(self.list_workers), methods=["GET"]),
            Route("/admin/workers", self._write(self.add_worker), methods=["POST"]),
            # Names may hold "/" (Kubernetes workers are namespace/pod), sent as is or as %2F.
            # The action routes come first; the path converter is greedy, so
            # ".../a/drain/drain" drains the worker "a/drain".
            Route(f"{_ONE}/drain", self._write(self.drain), methods=["POST"]),
            Route(f"{_ONE}/undrain", self._write(self.undrain), methods=["POST"]),
            Route(f"{_ONE}/resync", self._write(self.resync), methods=["POST"]),
            Route(_ONE, self._read(self.get_worker), methods=["GET"]),
            Route(_ONE, self._write(self.remove_worker), methods=["DELETE"]),
            Route("/admin/decisions", self._read(self.decisions), methods=["GET"]),
        ]

    def _read(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        return self._guard(handler, Scope.READ)

    def _write(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        return self._guard(handler, Scope.WRITE)

    def _guard(self, handler: Callable[[Request], Any], scope: Scope) -> Callable[[Request], Any]:
        async def guarded(request: Request) -> Response:
            try:
                self._tokens.authorize(request.headers.get("authorization", ""), scope)
                result: Response = await handler(request)
                return result
            except RouterError as exc:
                self._metrics.errors.labels(exc.kind.kind).inc()
                if exc.kind.status in _REFUSED:
                    # the path may hold any text a caller sent: logged quoted, never the token
                    self._ratelog.warning(
                        exc.kind.kind,
                        "admin %s %r refused: %s",
                        request.method,
                        request.url.path,
                        exc.message,
                    )
                return error_response(exc)

        return guarded

    async def _json(self, request: Request) -> Any:
        raw = await read_bounded(request, _MAX_ADMIN_BODY)
        return decode_json(raw)

    # -- explain --------------------------------------------------------------------------
    async def score(self, request: Request) -> Response:
        """Per-worker predicted reuse, load and cost for an OpenAI body; the would-be choice."""
        raw = await read_bounded(request, _MAX_ADMIN_BODY)
        probe = decode_json(raw)
        endpoint = request.query_params.get("endpoint") or _guess_endpoint(probe)
        req = parse_request(endpoint, raw, request.scope["headers"])
        routing = self._routing
        route = routing.resolve_model(req)
        prompt = await routing.prompt(req, route)
        explained: dict[str, ReuseExplanation] = {}
        if prompt.token_ids is not None:
            explained = dict(
                self._index.explain(prompt.token_ids, prompt.lora_name, prompt.cache_salt)
            )
        reuse = routing.reuse(prompt)
        eligible = routing.eligible(route)
        decision = routing.policy.decide(
            eligible, routing.route_input(req, prompt, reuse), self._clock()
        )
        by_name = {c.name: c for c in decision.candidates}
        # a prefill worker's choice: the decode half too, as the proxy would place it
        decode_by_name: dict[str, Candidate] = {}
        decode_chosen = None
        if decision.chosen is not None and decision.chosen.worker.spec.role == PREFILL:
            choice = routing.choose_decode(route, prompt, reuse, dry_run=True)
            decode_by_name = {c.name: c for c in choice.candidates}
            decode_chosen = choice.chosen
        down = self._events.unusable()
        workers = []
        for w in routing.registry.serving(route.name):
            entry: dict[str, Any] = {
                "worker": w.name,
                "role": w.spec.role,
                "status": w.status(),
                "eligible": w.name in by_name,
                "events_live": w.name not in down if (w.spec.bridge or w.spec.zmq) else None,
                "predicted_reuse": reuse.get(w.name),
                # the worker's pool and the prompt tokens of the conversations expected back
                "pool_tokens": w.load.capacity.tokens(),
                "working_set_tokens": routing.working_set.tokens(w.name),
                # the rate its CPU-tier tokens are priced at, when learned per worker
                "cpu_tier_tokens_per_s": _cpu_tier_rate(w, routing.cfg),
                "cpu_tier_tokens_per_s_learned": w.load.cpu_tier.learned,
            }
            exp = explained.get(w.name)
            if exp is not None:
                entry["full_attention_only_reuse"] = exp.full_attention_only()
                entry["alignment"] = exp.alignment
                entry["index_reason"] = exp.reason
                entry["groups"] = [
                    {
                        "group_id": g.group_id,
                        "kind": g.kind,
                        "block_size": g.block_size,
                        "sliding_window": g.sliding_window,
                        "accepted_tokens": g.accepted_tokens,
                    }
                    for g in exp.groups
                ]
            c = by_name.get(w.name)
            if c is not None:
                entry.update(candidate_json(c))
                entry["chosen"] = decision.chosen is c
            d = decode_by_name.get(w.name)
            if d is not None:
                entry["decode"] = {**candidate_json(d), "chosen": d is decode_chosen}
            workers.append(entry)
        return JSONResponse(
            {
                "model": route.name,
                "lora_name": route.lora_name,
                "cache_salt": bool(prompt.cache_salt),
                "endpoint": endpoint,
                "prompt_tokens": prompt.n_tokens,
                "token_source": prompt.source,
                "policy": decision.policy,
                "chosen": decision.chosen.name if decision.chosen else None,
                "decode_chosen": decode_chosen.name if decode_chosen else None,
                "link_bytes_per_s": routing.link_rate.bytes_per_s(),
                "link_bytes_per_s_learned": routing.link_rate.learned,
                "reason": decision.reason,
                "detail": decision.detail,
                "session": decision.session_key is not None,
                "workers": workers,
            }
        )

    # -- fleet ----------------------------------------------------------------------------
    def _worker_json(self, w: Worker) -> dict[str, Any]:
        now = self._clock()
        m = w.load.engine
        out: dict[str, Any] = {
            "name": w.name,
            "url": w.url,
            "bridge": w.spec.bridge,
            "zmq": w.spec.zmq,
            "dp_rank": w.spec.dp_rank,
            "role": w.spec.role,
            "models": sorted(w.serves()),
            "status": w.status(),
            "state": w.state,
            "healthy": w.healthy,
            "health_error": w.health_error or None,
            "breaker": {"state": w.breaker.state, "failures": w.breaker.failures},
            "load": {
                "running": w.load.running,
                "prefilling": w.load.prefilling,
                "queued_prefill_tokens": w.load.queued_prefill_tokens,
                "requests_total": w.load.started_total,
                "step_period_s": w.load.steps.period,
                "cpu_tier_tokens_per_s": _cpu_tier_rate(w, self._routing.cfg),
                # None until learned (policy.learn_cpu_tier_rate), and unbounded
                "cpu_tier_tokens_per_s_learned": w.load.cpu_tier.learned,
                "engine": None
                if m is None
                else {
                    "running": m.running,
                    "waiting": m.waiting,
                    "kv_usage": m.kv_usage,
                    "age_s": round(now - m.at, 3),
                },
            },
        }
        stats = self._index.stats(w.name)
        if stats is not None:
            w.load.capacity.observe_blocks(stats.blocks_per_group)
        out["capacity"] = _capacity_json(w)
        ws = self._routing.working_set.summary(w.name, now)
        out["working_set"] = {
            "conversations": ws.conversations,
            "tokens": ws.tokens,
            "write_tokens_per_s": round(ws.write_tokens_per_s, 3),
        }
        out["index"] = (
            None
            if stats is None
            else {
                "valid": stats.valid,
                "last_sequence": stats.last_sequence,
                "blocks_per_group": {str(k): v for k, v in stats.blocks_per_group.items()},
                "entries": stats.entries,
                "pending": stats.pending,
                "evicted": stats.evicted,
                "resets": stats.resets,
            }
        )
        status = self._events.status(w.name)
        out["events"] = (
            None
            if status is None
            else {
                "state": status.state,
                "for_s": round(now - status.since, 3),
                "last_sequence": status.last_sequence,
                "lag_s": None
                if status.last_message_at is None
                else round(now - status.last_message_at, 3),
                "stream_id": status.stream_id,
                "snapshots": status.snapshots,
                "batches": status.batches,
                "reconnects": status.reconnects,
                "last_error": status.last_error or None,
            }
        )
        acc = self._verifier.accuracy(w.name)
        out["prediction"] = (
            None
            if acc is None
            else {
                "verified": acc.verified,
                "misses": acc.misses,
                "mean_abs_error_tokens": round(acc.mean_abs_error(), 3),
                "last_error_tokens": acc.last_error,
                "tokenizer_mismatches": acc.tokenizer_mismatches,
                "resyncs": acc.resyncs,
            }
        )
        return out

    async def list_workers(self, request: Request) -> Response:
        return JSONResponse({"workers": [self._worker_json(w) for w in self._registry]})

    def _get(self, request: Request) -> Worker:
        name = request.path_params["name"]
        worker = self._registry.get(name)
        if worker is None:
            raise RouterError(NOT_FOUND, f"no worker named {name!r}")
        return worker

    async def get_worker(self, request: Request) -> Response:
        return JSONResponse(self._worker_json(self._get(request)))

    async def add_worker(self, request: Request) -> Response:
        data = await self._json(request)
        if not isinstance(data, dict):
            raise RouterError(INVALID_FIELD, "expected a worker object")
        try:
            spec = worker_from_dict(data)
        except ConfigError as exc:
            raise RouterError(INVALID_FIELD, str(exc)) from None
        if self._registry.get(spec.name) is not None:
            return JSONResponse(
                {"error": {"message": f"worker {spec.name!r} exists", "code": 409}}, 409
            )
        try:
            worker = self._registry.add(spec)
        except ValueError as exc:
            raise RouterError(INVALID_FIELD, str(exc)) from None
        return JSONResponse(self._worker_json(worker), 201)

    async def remove_worker(self, request: Request) -> Response:
        worker = self._get(request)
        drain = request.query_params.get("drain", "true").lower() not in ("0", "false", "no")
        if drain:
            self._registry.start_drain(worker.name, remove=True)
            removed = self._registry.get(worker.name) is None
            return JSONResponse({"name": worker.name, "removed": removed, "draining": not removed})
        self._registry.remove(worker.name)
        return JSONResponse({"name": worker.name, "removed": True, "draining": False})

    async def drain(self, request: Request) -> Response:
        worker = self._get(request)
        self._registry.start_drain(worker.name)
        return JSONResponse(self._worker_json(worker))

    async def undrain(self, request: Request) -> Response:
        worker = self._get(request)
        self._registry.undrain(worker.name)
        return JSONResponse(self._worker_json(worker))

    async def resync(self, request: Request) -> Response:
        worker = self._get(request)
        ok = self._events.resync(worker.name)
        if ok:
            self._metrics.resyncs.labels(worker.name, "admin").inc()
        return JSONResponse({"name": worker.name, "resync": ok})

    async def decisions(self, request: Request) -> Response:
        q = request.query_params
        try:
            limit = int(q.get("limit", "50"))
            after = int(q.get("after", "0"))
        except ValueError:
            raise RouterError(INVALID_FIELD, "limit and after must be integers") from None
        with_candidates = q.get("candidates", "true").lower() not in ("0", "false", "no")
        records = self._decisions.recent(max(0, min(limit, 10_000)), after)
        return JSONResponse({"decisions": [r.to_json(candidates=with_candidates) for r in records]})


def _guess_endpoint(body: object) -> str:
    if isinstance(body, dict):
        if "messages" in body:
            return CHAT
        if "prompt" in body:
            return COMPLETIONS
        if "input" in body:
            return RESPONSES
    return CHAT


def _cpu_tier_rate(w: Worker, cfg: PolicyConfig) -> float | None:
    """The rate the policy prices the worker's CPU-tier tokens at (learned and bounded, or
    `policy.cpu_tier_tokens_per_s` until learned) when it learns each worker's
    (`policy.learn_cpu_tier_rate`); None otherwise, as every worker's is then the configured
    one."""
    if not cfg.learn_cpu_tier_rate:
        return None
    return w.load.cpu_tier.tokens_per_s(cfg.cpu_tier_tokens_per_s)


def _capacity_json(w: Worker) -> dict[str, Any]:
    """The worker's pool as its engine reports it, and the most blocks the index saw."""
    cap = w.load.capacity
    e = cap.engine
    return {
        "tokens": cap.tokens(),
        "engine": None
        if e is None
        else {
            "num_gpu_blocks": e.num_gpu_blocks,
            "block_size": e.block_size,
            "kv_cache_size_tokens": e.kv_cache_size_tokens,
        },
        "peak_blocks_per_group": {str(k): v for k, v in sorted(cap.peak_blocks.items())},
    }
