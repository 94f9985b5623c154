"""Where the router's workers come from: a static list, a watched file, Kubernetes pods.

Every source reports to a `DiscoverySink` (the router's worker registry) with
`upsert(WorkerSpec)` and `drain(name)` (`kvroute/router/fleet/discovery/sink.py`).
"""

from kvroute.router.fleet.discovery.config import (
    DiscoveryConfig,
    DiscoveryConfigError,
    DiscoveryHandle,
    FileConfig,
    KubernetesConfig,
    parse_discovery_config,
    start_discovery,
)
from kvroute.router.fleet.discovery.file_watch import FileSource, load_workers_file
from kvroute.router.fleet.discovery.k8s import KubernetesSource, PodClient
from kvroute.router.fleet.discovery.pods import PodDefaults, is_ready, worker_from_pod
from kvroute.router.fleet.discovery.sink import DiscoverySink, DiscoveryStats, SourceView
from kvroute.router.fleet.discovery.spec import (
    WorkerSpec,
    WorkerSpecError,
    parse_worker,
    parse_workers,
    valid_worker_name,
)
from kvroute.router.fleet.discovery.static import StaticSource

__all__ = [
    "DiscoveryConfig",
    "DiscoveryConfigError",
    "DiscoveryHandle",
    "DiscoverySink",
    "DiscoveryStats",
    "FileConfig",
    "FileSource",
    "KubernetesConfig",
    "KubernetesSource",
    "PodClient",
    "PodDefaults",
    "SourceView",
    "StaticSource",
    "WorkerSpec",
    "WorkerSpecError",
    "is_ready",
    "load_workers_file",
    "parse_discovery_config",
    "parse_worker",
    "parse_workers",
    "start_discovery",
    "valid_worker_name",
    "worker_from_pod",
]
