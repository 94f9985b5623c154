"""How a Kubernetes pod (its JSON, as the API serves it) describes a worker.

Pure: a pod mapping in, a `WorkerSpec` (ready), `None` (not ready / not a worker yet) or a
`WorkerSpecError` (the pod says something unusable) out. The labels and annotations are
set by the Helm chart (`deploy/helm/kvroute/templates/worker-deployment.yaml`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvroute.router.fleet.discovery.spec import (
    WorkerSpec,
    WorkerSpecError,
    check_host_port,
    parse_worker,
)

PREFIX = "kvroute.io/"
_DIGITS = re.compile(r"[0-9]{1,6}")


@dataclass(frozen=True, slots=True)
class PodDefaults:
    """Values used when a pod's annotations and labels do not say."""

    engine_port: int = 8000
    bridge_port: int | None = 50051  # None: pods have no bridge unless they say so
    scheme: str = "http"


def pod_name(pod: Mapping[str, object]) -> str | None:
    """`<namespace>/<name>` of a pod mapping, or None if its metadata is unusable."""
    meta = pod.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name or not isinstance(namespace, str) or not namespace:
        return None
    return f"{namespace}/{name}"


def _strmap(meta: Mapping[str, object], key: str) -> Mapping[str, object]:
    value = meta.get(key)
    return value if isinstance(value, Mapping) else {}


def _setting(meta: Mapping[str, object], key: str) -> str | None:
    """Annotation `kvroute.io/<key>`, else the label of the same key."""
    for source in ("annotations", "labels"):
        value = _strmap(meta, source).get(PREFIX + key)
        if value is not None:
            if not isinstance(value, str):
                raise WorkerSpecError(f"{PREFIX}{key}: expected a string")
            return value.strip()
    return None


def _digits(value: str) -> bool:
    # str.isdigit() also accepts e.g. superscripts, which int() rejects.
    return _DIGITS.fullmatch(value) is not None


def _port(value: str, key: str) -> int:
    if not _digits(value) or not 0 < int(value) < 65536:
        raise WorkerSpecError(f"{PREFIX}{key}: expected a port number, got {value!r}")
    return int(value)


def is_ready(pod: Mapping[str, object]) -> bool:
    """Running, has an IP, condition Ready=True, and not being deleted."""
    meta = _strmap(pod, "metadata")
    if meta.get("deletionTimestamp"):
        return False
    status = _strmap(pod, "status")
    if status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def worker_from_pod(pod: Mapping[str, object], defaults: PodDefaults) -> WorkerSpec | None:
    """The worker a ready pod stands for; None if the pod is not ready. Raises
    WorkerSpecError if the pod's kvroute.io/* settings are malformed."""
    name = pod_name(pod)
    if name is None:
        raise WorkerSpecError("pod without metadata.name/namespace")
    if not is_ready(pod):
        return None
    meta = _strmap(pod, "metadata")
    ip = _strmap(pod, "status").get("podIP")
    if not isinstance(ip, str):
        raise WorkerSpecError("status.podIP: expected a string")
    host = _host(ip)

    scheme = _setting(meta, "engine-scheme") or defaults.scheme
    if scheme not in ("http", "https"):
        raise WorkerSpecError(f"{PREFIX}engine-scheme: expected http or https, got {scheme!r}")
    engine = _setting(meta, "engine-port")
    engine_port = _port(engine, "engine-port") if engine is not None else defaults.engine_port

    bridge = _setting(meta, "bridge")
    if bridge is not None:
        check_host_port(bridge, PREFIX + "bridge")
    else:
        bridge_port_s = _setting(meta, "bridge-port")
        if bridge_port_s == "none":
            bridge_port: int | None = None
        elif bridge_port_s is not None:
            bridge_port = _port(bridge_port_s, "bridge-port")
        else:
            bridge_port = defaults.bridge_port
        bridge = f"{host}:{bridge_port}" if bridge_port is not None else None

    dp = _setting(meta, "dp-rank")
    if dp is not None and (not _digits(dp) or len(dp) > 6):
        raise WorkerSpecError(f"{PREFIX}dp-rank: expected an integer, got {dp!r}")
    uid = meta.get("uid")
    return parse_worker(
        {
            "name": name,
            "url": f"{scheme}://{host}:{engine_port}",
            "bridge": bridge,
            "dp_rank": int(dp) if dp is not None else 0,
            "model": _setting(meta, "model") or None,
            # not `kvroute.io/role`: that label already marks a pod as a worker for the selector
            "role": _setting(meta, "pd-role") or None,
            "instance": uid if isinstance(uid, str) else "",
        }
    )
