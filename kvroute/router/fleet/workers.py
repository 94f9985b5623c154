"""The worker registry: which engines exist, what they serve, and whether they take requests.

Membership changes come from a `Discovery` (the static list in the config today; Kubernetes can
plug in later) and from the admin API. Components that keep per-worker state (event
subscriptions, the index) register a `RegistryListener` and follow additions and removals.
"""

from __future__ import annotations

import time
from bisect import bisect_left
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
        # Kept per change in O(models of the worker), never rebuilt over the whole fleet (a
        # fleet of thousands reporting its models one by one would make start-up quadratic):
        # model -> its workers in registry order
        self._model_workers: dict[str, _Members] = {}
        self._routes: dict[str, ModelRoute] = {}  # dropped when a model's workers change
        self._by_url: dict[str, list[Worker]] = {}  # DP ranks share one URL
        self._seq = 0  # registry order: a worker added later sorts after
        self._order: dict[str, int] = {}

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
        self._seq += 1
        self._order[spec.name] = self._seq
        self._url_joined(worker)
        self._reindex(worker, set())
        for listener in self._listeners:
            listener.worker_added(worker)
        return worker

    def remove(self, name: str) -> Worker | None:
        """Remove at once (in-flight requests finish on their own); None if unknown."""
        worker = self._workers.pop(name, None)
        if worker is None:
            return None
        self._url_left(worker)
        self._unindex(worker)
        del self._order[name]
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
            before = current.serves()
            current.spec = spec
            self._reindex(current, before)
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
            before = worker.serves()
            worker.model_cards = dict(cards)
            if self._workers.get(worker.name) is worker:
                self._reindex(worker, before)

    def serving(self, model: str) -> list[Worker]:
        """Workers whose model list has `model`, in registry order (any state; callers filter
        eligibility). The registry's own list: read it, do not change it."""
        members = self._model_workers.get(model)
        return members.workers if members is not None else []

    def route(self, model: str) -> ModelRoute | None:
        """Resolve a request's model name; None when no worker serves it."""
        route = self._routes.get(model)
        if route is None:
            serving = self.serving(model)
            if not serving:
                return None
            # the first worker in registry order that serves it says what it is
            card = serving[0].model_cards.get(model, {})
            parent = card.get("parent")
            if isinstance(parent, str) and parent and parent != model:
                route = ModelRoute(name=model, base=parent, lora_name=model)
            else:
                route = ModelRoute(name=model, base=model, lora_name="")
            self._routes[model] = route
        return route

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

    def _reindex(self, worker: Worker, before: set[str]) -> None:
        """The worker served `before` and serves what it says now: move it between models
        and drop the routes of every model it touched (its cards may have changed them)."""
        now = worker.serves()
        order = self._order[worker.name]
        for model in before - now:
            self._leave(model, worker, order)
        for model in now - before:
            self._model_workers.setdefault(model, _Members()).join(worker, order)
        for model in before | now:
            self._routes.pop(model, None)

    def _unindex(self, worker: Worker) -> None:
        order = self._order[worker.name]
        for model in worker.serves():
            self._leave(model, worker, order)
            self._routes.pop(model, None)

    def _leave(self, model: str, worker: Worker, order: int) -> None:
        members = self._model_workers.get(model)
        if members is not None and members.leave(worker, order) == 0:
            del self._model_workers[model]

    def _url_joined(self, worker: Worker) -> None:
        same = self._by_url.setdefault(worker.url, [])
        same.append(worker)
        if len(same) > 1:
            for w in same:
                w.url_shared = True

    def _url_left(self, worker: Worker) -> None:
        same = self._by_url.get(worker.url, [])
        if worker in same:
            same.remove(worker)
        if len(same) == 1:
            same[0].url_shared = False
        elif not same:
            self._by_url.pop(worker.url, None)


@dataclass(slots=True)
class _Members:
    """One model's workers in registry order, with their order numbers beside them: a
    worker joins or leaves by bisection (a memmove, no pass in Python)."""

    orders: list[int] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    def join(self, worker: Worker, order: int) -> None:
        at = bisect_left(self.orders, order)
        self.orders.insert(at, order)
        self.workers.insert(at, worker)

    def leave(self, worker: Worker, order: int) -> int:
        """Drop the worker if it is a member; returns how many remain."""
        at = bisect_left(self.orders, order)
        if at < len(self.orders) and self.workers[at] is worker:
            del self.orders[at]
            del self.workers[at]
        return len(self.workers)
