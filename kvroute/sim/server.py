"""Running a simulated engine: in-process (tests, demo) or as the `kvroute sim` process.

with SimEngineThread(EngineConfig(speed=20)) as sim:      # port 0, own thread + loop
    sim.url            -> "http://127.0.0.1:PORT"
    sim.events         -> "tcp://127.0.0.1:PORT" (PUB), sim.replay (ROUTER)
    sim.engine, sim.publisher                                 # for white-box tests

server = await start_engine(config)   # same, as a task in the running event loop
...; await server.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from kvroute.sim.api.app import build_app
from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheBackend, CacheSpec
from kvroute.sim.engine.core import Engine, EngineConfig
from kvroute.sim.publisher import EventPublisher, PublisherConfig

DEFAULT_PUBLISHER = PublisherConfig()  # loopback, ephemeral PUB and replay ports, wire 0.33
SHUTDOWN_GRACE_S = 1.0  # how long a stopping engine lets running requests finish


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket (port 0 = a free ephemeral port), ready for uvicorn; the
    connections it accepts have Nagle's algorithm off (TCP_NODELAY), as vLLM's do."""
    # asyncio sets TCP_NODELAY on an accepted socket only when its proto is IPPROTO_TCP, and an
    # accepted socket inherits the listener's proto (0 by default). Without it the response
    # body, written after the headers, waited for the client's delayed ACK (40 ms on Linux):
    # vllm-router paid that on every request here, where vLLM itself (uvloop, which always
    # sets TCP_NODELAY) answers at once.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class RunningEngine:
    """A started engine in the current event loop."""

    engine: Engine
    publisher: EventPublisher | None
    server: uvicorn.Server
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        """The HTTP base URL."""
        return f"http://{self.host}:{self.port}"

    @property
    def events(self) -> str | None:
        """The ZMQ PUB endpoint, if events are published."""
        return self.publisher.endpoint if self.publisher else None

    @property
    def replay(self) -> str | None:
        """The ZMQ replay endpoint, if there is one."""
        return self.publisher.replay_endpoint if self.publisher else None

    async def aclose(self) -> None:
        """Stop the HTTP server (and with it the engine) and close the publisher."""
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self.task, 10)
        if self.publisher is not None:
            self.publisher.close()


async def start_engine(
    config: EngineConfig,
    publisher_config: PublisherConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    fail_seed: int = 0,
    cache_factory: Callable[[CacheSpec], CacheBackend] = SimCache,
    name: str | None = None,
) -> RunningEngine:
    """Start an engine + its HTTP server (+ event publisher) in the running loop.

    `cache_factory` picks the cache backend (kvroute's SimCache, or vLLM's real manager via
    `kvroute.sim.vllm_backend` inside the vLLM environment); `name`, if given, is answered as each
    response's `system_fingerprint`."""
    publisher = EventPublisher(publisher_config) if publisher_config is not None else None
    if publisher is not None:
        publisher.start()
    engine = Engine(config, publisher=publisher, cache_factory=cache_factory)
    app = build_app(engine, publisher, fail_seed=fail_seed, name=name)
    sock = bind_socket(host, port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            # requests still running at shutdown are cancelled after this (their clients see
            # the connection end) instead of holding the stop forever
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]), name="sim-http")
    while not server.started:
        if task.done():
            sock.close()
            if publisher is not None:
                publisher.close()
            await task  # raises the startup error
            raise RuntimeError("simulated engine server exited during start-up")
        await asyncio.sleep(0.01)
    bound_port = sock.getsockname()[1]
    if engine.kv is not None:
        engine.kv.side_channel = (host, bound_port)  # the HTTP port stands for vLLM's side channel
    return RunningEngine(engine, publisher, server, task, host, bound_port)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel every task still on a stopped loop, let them unwind, then close it (as
    `asyncio.run` does): a coroutine left pending on a closed loop fails later, at garbage
    collection, far from its cause."""
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


class SimEngineThread:
    """A simulated engine on its own thread and event loop, for synchronous callers."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        publisher_config: PublisherConfig | None = DEFAULT_PUBLISHER,
        **kwargs: Any,
    ) -> None:
        self.config = config or EngineConfig()
        self.publisher_config = publisher_config
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self.running: RunningEngine | None = None

    def start(self) -> SimEngineThread:
        """Start the engine on its own thread; returns once it serves (or raises)."""
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self.running = self._loop.run_until_complete(
                    start_engine(self.config, self.publisher_config, **self._kwargs)
                )
            except BaseException as exc:  # reported to the starting thread
                error.append(exc)
                _close_loop(self._loop)
                ready.set()
                return
            ready.set()
            try:
                self._loop.run_forever()
            finally:
                _close_loop(self._loop)

        self._thread = threading.Thread(target=run, name="sim-engine-thread", daemon=True)
        self._thread.start()
        ready.wait(30)
        if error:
            raise error[0]
        if self.running is None:
            raise RuntimeError("simulated engine did not start in 30 s")
        return self

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the engine's loop (e.g. white-box checks) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        """Stop the engine and its thread (no-op if not running)."""
        if self.running is not None and self._thread is not None:
            with contextlib.suppress(Exception):
                self.call(self.running.aclose(), timeout=SHUTDOWN_GRACE_S + 10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)  # the thread cancels what is left and closes the loop
            self.running = None

    def __enter__(self) -> SimEngineThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _started(self) -> RunningEngine:
        if self.running is None:
            raise RuntimeError("the simulated engine is not running (start() it first)")
        return self.running

    @property
    def engine(self) -> Engine:
        """The engine (for white-box checks)."""
        return self._started.engine

    @property
    def publisher(self) -> EventPublisher | None:
        """The engine's event publisher, if it publishes events."""
        return self._started.publisher

    @property
    def url(self) -> str:
        """The engine's HTTP base URL."""
        return self._started.url

    @property
    def events(self) -> str | None:
        """The engine's ZMQ PUB endpoint, if it publishes events."""
        return self._started.events

    @property
    def replay(self) -> str | None:
        """The engine's ZMQ replay endpoint, if it has one."""
        return self._started.replay
