"""The proxy over real HTTP on loopback: pass-through fidelity, streaming, usage handling,
bad input, retries, breaker, health, drain and client disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.router.fake_engine import dead_url
from tests.router.harness import Rig, rig

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metrics_text(r: Rig) -> str:
    return (await r.client.get("/metrics")).text


def sent_to(r: Rig) -> dict[str, int]:
    return {name: len(s.received) for name, s in r.engines.items()}


def test_non_streaming_is_passed_through_verbatim() -> None:
    async def go() -> None:
        async with rig(2) as r:
            raw = json.dumps(CHAT).encode()
            resp = await r.client.post(
                "/v1/chat/completions",
                content=raw,
                headers={
                    "content-type": "application/json",
                    "x-kvroute-worker": "w1",
                    "authorization": "Bearer engine-key",
                },
            )
            assert resp.status_code == 200
            body = resp.json()
            target = r.engines[body["engine"]]
            got = target.received[-1]
            assert got.raw == raw  # the body is forwarded byte for byte
            assert "x-kvroute-worker" not in got.headers  # internal headers never pass
            assert got.headers["authorization"] == "Bearer engine-key"
            direct = await r.client.post(
                r.engine_urls[body["engine"]] + "/v1/chat/completions", json=CHAT
            )
            assert body == direct.json()
            assert "x-kvroute-worker" not in resp.headers  # response headers off by default
            rec = r.parts.decisions.recent(1)[0]
            assert rec.reported_cached_tokens == 0 and rec.status == 200
            assert rec.token_source == "render"

    run(go())


def test_stream_usage_requested_but_hidden_from_client() -> None:
    async def go() -> None:
        async with rig(1) as r:
            r.engines["w0"].cached_tokens = lambda ids: 16
            req = {**CHAT, "stream": True}
            async with r.client.stream("POST", "/v1/chat/completions", json=req) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                via_router = b"".join([c async for c in resp.aiter_raw()])
            sent = r.engines["w0"].received[-1].body
            assert sent["stream_options"]["include_usage"] is True  # the router asked...
            async with httpx.AsyncClient() as c:
                direct = await c.post(r.engine_urls["w0"] + "/v1/chat/completions", json=req)
            assert via_router == direct.content  # ...and the client sees exactly the engine's
            assert b'"usage"' not in via_router
            rec = r.parts.decisions.recent(1)[0]
            assert rec.reported_cached_tokens == 16
            assert metric(await metrics_text(r), "kvroute_stream_usage_requested_total") == 1

    run(go())


def test_stream_with_client_usage_is_untouched() -> None:
    async def go() -> None:
        async with rig(1) as r:
            req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            resp = await r.client.post("/v1/chat/completions", json=req)
            direct = await r.client.post(r.engine_urls["w0"] + "/v1/chat/completions", json=req)
            assert resp.content == direct.content and b'"usage"' in resp.content
            via, direct_req = r.engines["w0"].received
            assert via.raw == direct_req.raw  # forwarded unchanged

    run(go())


def test_completions_models_tokenize_health() -> None:
    async def go() -> None:
        async with rig(2) as r:
            r.engines["w1"].models = [
                {"id": "m", "object": "model"},
                {"id": "sql-lora", "object": "model", "parent": "m"},
            ]
            for job_worker in r.parts.registry:
                await _refresh_models(r, job_worker.name)
            models = (await r.client.get("/v1/models")).json()
            assert sorted(m["id"] for m in models["data"]) == ["m", "sql-lora"]
            resp = await r.client.post("/v1/completions", json={"model": "m", "prompt": "abc"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "xxx"
            # a LoRA model goes only to the worker that has it, under the adapter's namespace
            resp = await r.client.post(
                "/v1/completions", json={"model": "sql-lora", "prompt": "abcd", "cache_salt": "s"}
            )
            assert resp.json()["engine"] == "w1"
            assert r.index.expected[-1] == ("w1", 4, "sql-lora", "s")
            tok = await r.client.post("/tokenize", json={"model": "m", "prompt": "ab"})
            assert tok.json()["tokens"] == [97, 98]
            detok = await r.client.post("/detokenize", json={"model": "m", "tokens": [97]})
            assert detok.json()["prompt"] == "a"
            health = await r.client.get("/health")
            assert health.status_code == 200 and health.json()["ready_workers"] == 2

    run(go())


async def _refresh_models(r: Rig, name: str) -> None:
    from kvroute.router.fleet.health import ModelsProbe

    worker = r.parts.registry.get(name)
    assert worker is not None
    await ModelsProbe(r.parts.registry, r.parts.upstream)(worker)


def test_bad_input_cases_are_answered_and_counted() -> None:
    async def go() -> None:
        async with rig(1, limits={"max_body_bytes": 2000}) as r:
            c = r.client
            resp = await c.post("/v1/chat/completions", content=b"{nope")
            assert resp.status_code == 400
            assert resp.json()["error"]["type"] == "invalid_request_error"
            resp = await c.post("/v1/chat/completions", json={"model": "m", "messages": "hi"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
            resp = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
            assert resp.status_code == 404
            assert resp.json()["error"]["code"] == "model_not_found"
            big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
            resp = await c.post("/v1/chat/completions", json=big)
            assert resp.status_code == 413

            async def chunked() -> Any:
                for _ in range(10):
                    yield b" " * 300  # no content-length: the limit applies while reading

            resp = await c.post("/v1/chat/completions", content=chunked())
            assert resp.status_code == 413
            assert sent_to(r) == {"w0": 0}  # nothing bad reached the engine
            text = await metrics_text(r)
            assert metric(text, "kvroute_errors_total", kind="invalid_json") == 1
            assert metric(text, "kvroute_errors_total", kind="invalid_field") == 1
            assert metric(text, "kvroute_errors_total", kind="unknown_model") == 1
            assert metric(text, "kvroute_errors_total", kind="body_too_large") == 2
            assert metric(text, "kvroute_requests_total", status="413") == 2

    run(go())


def test_no_healthy_worker_is_503_with_retry_after() -> None:
    async def go() -> None:
        async with rig(1, timeouts={"retry_after_s": 7}) as r:
            r.engines["w0"].healthy = False
            await asyncio.sleep(0.5)  # a health round marks it down
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "7"
            assert (await r.client.get("/health")).status_code == 503
            r.engines["w0"].healthy = True
            await asyncio.sleep(0.5)
            assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            text = await metrics_text(r)
            assert metric(text, "kvroute_errors_total", kind="no_worker") == 1

    run(go())


def test_retry_on_5xx_429_and_connect_error_before_first_byte() -> None:
    async def go() -> None:
        for status in (500, 429):
            async with rig(2, policy="round_robin") as r:
                r.engines["w1"].fail_status = status
                codes = [
                    (await r.client.post("/v1/chat/completions", json=CHAT)).status_code
                    for _ in range(4)
                ]
                assert codes == [200] * 4
                # round robin's turn lands on w1 first each time (the retry uses a turn too)
                assert len(r.engines["w1"].received) == 4
                assert len(r.engines["w0"].received) == 4
                attempts = [d.attempts for d in r.parts.decisions.recent(4)]
                assert attempts == [["w1", "w0"]] * 4
                text = await metrics_text(r)
                cause = "429" if status == 429 else "5xx"
                assert metric(text, "kvroute_retries_total", cause=cause) == 4
        async with rig(2, policy="round_robin", health={"interval_s": 60}) as r:
            await r.kill("w1")  # healthy at start, then its port refuses connections
            for _ in range(4):
                assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            text = await metrics_text(r)
            assert metric(text, "kvroute_retries_total", cause="connect") == 4
            assert (
                metric(text, "kvroute_upstream_responses_total", worker="w1", outcome="connect")
                == 4
            )

    run(go())


def test_dead_worker_at_start_is_never_tried() -> None:
    async def go() -> None:
        async with rig(
            1,
            extra_workers=[{"name": "dead", "url": dead_url(), "model": "m"}],
            policy="round_robin",
        ) as r:
            for _ in range(4):
                assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            dead = r.parts.registry.get("dead")
            assert dead is not None and dead.healthy is False and dead.load.started_total == 0

    run(go())


def test_no_retry_budget_passes_upstream_error_through() -> None:
    async def go() -> None:
        async with rig(2, retry={"max_attempts": 1}, policy="round_robin") as r:
            r.engines["w0"].fail_status = 503
            r.engines["w1"].fail_status = 503
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503
            assert resp.json()["error"]["message"] == "scripted failure"  # the engine's own
            assert sum(sent_to(r).values()) == 1

    run(go())


def test_every_worker_failing_ends_with_last_upstream_answer() -> None:
    async def go() -> None:
        async with rig(2, retry={"max_attempts": 5}) as r:
            for s in r.engines.values():
                s.fail_status = 500
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 500
            assert sent_to(r) == {"w0": 1, "w1": 1}  # each worker tried once, then give up

    run(go())


def test_mid_stream_failure_is_an_sse_error_and_never_retried() -> None:
    async def go() -> None:
        async with rig(2, policy="round_robin") as r:
            for s in r.engines.values():
                s.break_after_chunks = 2
                s.chunks = 5
            resp = await r.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert resp.status_code == 200
            events = [e for e in resp.text.split("\n\n") if e]
            assert len(events) == 4  # two chunks, the error event, [DONE]
            err = json.loads(events[2].removeprefix("data: "))
            assert "mid-stream" in err["error"]["message"]
            assert events[3] == "data: [DONE]"
            assert sum(sent_to(r).values()) == 1
            text = await metrics_text(r)
            assert metric(text, "kvroute_errors_total", kind="mid_stream") == 1

    run(go())


def test_breaker_opens_on_a_failing_worker() -> None:
    async def go() -> None:
        async with rig(
            2, policy="round_robin", breaker={"failure_threshold": 2, "open_s": 60}
        ) as r:
            r.engines["w1"].fail_status = 500
            for _ in range(10):
                assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            assert len(r.engines["w1"].received) == 2  # then the breaker kept it out
            w1 = r.parts.registry.get("w1")
            assert w1 is not None and w1.breaker.state == "open"
            text = await metrics_text(r)
            assert metric(text, "kvroute_worker_breaker_state", worker="w1") == 2
            assert metric(text, "kvroute_breaker_transitions_total", worker="w1", to="open") == 1

    run(go())


def test_breaker_half_open_probe_closes_it() -> None:
    async def go() -> None:
        async with rig(
            1,
            breaker={"failure_threshold": 1, "open_s": 0.2, "half_open_successes": 1},
            retry={"max_attempts": 1},
        ) as r:
            r.engines["w0"].fail_status = 500
            r.engines["w0"].fail_times = 1
            assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 500
            assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 503
            await asyncio.sleep(0.25)
            assert (await r.client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            w0 = r.parts.registry.get("w0")
            assert w0 is not None and w0.breaker.state == "closed"

    run(go())


def test_client_disconnect_cancels_upstream() -> None:
    async def go() -> None:
        async with rig(1) as r:
            s = r.engines["w0"]
            s.chunks = 1000
            s.chunk_delay_s = 0.01
            async with r.client.stream(
                "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as resp:
                it = resp.aiter_raw()
                await it.__anext__()
                await asyncio.sleep(0.05)
                assert s.active == 1
            # leaving the block closes the connection mid-stream
            for _ in range(100):
                if s.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert s.cancelled == 1 and s.active == 0 and s.completed == 0
            w0 = r.parts.registry.get("w0")
            assert w0 is not None and w0.load.running == 0
            text = await metrics_text(r)
            assert metric(text, "kvroute_client_disconnects_total") == 1

    run(go())


def test_disconnect_while_waiting_for_first_byte() -> None:
    async def go() -> None:
        async with rig(1) as r:
            r.engines["w0"].hang = True
            task = asyncio.create_task(r.client.post("/v1/chat/completions", json=CHAT))
            await asyncio.sleep(0.2)
            w0 = r.parts.registry.get("w0")
            assert w0 is not None and w0.load.running == 1
            task.cancel()
            for _ in range(100):
                if w0.load.running == 0:
                    break
                await asyncio.sleep(0.02)
            assert w0.load.running == 0  # the router let go of the upstream call

    run(go())


def test_drain_finishes_streams_and_stops_new_requests() -> None:
    async def go() -> None:
        async with rig(2) as r:
            s0 = r.engines["w0"]
            s0.chunks = 20
            s0.chunk_delay_s = 0.02
            stream_task = None
            # find a request that lands on w0 and keep it streaming
            for _ in range(4):
                resp = await r.client.send(
                    r.client.build_request(
                        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
                    ),
                    stream=True,
                )
                if s0.active:
                    stream_task = resp
                    break
                await resp.aread()
            assert stream_task is not None
            d = await r.client.delete("/admin/workers/w0", headers=r.admin_headers())
            assert d.json() == {"name": "w0", "removed": False, "draining": True}
            before = len(s0.received)
            for _ in range(5):
                resp = await r.client.post("/v1/chat/completions", json=CHAT)
                assert resp.json()["engine"] == "w1"
            assert len(s0.received) == before
            body = await stream_task.aread()
            assert body.endswith(b"data: [DONE]\n\n") and s0.completed >= 1
            await asyncio.sleep(0.05)
            assert r.parts.registry.get("w0") is None  # removed once its stream ended
            assert "w0" in r.index.removed

    run(go())


def test_session_affinity_end_to_end() -> None:
    async def go() -> None:
        async with rig(3) as r:
            engines = set()
            for turn in range(4):
                body = {
                    **CHAT,
                    "user": "alice",
                    "messages": [{"role": "user", "content": f"turn {turn}"}],
                }
                engines.add(
                    (await r.client.post("/v1/chat/completions", json=body)).json()["engine"]
                )
            assert len(engines) == 1
            others = {
                (
                    await r.client.post(
                        "/v1/chat/completions", json={**CHAT}, headers={"x-session-id": f"s{i}"}
                    )
                ).json()["engine"]
                for i in range(30)
            }
            assert len(others) == 3

    run(go())


def test_cache_prediction_routes_and_is_verified() -> None:
    async def go() -> None:
        async with rig(3, admin={"response_headers": True}) as r:
            r.index.scores = {"w0": 0, "w1": 16, "w2": None}
            r.engines["w1"].cached_tokens = lambda ids: 16
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.json()["engine"] == "w1"
            assert resp.headers["x-kvroute-worker"] == "w1"
            assert resp.headers["x-kvroute-predicted-cached-tokens"] == "16"
            rec = r.parts.decisions.recent(1)[0]
            assert rec.decision.reason == "cache" and rec.outcome == "exact"
            n = len(b"<user>hello there<assistant>")
            assert r.index.expected[-1] == ("w1", n, "", "")  # expectation recorded
            text = await metrics_text(r)
            assert (
                metric(text, "kvroute_prediction_outcomes_total", worker="w1", outcome="exact") == 1
            )
            assert metric(text, "kvroute_routing_decisions_total", reason="cache") == 1

    run(go())


def test_dp_rank_header_when_workers_share_a_url() -> None:
    async def go() -> None:
        async with rig(1) as r:
            url = r.engine_urls["w0"]
            add = await r.client.post(
                "/admin/workers",
                json={"name": "w0-rank1", "url": url, "dp_rank": 1, "model": "m"},
                headers=r.admin_headers(),
            )
            assert add.status_code == 201
            await r.client.post("/admin/workers/w0/drain", headers=r.admin_headers())
            await r.client.post("/v1/chat/completions", json=CHAT)
            assert r.engines["w0"].received[-1].headers["x-data-parallel-rank"] == "1"

    run(go())


def test_configured_model_without_workers_is_503_unknown_is_404() -> None:
    async def go() -> None:
        async with rig(1) as r:
            r.engines["w0"].models = []
            await _refresh_models(r, "w0")
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 503 and "retry-after" in resp.headers
            resp = await r.client.post("/v1/chat/completions", json={**CHAT, "model": "zzz"})
            assert resp.status_code == 404

    run(go())


def test_an_index_failure_routes_without_evidence() -> None:
    from tests.router.fakes import ScriptedIndex

    class Broken(ScriptedIndex):
        def score(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("index bug")

        def expect(self, *a: Any, **k: Any) -> None:
            raise RuntimeError("index bug")

    async def go() -> None:
        async with rig(2, index=Broken()) as r:
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert resp.status_code == 200
            assert r.parts.decisions.recent(1)[0].decision.reason == "least_load"
            assert metric(await metrics_text(r), "kvroute_errors_total", kind="index") == 2

    run(go())


def test_requests_that_skip_the_prefix_cache_predict_no_reuse() -> None:
    async def go() -> None:
        async with rig(2) as r:
            r.index.scores = {"w0": 0, "w1": 16}
            resp = await r.client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 1})
            assert resp.status_code == 200
            d = r.parts.decisions.recent(1)[0].decision
            assert d.reason != "cache" and d.predicted_reuse == 0
            assert r.index.expected == []  # nothing to expect: vLLM does not read the cache
            resp = await r.client.post("/v1/chat/completions", json=CHAT)
            assert r.parts.decisions.recent(1)[0].decision.reason == "cache"

    run(go())


def test_stream_end_goes_out_with_the_last_event() -> None:
    """Once the upstream answer is complete, the last event and the end of the body are one
    ASGI message (one write to the client), never an empty closing message after it; what the
    client receives is unchanged."""

    async def go() -> None:
        async with rig(1) as r:
            req = {**CHAT, "stream": True}
            raw = json.dumps(req).encode()
            scope = {
                "type": "http",
                "method": "POST",
                "path": "/v1/chat/completions",
                "headers": [(b"content-type", b"application/json")],
            }
            messages = [{"type": "http.request", "body": raw, "more_body": False}]
            finished = asyncio.Event()

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await finished.wait()
                return {"type": "http.disconnect"}

            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            await r.parts.proxy.handle("/v1/chat/completions", scope, receive, send)
            finished.set()
            assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
            bodies = sent[1:]
            assert [m.get("more_body", False) for m in bodies] == [True] * (len(bodies) - 1) + [
                False
            ]
            assert bodies[-1]["body"].endswith(b"data: [DONE]\n\n")
            assert all(m["body"] for m in bodies)
            async with httpx.AsyncClient() as c:
                direct = await c.post(r.engine_urls["w0"] + "/v1/chat/completions", json=req)
            assert b"".join(m["body"] for m in bodies) == direct.content

    run(go())


def test_queued_prefill_is_held_for_the_measured_rates_wall_time() -> None:
    """The prefill-done timer (no byte back from a hanging engine) releases a request's queued
    tokens after its estimated TTFT; with load.release_at_measured_rate that estimate is
    converted at the measured prefill rate, here 20x slower than the configured one."""

    async def queued_after(release_at_measured_rate: bool) -> tuple[int, int]:
        async with rig(
            1,
            policy={"prefill_tokens_per_s": 20_000.0},
            load={"release_at_measured_rate": release_at_measured_rate},
        ) as r:
            r.engines["w0"].hang = True
            for i in range(64):  # streams whose first bytes showed 1,000 tokens/s
                r.parts.prefill_rate.observe(500 + 100 * i, (500 + 100 * i) / 1000.0)
            prompt = "p" * 2000  # about 0.1 s at the configured rate, 2 s at the measured one
            body = {"model": "m", "prompt": prompt, "max_tokens": 4}
            task = asyncio.create_task(r.client.post("/v1/completions", json=body))
            worker = r.parts.registry.get("w0")
            assert worker is not None
            load = worker.load
            for _ in range(500):  # the request reaches the worker's books (5 s at most)
                if load.running:
                    break
                await asyncio.sleep(0.01)
            held = load.queued_prefill_tokens
            await asyncio.sleep(0.5)
            later = load.queued_prefill_tokens
            task.cancel()
            return held, later

    held, later = run(queued_after(True))
    assert held >= 2000 and later == held  # still prefilling at the measured rate
    held, later = run(queued_after(False))
    assert held >= 2000 and later == 0  # released at the configured rate's 0.1 s
