"""Static and file discovery (real files in a temp dir), the worker decoder, the config."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.fleet.discovery import (
    DiscoveryConfigError,
    FileSource,
    PodDefaults,
    StaticSource,
    WorkerSpec,
    WorkerSpecError,
    parse_discovery_config,
    parse_worker,
    parse_workers,
    start_discovery,
    worker_from_pod,
)
from kvroute.router.fleet.discovery.file_watch import MAX_FILE_BYTES
from kvroute.router.fleet.discovery.sink import DiscoveryStats, SourceView


class Registry:
    def __init__(self) -> None:
        self.active: dict[str, WorkerSpec] = {}
        self.calls: list[tuple[str, str]] = []

    def upsert(self, worker: WorkerSpec) -> None:
        self.active[worker.name] = worker
        self.calls.append(("upsert", worker.name))

    def drain(self, name: str) -> None:
        self.active.pop(name, None)
        self.calls.append(("drain", name))


def write(path: Path, workers: list[dict[str, Any]] | str) -> None:
    text = workers if isinstance(workers, str) else yaml.safe_dump({"workers": workers})
    path.write_text(text)


W0 = {"name": "w0", "url": "http://127.0.0.1:8001", "bridge": "127.0.0.1:50051"}
W1 = {"name": "w1", "url": "http://127.0.0.1:8002/", "model": "m"}


# ---- decoder ----


def test_parse_worker_accepts_router_config_entries() -> None:
    w = parse_worker(
        {
            "name": "w2",
            "url": "http://h:1/",
            "zmq": "tcp://h:5557",
            "replay": "tcp://h:5558",
            "topic": "kv",
            "dp_rank": 3,
        }
    )
    assert w == WorkerSpec("w2", "http://h:1", None, "tcp://h:5557", "tcp://h:5558", "kv", 3)
    assert parse_worker(W1).url == "http://127.0.0.1:8002"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"url": "http://h:1"}, "name: required"),
        ({"name": "a", "url": "ftp://h"}, "url"),
        ({"name": "a", "url": "http://h:99999"}, "url"),
        ({"name": "a b", "url": "http://h"}, "name"),
        ({"name": "a", "url": "http://h", "bridge": "h"}, "bridge"),
        ({"name": "a", "url": "http://h", "bridge": "h:0"}, "bridge"),
        ({"name": "a", "url": "http://h", "bridge": "h:1", "zmq": "tcp://h:2"}, "at most one"),
        ({"name": "a", "url": "http://h", "replay": "tcp://h:2"}, "replay"),
        ({"name": "a", "url": "http://h", "dp_rank": True}, "dp_rank"),
        ({"name": "a", "url": "http://h", "dp_rank": -1}, "dp_rank"),
        ({"name": "a", "url": "http://h", "model": " "}, "model"),
        ({"name": "a", "url": "http://h", "model": "m", "role": "producer"}, "role: expected"),
        ({"name": "a", "url": "http://h", "role": "decode"}, "decode worker must name its model"),
        ({"name": "a", "url": "http://h", "colour": "red"}, "unknown keys"),
        ({"name": 5, "url": "http://h"}, "name"),
        ("w0", "mapping"),
    ],
)
def test_parse_worker_rejects_with_a_clear_message(obj: object, message: str) -> None:
    with pytest.raises(WorkerSpecError, match=message):
        parse_worker(obj)


def test_parse_worker_reads_the_role() -> None:
    assert parse_worker(W1).role == "both"
    w = parse_worker({"name": "p", "url": "http://h:1", "model": "m", "role": "prefill"})
    assert w.role == "prefill"


def test_parse_workers_rejects_duplicates_and_non_lists() -> None:
    with pytest.raises(WorkerSpecError, match=r"workers\[1\]: duplicate"):
        parse_workers([W0, W0])
    with pytest.raises(WorkerSpecError, match="expected a list"):
        parse_workers("w0")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=12,
)
worker_like = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.text(max_size=20), json_values),
        "url": st.one_of(st.sampled_from(["http://h:1", "https://[::1]:8", "x"]), st.text()),
        "bridge": st.one_of(st.sampled_from(["h:1", "[::1]:5", "h:70000"]), st.text()),
        "zmq": st.one_of(st.sampled_from(["tcp://h:1", "ipc:///x"]), st.text()),
        "dp_rank": json_values,
        "model": json_values,
        "topic": json_values,
        "extra": json_values,
    },
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(json_values, worker_like))
def test_parse_worker_fuzz_never_fails_otherwise(obj: object) -> None:
    """Any JSON-like input gives a valid WorkerSpec or WorkerSpecError, nothing else."""
    try:
        w = parse_worker(obj)
    except WorkerSpecError:
        return
    assert w.name and w.url.startswith(("http://", "https://")) and not w.url.endswith("/")
    assert parse_worker({k: v for k, v in vars_of(w).items() if v not in (None, "")}) == w


def vars_of(w: WorkerSpec) -> dict[str, object]:
    return {k: getattr(w, k) for k in w.__slots__}


pod_annotations = st.dictionaries(
    st.sampled_from(
        [
            "kvroute.io/engine-port",
            "kvroute.io/bridge-port",
            "kvroute.io/bridge",
            "kvroute.io/model",
            "kvroute.io/dp-rank",
            "kvroute.io/engine-scheme",
        ]
    ),
    st.one_of(st.text(max_size=12), st.sampled_from(["8000", "none", "h:1", "https", "²"])),
)


@settings(max_examples=200, deadline=None)
@given(
    pod_annotations,
    st.one_of(st.none(), st.sampled_from(["10.0.0.1", "fd00::1"]), st.text(max_size=8)),
    st.sampled_from(["Running", "Pending", "Failed"]),
    st.booleans(),
    json_values,
)
def test_worker_from_pod_fuzz(
    annotations: dict[str, str], ip: str | None, phase: str, ready: bool, junk: object
) -> None:
    """Arbitrary pod settings yield a worker, None (not ready) or WorkerSpecError."""
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "n", "annotations": annotations, "junk": junk},
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": str(ready)}],
        },
    }
    try:
        w = worker_from_pod(pod, PodDefaults())
    except WorkerSpecError:
        return
    if w is not None:
        assert w.name == "n/p" and phase == "Running"


# ---- static ----


def test_static_source_upserts_all_and_drains_on_stop() -> None:
    reg = Registry()
    src = StaticSource(reg, parse_workers([W0, W1]))
    src.start()
    assert set(reg.active) == {"w0", "w1"}
    src.start()  # idempotent: nothing changed, nothing sent
    assert len(reg.calls) == 2
    src.stop()
    assert reg.active == {} and src.stats.drains == 2


def test_source_view_only_drains_its_own_workers() -> None:
    reg = Registry()
    reg.upsert(parse_worker({"name": "admin-added", "url": "http://h:1"}))
    view = SourceView(reg, DiscoveryStats("t"))
    view.replace_all(parse_workers([W0]))
    view.remove("admin-added")
    view.clear()
    assert set(reg.active) == {"admin-added"}


# ---- file ----


def test_file_source_follows_edits_with_real_files(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    write(path, [W0])
    reg = Registry()
    src = FileSource(reg, str(path))
    assert src.poll_once() is True
    assert set(reg.active) == {"w0"}
    assert src.poll_once() is False  # unchanged file is not re-read

    write(path, [W0, W1])  # edit in place (different size)
    assert src.poll_once() is True
    assert set(reg.active) == {"w0", "w1"} and reg.active["w1"].model == "m"

    # Same size, new content: caught by mtime.
    changed = dict(W1, model="n")
    write(path, [W0, changed])
    st0 = path.stat()
    os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns + 1_000_000))
    assert src.poll_once() is True
    assert reg.active["w1"].model == "n"

    # Atomic replace by rename, as editors and ConfigMap volumes do: removal drains.
    tmp = tmp_path / "new.yaml"
    write(tmp, [W1])
    os.replace(tmp, path)
    assert src.poll_once() is True
    assert set(reg.active) == {"w1"}
    assert ("drain", "w0") in reg.calls
    assert src.stats.errors == 0


def test_file_source_keeps_the_last_good_set_on_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"workers": [W0, W1]}))  # JSON is accepted too
    reg = Registry()
    src = FileSource(reg, str(path))
    src.poll_once()
    assert set(reg.active) == {"w0", "w1"}

    for bad in (
        "workers: [ {name: w0",  # broken YAML
        yaml.safe_dump({"workers": [W0, {"name": "x"}]}),  # invalid worker
        yaml.safe_dump({"workers": [W0], "extra": 1}),  # unknown key
        yaml.safe_dump({"workers": [W0, W0]}),  # duplicate
    ):
        errors = src.stats.errors
        path.write_text(bad)
        os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
        assert src.poll_once() is False
        assert src.stats.errors == errors + 1
        assert set(reg.active) == {"w0", "w1"}
        assert src.poll_once() is False  # reported once per version of the file
        assert src.stats.errors == errors + 1

    path.unlink()  # missing file: an error, not "no workers"
    assert src.poll_once() is False
    assert set(reg.active) == {"w0", "w1"}

    write(path, [])  # an explicitly empty list does drain
    assert src.poll_once() is True
    assert reg.active == {}


def test_file_source_bounds(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_bytes(b"#" * (MAX_FILE_BYTES + 1))
    reg = Registry()
    src = FileSource(reg, str(path), max_workers=2)
    assert src.poll_once() is False and src.stats.errors == 1

    write(path, [dict(W0, name=f"w{i}") for i in range(5)])
    assert src.poll_once() is True
    assert set(reg.active) == {"w0", "w1"} and src.stats.rejected == 3


def test_file_source_run_loop_picks_up_changes(tmp_path: Path) -> None:
    path = tmp_path / "workers.yaml"
    write(path, [W0])
    reg = Registry()

    async def scenario() -> None:
        cfg = parse_discovery_config({"file": {"path": str(path), "poll_seconds": 0.05}})
        handle = await start_discovery(cfg, reg)
        assert set(reg.active) == {"w0"}  # read before start_discovery returns
        write(path, [W1])
        for _ in range(200):
            if set(reg.active) == {"w1"}:
                break
            await asyncio.sleep(0.01)
        assert set(reg.active) == {"w1"}
        assert handle.stats()[0].source == "file"
        await handle.stop()
        assert set(reg.active) == {"w1"}  # stop without drain keeps the fleet

    asyncio.run(scenario())


# ---- config ----


def test_discovery_config_defaults_and_errors() -> None:
    cfg = parse_discovery_config({"kubernetes": {"namespace": "ml", "bridge_port": None}})
    assert cfg.file is None and cfg.kubernetes is not None
    assert cfg.kubernetes.selector == "kvroute.io/role=worker"
    assert cfg.kubernetes.bridge_port is None and cfg.kubernetes.engine_port == 8000
    assert parse_discovery_config(None) == parse_discovery_config({})
    for bad, msg in [
        ({"dns": {}}, "unknown keys"),
        ({"file": {}}, "path: required"),
        ({"file": {"path": "x", "poll_seconds": 0}}, "poll_seconds"),
        ({"kubernetes": {"engine_port": 70000}}, "engine_port"),
        ({"kubernetes": {"max_workers": 1.5}}, "max_workers"),
        ({"kubernetes": {"selector": ""}}, "selector"),
        ([], "mapping"),
    ]:
        with pytest.raises(DiscoveryConfigError, match=msg):
            parse_discovery_config(bad)
