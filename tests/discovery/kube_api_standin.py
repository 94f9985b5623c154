"""A local stand-in for the Kubernetes API's pod list-and-watch protocol.

No cluster runs on this machine, so the Kubernetes discovery tests talk to this small but
real HTTP server on 127.0.0.1 (aiohttp, ephemeral port). It serves
GET /api/v1/namespaces/{ns}/pods the way the API server does for what the client uses:
- list: a PodList with metadata.resourceVersion, label selection (k=v, k!=v, k, comma
  separated), paging with limit/continue;
- watch=true: a chunked stream of newline-delimited JSON events (ADDED, MODIFIED,
  DELETED, BOOKMARK when allowWatchBookmarks=true) after the given resourceVersion,
  ending after timeoutSeconds; a resourceVersion older than the compaction point gets an
  ERROR event carrying a 410 "Expired" Status, like the real server.
Test controls: change pods, send bookmarks, compact history, cut every open stream
(abruptly or cleanly), inject raw lines. Every request is recorded for assertions.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def make_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    namespace: str = "ml",
    ready: bool = True,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod JSON as the API serves it (only the fields discovery reads, plus a few)."""
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": uid or f"uid-{name}",
        "labels": {"kvroute.io/role": "worker", **(labels or {})},
        "annotations": dict(annotations or {}),
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {}, "status": status}


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.strip().rstrip("=")) != v.strip():
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class _Watch:
    response: web.StreamResponse
    selector: str
    bookmarks: bool
    queue: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)


class KubeApiStandIn:
    """The server and its state. Use `async with KubeApiStandIn() as api: api.url ...`."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.rv = 100
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted_rv = 0  # watches from an older resourceVersion get 410
        self.requests: list[dict[str, str]] = []
        self.fail_lists = 0  # answer this many list requests with HTTP 500
        self.gone_as_http_status = False  # 410 as the HTTP status instead of an ERROR event
        self._watches: list[_Watch] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> KubeApiStandIn:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.end_streams()
        assert self._runner is not None
        await self._runner.cleanup()

    # ---- state changes (each gets the next resourceVersion, like etcd revisions) ----

    def _record(self, kind: str, pod: dict[str, Any]) -> None:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(key, None)
        else:
            self.pods[key] = pod
        self.history.append((self.rv, kind, pod))
        for w in self._watches:
            if _matches(pod["metadata"].get("labels", {}), w.selector):
                w.queue.put_nowait(self._line(kind, pod))

    def apply(self, pod: dict[str, Any]) -> None:
        """Create or update a pod (ADDED or MODIFIED)."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._record("MODIFIED" if key in self.pods else "ADDED", pod)

    def delete(self, name: str, namespace: str = "ml") -> None:
        self._record("DELETED", self.pods[(namespace, name)])

    def apply_silently(self, pod: dict[str, Any]) -> None:
        """Change state without telling open watches (as if it happened while the client
        was away and history got compacted)."""
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod

    def delete_silently(self, name: str, namespace: str = "ml") -> None:
        self.rv += 1
        self.pods.pop((namespace, name))

    def compact(self) -> None:
        """Forget history: any watch from a resourceVersion before now gets 410 Gone."""
        self.rv += 1
        self.compacted_rv = self.rv
        self.history.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current resourceVersion to watches that asked."""
        self.rv += 1
        obj = {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)}}
        for w in self._watches:
            if w.bookmarks:
                w.queue.put_nowait(self._line("BOOKMARK", obj))

    def send_raw(self, line: bytes) -> None:
        """Write raw bytes to every open watch (for malformed input)."""
        for w in self._watches:
            w.queue.put_nowait(line)

    def cut_streams(self) -> None:
        """Drop every open watch connection abruptly (no end of chunked body)."""
        for w in list(self._watches):
            transport = w.response._req.transport if w.response._req is not None else None
            if transport is not None:
                transport.abort()
            w.queue.put_nowait(None)

    def end_streams(self) -> None:
        """End every open watch cleanly, as the server does at timeoutSeconds."""
        for w in list(self._watches):
            w.queue.put_nowait(None)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def watch_requests(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") in ("true", "1")]

    def list_requests(self) -> list[dict[str, str]]:
        return [r for r in self.requests if r.get("watch") not in ("true", "1")]

    # ---- HTTP ----

    @staticmethod
    def _line(kind: str, obj: dict[str, Any]) -> bytes:
        return json.dumps({"type": kind, "object": obj}).encode() + b"\n"

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        q["namespace"] = request.match_info["ns"]
        self.requests.append(q)
        selector = q.get("labelSelector", "")
        if q.get("watch") in ("true", "1"):
            return await self._watch(request, q, selector)
        if self.fail_lists > 0:
            self.fail_lists -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        items = [
            p
            for (ns, _), p in sorted(self.pods.items())
            if ns == q["namespace"] and _matches(p["metadata"].get("labels", {}), selector)
        ]
        start = int(q.get("continue") or 0)
        limit = int(q.get("limit") or 0) or len(items) or 1
        page = items[start : start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.rv)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return web.json_response(
            {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page}
        )

    def _gone(self, since: int) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": f"too old resource version: {since} ({self.compacted_rv})",
            "reason": "Expired",
            "code": 410,
        }

    async def _watch(
        self, request: web.Request, q: dict[str, str], selector: str
    ) -> web.StreamResponse:
        since = int(q.get("resourceVersion") or self.rv)
        if since < self.compacted_rv and self.gone_as_http_status:
            return web.json_response(self._gone(since), status=410)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if since < self.compacted_rv:
            await response.write(self._line("ERROR", self._gone(since)))
            await response.write_eof()
            return response
        w = _Watch(response, selector, q.get("allowWatchBookmarks") in ("true", "1"))
        for rv, kind, pod in self.history:
            if rv > since and _matches(pod["metadata"].get("labels", {}), selector):
                w.queue.put_nowait(self._line(kind, pod))
        self._watches.append(w)
        deadline = asyncio.get_running_loop().time() + float(q.get("timeoutSeconds") or 3600)
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                try:
                    line = await asyncio.wait_for(w.queue.get(), min(left, 0.05))
                except TimeoutError:
                    # Like the API server, notice a client that went away.
                    if request.transport is None or request.transport.is_closing():
                        break
                    continue
                if line is None:
                    break
                await response.write(line)
            await response.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the stream was cut on purpose, or the client went away
        finally:
            self._watches.remove(w)
        return response
