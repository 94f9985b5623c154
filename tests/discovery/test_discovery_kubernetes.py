"""Kubernetes discovery against a local stand-in of the API's list-and-watch protocol.

No Kubernetes cluster runs on this machine, so these tests run the real client library
(`kubernetes.aio`) and the real discovery loop against `kube_api_standin.KubeApiStandIn`,
a small HTTP server on 127.0.0.1 that serves pod lists and chunked watch streams
(ADDED/MODIFIED/DELETED/BOOKMARK events, 410 Gone, timeouts and cut connections) the way
the API server does. The sink is a tiny real registry that records what it was told.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kube_api_standin import KubeApiStandIn, make_pod
from kubernetes.aio import client as kclient

from kvroute.router.fleet.discovery import (
    DiscoveryConfig,
    KubernetesConfig,
    KubernetesSource,
    PodDefaults,
    WorkerSpec,
    start_discovery,
)
from kvroute.router.fleet.discovery.kube_client import KubePodClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Registry:
    """A minimal DiscoverySink: the workers that are active, and the call log."""

    def __init__(self) -> None:
        self.active: dict[str, WorkerSpec] = {}
        self.calls: list[tuple[str, str]] = []

    def upsert(self, worker: WorkerSpec) -> None:
        self.active[worker.name] = worker
        self.calls.append(("upsert", worker.name))

    def drain(self, name: str) -> None:
        self.active.pop(name, None)
        self.calls.append(("drain", name))


async def until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def pod_client(api: KubeApiStandIn, *, watch_timeout: int = 60) -> KubePodClient:
    conf = kclient.Configuration(host=api.url)
    return KubePodClient(
        kclient.ApiClient(conf), "ml", "kvroute.io/role=worker", watch_timeout_seconds=watch_timeout
    )


@contextlib.asynccontextmanager
async def running(
    api: KubeApiStandIn, *, watch_timeout: int = 60, **kwargs: Any
) -> AsyncIterator[tuple[KubernetesSource, Registry]]:
    reg = Registry()
    source = KubernetesSource(
        reg, pod_client(api, watch_timeout=watch_timeout), backoff_initial=0.02, **kwargs
    )
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.synced.wait(), 10)
        yield source, reg
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await source.close_client()


async def test_initial_list_adds_only_ready_pods_with_their_addresses() -> None:
    async with KubeApiStandIn() as api:
        api.apply(
            make_pod(
                "a",
                "10.0.0.1",
                annotations={"kvroute.io/model": "org/model-7b", "kvroute.io/engine-port": "8001"},
            )
        )
        api.apply(make_pod("b", "10.0.0.2", annotations={"kvroute.io/bridge-port": "6000"}))
        api.apply(make_pod("starting", "10.0.0.3", ready=False))
        api.apply(make_pod("pending", None, phase="Pending", ready=False))
        api.apply(make_pod("leaving", "10.0.0.4", deleting=True))
        api.apply(make_pod("other", "10.0.0.5", labels={"kvroute.io/role": "router"}))
        async with running(api) as (source, reg):
            assert set(reg.active) == {"ml/a", "ml/b"}
            a, b = reg.active["ml/a"], reg.active["ml/b"]
            assert (a.url, a.bridge, a.model, a.instance) == (
                "http://10.0.0.1:8001",
                "10.0.0.1:50051",
                "org/model-7b",
                "uid-a",
            )
            assert (b.url, b.bridge, b.model) == ("http://10.0.0.2:8000", "10.0.0.2:6000", None)
            assert source.stats.relists == 1 and source.stats.workers == 2
            # The watch starts where the list ended, with bookmarks asked for.
            await until(lambda: len(api.watch_requests()) == 1)
            w = api.watch_requests()[0]
            assert w["resourceVersion"] == str(api.rv)  # nothing changed since the list
            assert w["allowWatchBookmarks"] == "true"
            assert w["labelSelector"] == "kvroute.io/role=worker"


async def test_watch_events_add_update_drain_and_readd() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        async with running(api) as (source, reg):
            await until(lambda: api.open_watches == 1)
            api.apply(make_pod("c", "10.0.0.3"))
            await until(lambda: "ml/c" in reg.active)

            # Not ready any more: drained. Status-only churn does not re-upsert.
            api.apply(make_pod("c", "10.0.0.3", ready=False))
            await until(lambda: "ml/c" not in reg.active)
            api.apply(make_pod("c", "10.0.0.3", ready=False))
            api.apply(make_pod("c", "10.0.0.3"))  # ready again
            await until(lambda: "ml/c" in reg.active)
            api.apply(make_pod("c", "10.0.0.3", labels={"extra": "x"}))  # no worker change
            api.apply(make_pod("c", "10.0.0.3", annotations={"kvroute.io/model": "m"}))
            await until(lambda: reg.active["ml/c"].model == "m")
            assert reg.calls.count(("upsert", "ml/c")) == 3
            assert reg.calls.count(("drain", "ml/c")) == 1

            # Recreated under the same name: new uid and IP, a new incarnation.
            api.apply(make_pod("c", "10.0.0.9", uid="uid-c2"))
            await until(lambda: reg.active["ml/c"].instance == "uid-c2")
            assert reg.active["ml/c"].url == "http://10.0.0.9:8000"

            api.delete("a")
            await until(lambda: "ml/a" not in reg.active)
            assert ("drain", "ml/a") in reg.calls
            assert source.stats.relists == 1 and source.stats.errors == 0


async def test_bookmark_moves_the_resume_point_after_a_cut_connection() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        async with running(api) as (source, reg):
            await until(lambda: api.open_watches == 1)
            api.bookmark()
            bookmark_rv = str(api.rv)
            await until(lambda: source.resource_version == bookmark_rv)

            api.cut_streams()
            await until(lambda: len(api.watch_requests()) == 2 and api.open_watches == 1)
            assert api.watch_requests()[1]["resourceVersion"] == bookmark_rv
            assert source.stats.relists == 1  # resumed, not re-listed
            assert source.stats.reconnects >= 1

            # Events after the resume point still arrive on the new stream.
            api.apply(make_pod("b", "10.0.0.2"))
            await until(lambda: "ml/b" in reg.active)


async def test_events_during_a_disconnect_are_replayed_from_the_resource_version() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        async with running(api) as (source, reg):
            await until(lambda: api.open_watches == 1)
            api.cut_streams()
            # Changes while no watch is open: the stand-in keeps history like etcd.
            api.delete("a")
            api.apply(make_pod("b", "10.0.0.2"))
            await until(lambda: set(reg.active) == {"ml/b"})
            assert source.stats.relists == 1


async def test_server_side_timeout_ends_the_stream_and_the_watch_resumes() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        async with running(api, watch_timeout=1) as (source, reg):
            await until(lambda: len(api.watch_requests()) >= 2, timeout=5)
            assert api.watch_requests()[0]["timeoutSeconds"] == "1"
            assert source.stats.reconnects >= 1 and source.stats.relists == 1
            api.apply(make_pod("b", "10.0.0.2"))
            await until(lambda: "ml/b" in reg.active)


@pytest.mark.parametrize("as_http_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_reconciles_what_was_missed(as_http_status: bool) -> None:
    async with KubeApiStandIn() as api:
        api.gone_as_http_status = as_http_status
        api.apply(make_pod("a", "10.0.0.1"))
        api.apply(make_pod("b", "10.0.0.2"))
        async with running(api) as (source, reg):
            await until(lambda: api.open_watches == 1)
            # While the router was cut off, history was compacted past its position:
            # a was deleted, b became unready, c appeared. No watch event tells it so.
            api.cut_streams()
            api.delete_silently("a")
            api.apply_silently(make_pod("b", "10.0.0.2", ready=False))
            api.apply_silently(make_pod("c", "10.0.0.3"))
            api.compact()
            await until(lambda: set(reg.active) == {"ml/c"})
            assert source.stats.gone == 1
            assert source.stats.relists == 2
            assert ("drain", "ml/a") in reg.calls and ("drain", "ml/b") in reg.calls
            # The new watch starts from the new list, not the stale position.
            await until(lambda: api.open_watches == 1)
            assert int(api.watch_requests()[-1]["resourceVersion"]) >= api.compacted_rv


async def test_malformed_watch_lines_are_counted_and_trigger_a_relist() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        async with running(api) as (source, reg):
            for bad in (
                b"this is not json\n",
                b'{"type": "ADDED"}\n',
                b'{"type":"ADDED","object":{}}\n',
            ):
                # Wait for the new watch (and for the server to drop the old one), so the
                # bad line goes to the stream the source is reading.
                want = source.stats.relists
                await until(lambda w=want: len(api.watch_requests()) == w and api.open_watches == 1)
                before = source.stats.relists
                api.send_raw(bad)
                await until(lambda b=before: source.stats.relists == b + 1)
            assert source.stats.errors == 3
            assert set(reg.active) == {"ml/a"}  # nothing lost, nothing invented


async def test_bad_annotations_skip_the_pod_and_drain_it_if_known() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        api.apply(make_pod("bad", "10.0.0.2", annotations={"kvroute.io/engine-port": "http"}))
        async with running(api) as (source, reg):
            assert set(reg.active) == {"ml/a"}
            assert source.stats.errors == 1
            await until(lambda: api.open_watches == 1)
            api.apply(make_pod("a", "10.0.0.1", annotations={"kvroute.io/bridge": "nope"}))
            await until(lambda: "ml/a" not in reg.active)
            assert source.stats.errors == 2
            api.apply(make_pod("a", "10.0.0.1", annotations={"kvroute.io/bridge-port": "none"}))
            await until(lambda: "ml/a" in reg.active)
            assert reg.active["ml/a"].bridge is None


async def test_api_errors_back_off_and_recover() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "10.0.0.1"))
        api.fail_lists = 3
        async with running(api) as (source, reg):
            assert set(reg.active) == {"ml/a"}
            assert source.stats.errors == 3
            assert len(api.list_requests()) == 4


async def test_max_workers_bounds_the_announced_set() -> None:
    async with KubeApiStandIn() as api:
        for i in range(5):
            api.apply(make_pod(f"p{i}", f"10.0.1.{i}"))
        async with running(api, max_workers=3) as (source, reg):
            assert len(reg.active) == 3
            assert source.stats.rejected == 2
            await until(lambda: api.open_watches == 1)
            api.apply(make_pod("late", "10.0.2.1"))
            api.apply(make_pod("p0", "10.0.1.0", ready=False))
            api.apply(make_pod("later", "10.0.2.2"))
            await until(lambda: source.stats.rejected == 3 and "ml/later" in reg.active)
            assert len(reg.active) == 3 and "ml/late" not in reg.active


async def test_paged_list_is_read_to_the_end() -> None:
    async with KubeApiStandIn() as api:
        for i in range(1203):
            api.apply(make_pod(f"p{i:04d}", f"10.{i // 250}.{i % 250}.1"))
        async with running(api) as (_source, reg):
            assert len(reg.active) == 1203
            assert len(api.list_requests()) == 3  # pages of 500


async def test_start_discovery_runs_the_kubernetes_source_and_stops() -> None:
    async with KubeApiStandIn() as api:
        api.apply(make_pod("a", "fd00::5", annotations={"kvroute.io/dp-rank": "2"}))
        reg = Registry()
        cfg = DiscoveryConfig(kubernetes=KubernetesConfig(namespace="ml", bridge_port=7000))
        handle = await start_discovery(cfg, reg, kube_client=pod_client(api))
        await handle.kubernetes[0].synced.wait()
        w = reg.active["ml/a"]
        assert (w.url, w.bridge, w.dp_rank) == ("http://[fd00::5]:8000", "[fd00::5]:7000", 2)
        assert handle.stats()[0].workers == 1
        await handle.stop(drain=True)
        assert reg.active == {}


def test_pod_defaults_are_used_when_the_pod_says_nothing() -> None:
    from kvroute.router.fleet.discovery import worker_from_pod

    spec = worker_from_pod(make_pod("x", "10.1.1.1"), PodDefaults(engine_port=9, bridge_port=None))
    assert spec is not None and spec.url == "http://10.1.1.1:9" and spec.bridge is None


async def test_unreachable_api_server_is_retried_without_crashing() -> None:
    async with KubeApiStandIn() as api:
        url = api.url
    # The stand-in is gone: connections to its port are refused.
    reg = Registry()
    client = KubePodClient(kclient.ApiClient(kclient.Configuration(host=url)), "ml", "x=y")
    source = KubernetesSource(reg, client, backoff_initial=0.01, backoff_max=0.05)
    task = asyncio.create_task(source.run())
    await until(lambda: source.stats.errors >= 3)
    assert not task.done() and not source.synced.is_set() and reg.calls == []
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await source.close_client()


def test_pod_pd_role_comes_from_its_annotation_or_label() -> None:
    from kvroute.router.fleet.discovery import WorkerSpecError, worker_from_pod

    defaults = PodDefaults()
    plain = worker_from_pod(make_pod("x", "10.1.1.1"), defaults)
    assert plain is not None and plain.role == "both"
    by_label = make_pod(
        "p", "10.1.1.2", labels={"kvroute.io/pd-role": "prefill", "kvroute.io/model": "m"}
    )
    spec = worker_from_pod(by_label, defaults)
    assert spec is not None and (spec.role, spec.model) == ("prefill", "m")
    by_note = make_pod(
        "d", "10.1.1.3", annotations={"kvroute.io/pd-role": "decode", "kvroute.io/model": "m"}
    )
    spec = worker_from_pod(by_note, defaults)
    assert spec is not None and spec.role == "decode"
    with pytest.raises(WorkerSpecError, match="role"):
        worker_from_pod(make_pod("b", "10.1.1.4", labels={"kvroute.io/pd-role": "x"}), defaults)
