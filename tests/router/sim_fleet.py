"""Simulated vLLM engines (sim/), each with a real kvroute bridge, and a real router in front,
all on loopback in one event loop. The router tokenizes with the sim's model directory
(exact ids), follows the bridges over gRPC (or an engine's ZMQ socket in-process) and scores
with the real indexer."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.follower import EngineEndpoints
from kvroute.router.app import Components, create_app
from kvroute.router.config_load import config_from_dict
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.model import MODEL_DIR
from kvroute.sim.publisher import PublisherConfig
from kvroute.sim.server import RunningEngine, start_engine
from tests.router.fake_engine import serve
from tests.router.harness import ADMIN
from tests.router.test_events import until

MODEL = "kvroute-sim"


@dataclass
class SimRig:
    url: str
    client: httpx.AsyncClient
    engines: dict[str, RunningEngine]
    bridges: dict[str, Bridge]
    parts: Components
    cached: dict[str, int] = field(default_factory=dict)  # engine-reported, per worker

    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {ADMIN}"}

    async def chat(self, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
        """One non-streaming chat request through the router; returns the JSON answer plus
        `_worker` (which engine answered) and records its cached tokens, once the router has
        applied the events the request caused (see `events_applied`)."""
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, **extra}
        resp = await self.client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        answer: dict[str, Any] = resp.json()
        worker = resp.headers["x-kvroute-worker"]
        answer["_worker"] = worker
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        self.cached[worker] = self.cached.get(worker, 0) + cached
        await self.events_applied()
        return answer

    async def events_applied(self, timeout: float = 10.0) -> None:
        """Wait until the router has applied every event batch the engines have published.

        An engine publishes a step's events while the same step's output goes to the client,
        so the next request can be routed before the router sees the last block of the
        previous answer (one block short): real event lag, not a prediction error. Tests that
        check predictions token for token call this between dependent requests.
        """

        def applied() -> bool:
            for name, running in self.engines.items():
                pub = running.publisher
                assert pub is not None
                if pub.sent + pub.dropped != pub.accepted:
                    return False  # still in the publisher's queue
                status = self.parts.events.status(name)
                last = status.last_sequence if status is not None else None
                if pub.next_seq > 0 and last != pub.next_seq - 1:
                    return False
            return True

        await until(applied, timeout)

    async def probe(self, worker: str, body: dict[str, Any]) -> int:
        """The engine's own answer: how many tokens it would reuse now (/sim/probe)."""
        async with httpx.AsyncClient() as c:
            resp = await c.post(self.engines[worker].url + "/sim/probe", json=body)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["cached_tokens"])

    async def fault(self, worker: str, **settings: Any) -> None:
        async with httpx.AsyncClient() as c:
            resp = await c.post(self.engines[worker].url + "/sim/faults", json=settings)
        assert resp.status_code == 200, resp.text


@contextlib.asynccontextmanager
async def sim_fleet(
    n: int = 3,
    *,
    profile: str = "dense",
    policy: str = "ttft",
    via: str = "bridge",
    engine: dict[str, Any] | None = None,
    router: dict[str, Any] | None = None,
) -> AsyncIterator[SimRig]:
    """n simulated engines w0..w(n-1) (speed x200), their bridges, and a router."""
    engines: dict[str, RunningEngine] = {}
    bridges: dict[str, Bridge] = {}
    async with contextlib.AsyncExitStack() as stack:
        for i in range(n):
            cfg = EngineConfig(**{"profile": profile, "speed": 200.0, "seed": i, **(engine or {})})
            running = await start_engine(cfg, PublisherConfig())
            stack.push_async_callback(running.aclose)
            engines[f"w{i}"] = running
        workers: list[dict[str, Any]] = []
        for name, running in engines.items():
            spec: dict[str, Any] = {"name": name, "url": running.url}
            assert running.events is not None
            if via == "bridge":
                bridge = Bridge(
                    BridgeConfig(
                        engines=(EngineEndpoints(0, running.events, running.replay),),
                        listen="127.0.0.1:0",
                    )
                )
                await bridge.start()
                stack.push_async_callback(bridge.stop)
                bridges[name] = bridge
                spec["bridge"] = f"127.0.0.1:{bridge.grpc_port}"
            else:
                spec["zmq"] = running.events
                spec["replay"] = running.replay
            workers.append(spec)
        data: dict[str, Any] = {
            "workers": workers,
            "models": {MODEL: {"tokenizer": str(MODEL_DIR)}},
            "policy": policy,
            "admin": {"token": ADMIN, "response_headers": True},
            "health": {"interval_s": 0.5},
            "load": {"metrics_interval_s": 0.2},
            "retry": {"backoff_initial_s": 0.001, "backoff_max_s": 0.005},
        }
        for key, value in (router or {}).items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        app = create_app(config_from_dict(data))
        url = await stack.enter_async_context(serve(app))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=30))
        parts: Components = app.state.kvroute
        await until(lambda: not parts.events.unusable(), timeout=20)
        yield SimRig(url, client, engines, bridges, parts)


def send_ids(rig_router: dict[str, Any] | None = None) -> dict[str, Any]:
    """Router settings for `sim_fleet` with `send_token_ids` on for the simulated model."""
    model = {"tokenizer": str(MODEL_DIR), "send_token_ids": True}
    return {"models": {MODEL: model}, **(rig_router or {})}


def sent_as_ids(r: SimRig, endpoint: str = "/v1/chat/completions") -> dict[str, float]:
    """`kvroute_sent_as_token_ids_total` of one endpoint, by result."""
    metric = r.parts.metrics.sent_as_ids
    return {
        s.labels["result"]: s.value
        for m in metric.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["endpoint"] == endpoint
    }
