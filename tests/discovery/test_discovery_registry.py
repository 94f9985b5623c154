"""Discovery feeding the router's real worker registry
(kvroute.router.fleet.workers.WorkerRegistry).

The registry belongs to the router branch; until that branch is merged next to this one,
there is nothing to integrate with and this module is skipped (it runs after the merge).
The Kubernetes API is the loopback stand-in (no cluster runs here).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import yaml

workers = pytest.importorskip("kvroute.router.fleet.workers", reason="router branch not merged yet")
config = pytest.importorskip("kvroute.router.config")

from kube_api_standin import KubeApiStandIn, make_pod  # noqa: E402
from kubernetes.aio import client as kclient  # noqa: E402

from kvroute.router.fleet.discovery import FileSource, KubernetesSource  # noqa: E402
from kvroute.router.fleet.discovery.kube_client import KubePodClient  # noqa: E402

pytestmark = [pytest.mark.timeout(60)]


def registry() -> object:
    return workers.WorkerRegistry(config.BreakerConfig())


def test_file_source_drives_the_registry(tmp_path: Path) -> None:
    reg = registry()
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"name": "a", "url": "http://127.0.0.1:1"}]}))
    src = FileSource(reg, str(path))  # type: ignore[arg-type]
    src.poll_once()
    a = reg.get("a")  # type: ignore[attr-defined]
    assert a is not None and a.spec.url == "http://127.0.0.1:1" and a.state == workers.ACTIVE
    path.write_text(yaml.safe_dump({"workers": []}))
    src.poll_once()
    # Drained with nothing in flight: removed.
    assert reg.get("a") is None  # type: ignore[attr-defined]


def test_kubernetes_source_drives_the_registry() -> None:
    async def scenario() -> None:
        reg = registry()
        async with KubeApiStandIn() as api:
            api.apply(make_pod("a", "10.0.0.1", annotations={"kvroute.io/model": "m"}))
            client = KubePodClient(
                kclient.ApiClient(kclient.Configuration(host=api.url)),
                "ml",
                "kvroute.io/role=worker",
            )
            source = KubernetesSource(reg, client)  # type: ignore[arg-type]
            task = asyncio.create_task(source.run())
            await asyncio.wait_for(source.synced.wait(), 10)
            w = reg.get("ml/a")  # type: ignore[attr-defined]
            assert w is not None and w.spec.bridge == "10.0.0.1:50051" and w.spec.model == "m"
            api.apply(make_pod("a", "10.0.0.9", uid="new"))  # recreated: a fresh engine
            for _ in range(500):
                w2 = reg.get("ml/a")  # type: ignore[attr-defined]
                if w2 is not None and w2.spec.instance == "new":
                    break
                await asyncio.sleep(0.01)
            assert w2 is not None and w2 is not w and w2.spec.url == "http://10.0.0.9:8000"
            api.delete("a")
            for _ in range(500):
                if reg.get("ml/a") is None:  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.01)
            assert reg.get("ml/a") is None  # type: ignore[attr-defined]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await source.close_client()

    asyncio.run(scenario())
