"""A loopback stand-in for the parts of the Kubernetes API that `helm install` uses.

No cluster runs on this machine and the Helm library we can install (the Go Helm v4
library inside the PyPI package helm-sdkpy) has no client-only dry run, so the chart
tests install into this small HTTP server on 127.0.0.1 instead: version and discovery
documents for the resource kinds the chart uses, an empty store that answers GET with 404
and records every created object (POST/PUT/PATCH bodies, exactly what Helm would send to
a cluster). It validates nothing itself; the tests validate the recorded objects.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import yaml
from aiohttp import web

# group/version -> [(plural, kind, namespaced)]
RESOURCES: dict[str, list[tuple[str, str, bool]]] = {
    "v1": [
        ("pods", "Pod", True),
        ("services", "Service", True),
        ("configmaps", "ConfigMap", True),
        ("secrets", "Secret", True),
        ("serviceaccounts", "ServiceAccount", True),
        ("namespaces", "Namespace", False),
    ],
    "apps/v1": [("deployments", "Deployment", True), ("statefulsets", "StatefulSet", True)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "autoscaling/v2": [("horizontalpodautoscalers", "HorizontalPodAutoscaler", True)],
    "rbac.authorization.k8s.io/v1": [
        ("roles", "Role", True),
        ("rolebindings", "RoleBinding", True),
        ("clusterroles", "ClusterRole", False),
        ("clusterrolebindings", "ClusterRoleBinding", False),
    ],
    "monitoring.coreos.com/v1": [
        ("servicemonitors", "ServiceMonitor", True),
        ("podmonitors", "PodMonitor", True),
    ],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def _resource_list(gv: str) -> dict[str, Any]:
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": [
            {"name": plural, "singularName": "", "namespaced": ns, "kind": kind, "verbs": VERBS}
            for plural, kind, ns in RESOURCES[gv]
        ],
    }


def _group_list() -> dict[str, Any]:
    groups = []
    for gv in RESOURCES:
        if "/" not in gv:
            continue
        group, version = gv.split("/")
        entry = {"groupVersion": gv, "version": version}
        groups.append({"name": group, "versions": [entry], "preferredVersion": entry})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


class KubeApplyStandIn:
    """Runs on its own thread and loop (the Helm library blocks the calling thread)."""

    def __init__(self, kube_version: tuple[int, int] = (1, 33)) -> None:
        self.kube_version = kube_version
        self.created: list[dict[str, Any]] = []
        self.helm_records = 0
        self.requests: list[tuple[str, str]] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def kubeconfig(self, namespace: str) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
                "users": [{"name": "u", "user": {"token": "standin"}}],
                "contexts": [
                    {
                        "name": "standin",
                        "context": {"cluster": "standin", "user": "u", "namespace": namespace},
                    }
                ],
                "current-context": "standin",
            }
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> KubeApplyStandIn:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stand-in API server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _serve(self, ready: threading.Event) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            ready.set()
            await self._stop.wait()
            await runner.cleanup()

        asyncio.run(main())

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path.rstrip("/")
        self.requests.append((request.method, request.path_qs))
        if path == "/version":
            major, minor = self.kube_version
            return web.json_response(
                {
                    "major": str(major),
                    "minor": str(minor),
                    "gitVersion": f"v{major}.{minor}.0",
                    "platform": "linux/amd64",
                }
            )
        if path == "/api":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"]})
        if path == "/apis":
            return web.json_response(_group_list())
        if path == "/api/v1":
            return web.json_response(_resource_list("v1"))
        parts = path.strip("/").split("/")
        if parts[0] == "apis" and len(parts) == 3 and f"{parts[1]}/{parts[2]}" in RESOURCES:
            return web.json_response(_resource_list(f"{parts[1]}/{parts[2]}"))
        if request.method in ("POST", "PUT", "PATCH"):
            body = await request.read()
            ctype = request.headers.get("Content-Type", "")
            if "protobuf" in ctype:
                # Helm's release record (a Secret) goes out as protobuf; it is Helm's own
                # bookkeeping, not a chart object: acknowledge it without decoding.
                self.helm_records += 1
                return web.json_response(
                    {"kind": "Secret", "apiVersion": "v1", "metadata": {"name": "release"}},
                    status=201 if request.method == "POST" else 200,
                )
            obj = yaml.safe_load(body) if "yaml" in ctype else json.loads(body)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(len(self.created) + 1)
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            self.created.append(obj)
            return web.json_response(obj, status=201 if request.method == "POST" else 200)
        if request.method == "GET" and _is_collection(parts):
            return web.json_response(
                {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": []}
            )
        return web.json_response(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "status": "Failure",
                "reason": "NotFound",
                "message": f"{path} not found",
                "code": 404,
            },
            status=404,
        )


def _is_collection(parts: list[str]) -> bool:
    # /api/v1/namespaces/NS/PLURAL or /apis/G/V/namespaces/NS/PLURAL (no name after it)
    base = 2 if parts[0] == "api" else 3
    rest = parts[base:]
    return (len(rest) == 3 and rest[0] == "namespaces") or len(rest) == 1
