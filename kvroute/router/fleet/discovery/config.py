"""The `discovery:` section of the router config, and starting the sources it names."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvroute.router.fleet.discovery.file_watch import FileSource
from kvroute.router.fleet.discovery.k8s import KubernetesSource, PodClient
from kvroute.router.fleet.discovery.pods import PodDefaults
from kvroute.router.fleet.discovery.sink import DiscoverySink, DiscoveryStats

log = logging.getLogger(__name__)

DEFAULT_SELECTOR = "kvroute.io/role=worker"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class DiscoveryConfigError(ValueError):
    """The `discovery:` section is malformed; the message names the key."""


@dataclass(frozen=True, slots=True)
class FileConfig:
    path: str
    poll_seconds: float = 2.0


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    namespace: str | None = None  # None: the pod's own namespace, else "default"
    selector: str = DEFAULT_SELECTOR
    engine_port: int = 8000
    bridge_port: int | None = 50051
    watch_timeout_seconds: int = 300
    max_workers: int = 4096
    kubeconfig: str | None = None  # outside a cluster: this kubeconfig file


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    file: FileConfig | None = None
    kubernetes: KubernetesConfig | None = None


def _section(obj: object, where: str, keys: set[str]) -> Mapping[str, object]:
    if not isinstance(obj, Mapping):
        raise DiscoveryConfigError(f"{where}: expected a mapping")
    unknown = [k for k in obj if k not in keys]
    if unknown:
        raise DiscoveryConfigError(f"{where}: unknown keys {sorted(map(str, unknown))}")
    return obj


def _num(obj: Mapping[str, object], key: str, where: str, lo: float, hi: float) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise DiscoveryConfigError(f"{where}.{key}: expected a number in [{lo}, {hi}]")
    return value


def _int(obj: Mapping[str, object], key: str, where: str, lo: int, hi: int, default: int) -> int:
    value = _num(obj, key, where, lo, hi)
    if value is None:
        return default
    if not isinstance(value, int):
        raise DiscoveryConfigError(f"{where}.{key}: expected an integer")
    return value


def _text(obj: Mapping[str, object], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise DiscoveryConfigError(f"{where}.{key}: expected a non-empty string")
    return value


def parse_discovery_config(obj: object) -> DiscoveryConfig:
    """Validate the `discovery:` mapping (None or {} = no dynamic discovery)."""
    if obj is None:
        return DiscoveryConfig()
    top = _section(obj, "discovery", {"file", "kubernetes"})
    file_cfg = None
    if top.get("file") is not None:
        f = _section(top["file"], "discovery.file", {"path", "poll_seconds"})
        path = _text(f, "path", "discovery.file")
        if path is None:
            raise DiscoveryConfigError("discovery.file.path: required")
        poll = _num(f, "poll_seconds", "discovery.file", 0.05, 3600.0)
        file_cfg = FileConfig(path, float(poll) if poll is not None else 2.0)
    kube_cfg = None
    if top.get("kubernetes") is not None:
        where = "discovery.kubernetes"
        k = _section(
            top["kubernetes"],
            where,
            {
                "namespace",
                "selector",
                "engine_port",
                "bridge_port",
                "watch_timeout_seconds",
                "max_workers",
                "kubeconfig",
            },
        )
        bridge_port: int | None = 50051
        if "bridge_port" in k and k["bridge_port"] is None:
            bridge_port = None
        else:
            bridge_port = _int(k, "bridge_port", where, 1, 65535, 50051)
        kube_cfg = KubernetesConfig(
            namespace=_text(k, "namespace", where),
            selector=_text(k, "selector", where) or DEFAULT_SELECTOR,
            engine_port=_int(k, "engine_port", where, 1, 65535, 8000),
            bridge_port=bridge_port,
            watch_timeout_seconds=_int(k, "watch_timeout_seconds", where, 1, 3600, 300),
            max_workers=_int(k, "max_workers", where, 1, 1_000_000, 4096),
            kubeconfig=_text(k, "kubeconfig", where),
        )
    return DiscoveryConfig(file_cfg, kube_cfg)


def _own_namespace() -> str:
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


async def connect_kubernetes(cfg: KubernetesConfig) -> PodClient:
    """A pod client with in-cluster credentials, or the kubeconfig outside a cluster."""
    from kubernetes.aio import client as kclient
    from kubernetes.aio import config as kconfig

    from kvroute.router.fleet.discovery.kube_client import KubePodClient

    configuration = kclient.Configuration()
    if cfg.kubeconfig is not None:
        await kconfig.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=cfg.kubeconfig, client_configuration=configuration
        )
    else:
        try:
            kconfig.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        except kconfig.ConfigException:
            await kconfig.load_kube_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
    return KubePodClient(
        kclient.ApiClient(configuration),
        cfg.namespace or _own_namespace(),
        cfg.selector,
        watch_timeout_seconds=cfg.watch_timeout_seconds,
    )


@dataclass
class DiscoveryHandle:
    """The running sources; `stop()` cancels them and drains what they announced."""

    files: list[FileSource] = field(default_factory=list)
    kubernetes: list[KubernetesSource] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def stats(self) -> list[DiscoveryStats]:
        """Counters of every source."""
        return [s.stats for s in self.files] + [s.stats for s in self.kubernetes]

    async def stop(self, *, drain: bool = False) -> None:
        """Cancel the sources. With `drain`, also drain their workers (on shutdown the
        router usually does not care)."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for f in self.files:
            if drain:
                f.stop()
        for k in self.kubernetes:
            if drain:
                k.drain_all()
            await k.close_client()


async def start_discovery(
    config: DiscoveryConfig, sink: DiscoverySink, *, kube_client: PodClient | None = None
) -> DiscoveryHandle:
    """Start the configured sources as tasks on the running loop. The file source reads
    its file once before this returns, so its workers are there from the start."""
    handle = DiscoveryHandle()
    if config.file is not None:
        source = FileSource(sink, config.file.path, poll_seconds=config.file.poll_seconds)
        source.poll_once()
        handle.files.append(source)
        handle.tasks.append(asyncio.create_task(source.run(), name="discovery-file"))
    if config.kubernetes is not None:
        cfg = config.kubernetes
        client = kube_client if kube_client is not None else await connect_kubernetes(cfg)
        kube = KubernetesSource(
            sink,
            client,
            defaults=PodDefaults(engine_port=cfg.engine_port, bridge_port=cfg.bridge_port),
            max_workers=cfg.max_workers,
        )
        handle.kubernetes.append(kube)
        handle.tasks.append(asyncio.create_task(kube.run(), name="discovery-kubernetes"))
    return handle
