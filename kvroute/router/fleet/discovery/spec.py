"""What discovery tells the router about one worker, and the one decoder for it.

`parse_worker` accepts exactly the `workers:` entries of the router config
(`docs/configuration.md`), so a static list, a watched file and the admin API
all decode workers the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A DNS-1123-ish name, plus "/" so Kubernetes workers can be "<namespace>/<pod>".
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,252}$")
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$")
_URL = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?(/[^\s]*)?$")
_ZMQ = re.compile(r"^(tcp|ipc|inproc)://\S+$")
_KEYS = frozenset(
    {"name", "url", "bridge", "zmq", "replay", "topic", "dp_rank", "model", "instance", "role"}
)
ROLES = ("both", "prefill", "decode")
MAX_DP_RANK = 1 << 16


class WorkerSpecError(ValueError):
    """A worker description that cannot be used; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine the router may send requests to (field names follow the router config)."""

    name: str
    url: str
    bridge: str | None = None
    zmq: str | None = None
    replay: str | None = None
    topic: str = ""
    dp_rank: int = 0
    model: str | None = None
    instance: str = ""
    role: str = "both"


def valid_worker_name(name: str) -> bool:
    """Whether `name` may name a worker: letters, digits and `._-:/`, at most 253 characters,
    starting with a letter or digit (so `<namespace>/<pod>` is one)."""
    return _NAME.match(name) is not None


def check_host_port(value: str, field: str) -> str:
    """Return `value` if it is a usable "host:port", else raise WorkerSpecError."""
    match = _HOST_PORT.match(value)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise WorkerSpecError(f"{field}: expected host:port with a port in 1..65535, got {value!r}")
    return value


def _str(obj: Mapping[str, object], key: str, *, required: bool = False) -> str | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise WorkerSpecError(f"{key}: required")
        return None
    if not isinstance(value, str):
        raise WorkerSpecError(f"{key}: expected a string, got {type(value).__name__}")
    return value


def parse_worker(obj: object) -> WorkerSpec:
    """Validate one worker mapping; unknown keys and malformed fields raise WorkerSpecError."""
    if not isinstance(obj, Mapping):
        raise WorkerSpecError(f"worker: expected a mapping, got {type(obj).__name__}")
    bad_keys = [k for k in obj if not isinstance(k, str) or k not in _KEYS]
    if bad_keys:
        raise WorkerSpecError(f"worker: unknown keys {sorted(map(str, bad_keys))}")
    name = _str(obj, "name", required=True)
    url = _str(obj, "url", required=True)
    assert name is not None and url is not None
    if not valid_worker_name(name):
        raise WorkerSpecError(f"name: not a valid worker name: {name!r}")
    url = url.rstrip("/")
    port = _URL.match(url)
    if port is None or (port.group(2) is not None and not 0 < int(port.group(2)[1:]) < 65536):
        raise WorkerSpecError(f"url: expected http(s)://host[:port], got {url!r}")
    bridge = _str(obj, "bridge")
    if bridge is not None:
        check_host_port(bridge, "bridge")
    zmq = _str(obj, "zmq")
    replay = _str(obj, "replay")
    for field, endpoint in (("zmq", zmq), ("replay", replay)):
        if endpoint is not None and not _ZMQ.match(endpoint):
            raise WorkerSpecError(
                f"{field}: expected tcp://, ipc:// or inproc://, got {endpoint!r}"
            )
    if bridge is not None and zmq is not None:
        raise WorkerSpecError("worker: give at most one of bridge and zmq")
    if replay is not None and zmq is None:
        raise WorkerSpecError("replay: only meaningful with zmq")
    dp_rank = obj.get("dp_rank", 0)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int):
        raise WorkerSpecError(f"dp_rank: expected an integer, got {type(dp_rank).__name__}")
    if not 0 <= dp_rank < MAX_DP_RANK:
        raise WorkerSpecError(f"dp_rank: out of range 0..{MAX_DP_RANK - 1}: {dp_rank}")
    model = _str(obj, "model")
    if model is not None and not model.strip():
        raise WorkerSpecError("model: empty")
    role = _str(obj, "role") or "both"
    if role not in ROLES:
        raise WorkerSpecError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    if role != "both" and model is None:
        raise WorkerSpecError(f"model: a {role} worker must name its model")
    return WorkerSpec(
        name=name,
        url=url,
        bridge=bridge,
        zmq=zmq,
        replay=replay,
        topic=_str(obj, "topic") or "",
        dp_rank=dp_rank,
        model=model,
        instance=_str(obj, "instance") or "",
        role=role,
    )


def parse_workers(obj: object) -> list[WorkerSpec]:
    """Validate a `workers:` list; names must be unique. Raises WorkerSpecError."""
    if not isinstance(obj, Sequence) or isinstance(obj, str | bytes):
        raise WorkerSpecError(f"workers: expected a list, got {type(obj).__name__}")
    specs: list[WorkerSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(obj):
        try:
            spec = parse_worker(item)
        except WorkerSpecError as err:
            raise WorkerSpecError(f"workers[{i}]: {err}") from None
        if spec.name in seen:
            raise WorkerSpecError(f"workers[{i}]: duplicate name {spec.name!r}")
        seen.add(spec.name)
        specs.append(spec)
    return specs
