"""The worker registry: which engines exist, what they serve, and whether they take requests.

Membership changes come from a `Discovery` (the static list in the config today; Kubernetes can
plug in later) and from the admin API. Components that keep per-worker state (event
subscriptions, the index) register a `RegistryListener` and follow additions and removals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.router.config import BreakerConfig, WorkerSpec
from kvroute.router.fleet.breaker import CircuitBreaker
from kvroute.router.fleet.discovery.spec import WorkerSpec as DiscoveredSpec
from kvroute.router.fleet.load import WorkerLoad

ACTIVE = "active"
DRAINING = "draining"
# worker roles (`WorkerSpec.role`)
BOTH = "both"
PREFILL = "prefill"
DECODE = "decode"


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """What a request's `model` names: a base model, or a LoRA adapter on one."""

    name: str
    base: str
    lora_name: str  # "" for a base model


@dataclass(slots=True)
class Worker:
    spec: WorkerSpec
    breaker: CircuitBreaker
    load: WorkerLoad = field(default_factory=WorkerLoad)
    state: str = ACTIVE
    remove_when_drained: bool = False
    healthy: bool | None = None  # None until the first check
    health_failures: int = 0
    health_successes: int = 0
    health_error: str = ""
    # model id -> its /v1/models card; adapters have "parent" naming their base model
    model_cards: dict[str, dict[str, Any]] = field(default_factory=dict)
    added_at: float = field(default_factory=time.time)
    url_shared: bool = False  # another worker (DP rank) has the same URL

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url.rstrip("/")

    def serves(self) -> set[str]:
        names = set(self.model_cards)
        if self.spec.model:
            names.add(self.spec.model)
        return names

    def takes_requests(self, now: float) -> bool:
        """Eligible for a new request: active, not known-unhealthy, breaker allows."""
        return self.state == ACTIVE and self.healthy is not False and self.breaker.allows(now)

    def status(self) -> str:
        if self.state == DRAINING:
            return "drained" if self.load.running == 0 else "draining"
        if self.healthy is False:
            return "unhealthy"
        if self.breaker.state != "closed":
            return f"breaker_{self.breaker.state}"
        return "ready" if self.healthy else "unknown"


def _identity(spec: WorkerSpec) -> tuple[object, ...]:
    return (spec.url, spec.bridge, spec.zmq, spec.replay, spec.topic, spec.dp_rank, spec.instance)


def _as_worker_spec(spec: WorkerSpec | DiscoveredSpec) -> WorkerSpec:
    """Accept any record with the `workers:` entry fields (e.g. discovery's WorkerSpec)."""
    if isinstance(spec, WorkerSpec):
        return spec
    fields = (
        "name", "url", "bridge", "zmq", "replay", "topic", "dp_rank", "model", "instance", "role",
    )  # fmt: skip
    return WorkerSpec(**{f: getattr(spec, f) for f in fields if hasattr(spec, f)})


class RegistryListener(Protocol):
    def worker_added(self, worker: Worker) -> None: ...
    def worker_removed(self, worker: Worker) -> None: ...


class Discovery(Protocol):
    """A source of workers: adds and removes them on the registry while it runs."""

    async def run(self, registry: WorkerRegistry) -> None: ...


class StaticDiscovery:
    """The workers listed in the config, added once."""

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        self._specs = list(specs)

    async def run(self, registry: WorkerRegistry) -> None:
        for spec in self._specs:
            if registry.get(spec.name) is None:
                registry.add(spec)


class RegistryFull(ValueError):
    pass


class WorkerRegistry:
    """All known workers, by name, with a per-model index of who serves what."""

    def __init__(
        self,
        breaker: BreakerConfig,
        *,
        max_workers: int = 4096,
        on_breaker_change: Callable[[Worker, str, str], None] | None = None,
    ) -> None:
        self._breaker = breaker
        self._max = max_workers
        self._on_breaker_change = on_breaker_change
        self._workers: dict[str, Worker] = {}
        self._listeners: list[RegistryListener] = []
        self._by_model: dict[str, list[Worker]] | None = None
        self._routes: dict[str, ModelRoute] | None = None

    def listen(self, listener: RegistryListener) -> None:
        self._listeners.append(listener)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def names(self) -> list[str]:
        return list(self._workers)

    def get(self, name: str) -> Worker | None:
        return self._workers.get(name)

    def add(self, spec: WorkerSpec) -> Worker:
        """Add a worker; raises ValueError if the name exists or the registry is full."""
        if spec.name in self._workers:
            raise ValueError(f"worker {spec.name!r} already exists")
        if len(self._workers) >= self._max:
            raise RegistryFull(f"registry full ({self._max} workers, limits.max_workers)")
        cfg = self._breaker
        worker = Worker(
            spec=spec,
            breaker=CircuitBreaker(
                failure_threshold=cfg.failure_threshold,
                open_s=cfg.open_s,
                half_open_successes=cfg.half_open_successes,
            ),
        )
        if self._on_breaker_change is not None:
            hook = self._on_breaker_change
            worker.breaker.on_change = lambda old, new: hook(worker, old, new)
        self._workers[spec.name] = worker
        self._refresh_shared_urls()
        self._changed()
        for listener in self._listeners:
            listener.worker_added(worker)
        return worker

    def remove(self, name: str) -> Worker | None:
        """Remove at once (in-flight requests finish on their own); None if unknown."""
        worker = self._workers.pop(name, None)
        if worker is None:
            return None
        self._refresh_shared_urls()
        self._changed()
        for listener in self._listeners:
            listener.worker_removed(worker)
        return worker

    def start_drain(self, name: str, *, remove: bool = False) -> Worker | None:
        """Stop new requests to a worker; with `remove`, drop it once its last request ends."""
        worker = self._workers.get(name)
        if worker is None:
            return None
        worker.state = DRAINING
        worker.remove_when_drained = worker.remove_when_drained or remove
        self.request_finished(worker)
        return worker

    # -- DiscoverySink (kvroute/router/fleet/discovery): synchronous, on the loop
    # --------------------
    def upsert(self, spec: WorkerSpec | DiscoveredSpec) -> None:
        """Add a worker or replace its spec; a changed identity is a fresh engine."""
        spec = _as_worker_spec(spec)
        current = self._workers.get(spec.name)
        if current is None:
            self.add(spec)
            return
        if _identity(current.spec) != _identity(spec):
            self.remove(spec.name)
            self.add(spec)
            return
        if current.spec != spec:
            current.spec = spec
            self._changed()
        self.undrain(spec.name)

    def drain(self, name: str) -> None:
        """Discovery's drain: no new requests, remove once in-flight requests end."""
        self.start_drain(name, remove=True)

    def undrain(self, name: str) -> Worker | None:
        worker = self._workers.get(name)
        if worker is not None:
            worker.state = ACTIVE
            worker.remove_when_drained = False
        return worker

    def request_finished(self, worker: Worker) -> None:
        """Called after each request: completes a drain-and-remove when the last one ends."""
        if (
            worker.remove_when_drained
            and worker.load.running == 0
            and self._workers.get(worker.name) is worker
        ):
            self.remove(worker.name)

    def set_models(self, worker: Worker, cards: Mapping[str, dict[str, Any]]) -> None:
        if dict(cards) != worker.model_cards:
            worker.model_cards = dict(cards)
            self._changed()

    def serving(self, model: str) -> list[Worker]:
        """Workers whose model list has `model` (any state; callers filter eligibility)."""
        if self._by_model is None:
            self._rebuild()
        assert self._by_model is not None
        return self._by_model.get(model, [])

    def route(self, model: str) -> ModelRoute | None:
        """Resolve a request's model name; None when no worker serves it."""
        if self._routes is None:
            self._rebuild()
        assert self._routes is not None
        return self._routes.get(model)

    def model_cards(self) -> list[dict[str, Any]]:
        """One card per served model id across the fleet (first worker's card wins)."""
        cards: dict[str, dict[str, Any]] = {}
        for worker in self._workers.values():
            for name in sorted(worker.serves()):
                if name not in cards:
                    cards[name] = worker.model_cards.get(name) or {
                        "id": name,
                        "object": "model",
                        "owned_by": "kvroute",
                    }
        return list(cards.values())

    def _changed(self) -> None:
        self._by_model = None
        self._routes = None

    def _rebuild(self) -> None:
        by_model: dict[str, list[Worker]] = {}
        routes: dict[str, ModelRoute] = {}
        for worker in self._workers.values():
            for name in worker.serves():
                by_model.setdefault(name, []).append(worker)
                card = worker.model_cards.get(name, {})
                parent = card.get("parent")
                if isinstance(parent, str) and parent and parent != name:
                    routes.setdefault(name, ModelRoute(name=name, base=parent, lora_name=name))
                else:
                    routes.setdefault(name, ModelRoute(name=name, base=name, lora_name=""))
        self._by_model = by_model
        self._routes = routes

    def _refresh_shared_urls(self) -> None:
        counts: dict[str, int] = {}
        for w in self._workers.values():
            counts[w.url] = counts.get(w.url, 0) + 1
        for w in self._workers.values():
            w.url_shared = counts[w.url] > 1
