"""Pod list and watch through the official Kubernetes Python client (`kubernetes.aio`).

The only module that touches the client library. It hands out pods as plain JSON mappings
(the discovery logic parses them itself, see pods.py) and turns the library's ways of
failing into three outcomes: `Gone` (410: resourceVersion too old, re-list), `ApiError`
(anything else the API or the connection did wrong: back off and resume), or a normal end
of the stream (server-side timeout: resume from the last resourceVersion).

Why `kubernetes.aio` (in `kubernetes==37.0.2`) and not the threaded client or
`kubernetes_asyncio`: the router is asyncio, this client is async on aiohttp (already a
dependency, same version), and it ships in the official package, so one pin covers auth
(in-cluster service account, kubeconfig) and the API calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes.aio import client as kclient
from kubernetes.aio import watch as kwatch

LIST_PAGE = 500


class Gone(Exception):
    """The resourceVersion is too old for the API server (HTTP 410): list again."""


class ApiError(Exception):
    """The API server or the connection failed; retry with back-off."""


@dataclass(frozen=True, slots=True)
class PodList:
    """A consistent list of pods and the resourceVersion to watch from."""

    items: list[Mapping[str, object]]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event; `type` is ADDED, MODIFIED, DELETED or BOOKMARK."""

    type: str
    object: Mapping[str, object]


class MalformedEvent(ApiError):
    """A watch line that is not a well-formed event: the stream can no longer be trusted."""


def _status_error(status: int, body: bytes | str) -> Exception:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if status == 410:
        return Gone(text[:200])
    return ApiError(f"HTTP {status}: {text[:200]}")


class KubePodClient:
    """Lists and watches pods of one namespace matching a label selector."""

    def __init__(
        self,
        api_client: kclient.ApiClient,
        namespace: str,
        label_selector: str,
        *,
        watch_timeout_seconds: int = 300,
    ) -> None:
        self._api_client = api_client
        self._api = kclient.CoreV1Api(api_client)
        self.namespace = namespace
        self.label_selector = label_selector
        self.watch_timeout_seconds = watch_timeout_seconds

    async def list_pods(self) -> PodList:
        """All matching pods, paged; raises Gone or ApiError."""
        items: list[Mapping[str, object]] = []
        cont: str | None = None
        version = ""
        while True:
            doc = await self._get_json(cont)
            meta = doc.get("metadata")
            page = doc.get("items")
            if not isinstance(meta, Mapping) or not isinstance(page, list):
                raise ApiError("pod list without metadata/items")
            items.extend(p for p in page if isinstance(p, Mapping))
            rv = meta.get("resourceVersion")
            if isinstance(rv, str) and rv:
                version = rv
            nxt = meta.get("continue")
            if not isinstance(nxt, str) or not nxt:
                break
            cont = nxt
        if not version:
            raise ApiError("pod list without metadata.resourceVersion")
        return PodList(items, version)

    async def _get_json(self, cont: str | None) -> Mapping[str, object]:
        try:
            resp = await self._api.list_namespaced_pod_without_preload_content(
                self.namespace,
                label_selector=self.label_selector,
                limit=LIST_PAGE,
                _continue=cont,
                _request_timeout=60.0,
            )
            try:
                body = await resp.read()
            finally:
                resp.release()
        except (aiohttp.ClientError, TimeoutError, OSError) as err:
            raise ApiError(f"list failed: {err!r}") from None
        if resp.status != 200:
            raise _status_error(resp.status, body)
        try:
            doc = json.loads(body)
        except ValueError as err:
            raise ApiError(f"pod list is not JSON: {err}") from None
        if not isinstance(doc, dict):
            raise ApiError("pod list is not a JSON object")
        return doc

    async def watch_pods(self, resource_version: str) -> AsyncGenerator[WatchEvent, None]:
        """Events after `resource_version` until the server ends the stream. BOOKMARKs are
        yielded too (their object carries only metadata.resourceVersion)."""
        # return_type="object": keep events as JSON; pods.py parses them, and a pod the
        # generated models would reject must not stop the watch.
        watcher: Any = kwatch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        stream = watcher.stream(
            self._api.list_namespaced_pod,
            self.namespace,
            label_selector=self.label_selector,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            # A server-side timeout makes the library end the stream instead of silently
            # reconnecting (and retrying a 410 with the same stale resourceVersion); the
            # client-side one catches a connection that died without a FIN.
            timeout_seconds=self.watch_timeout_seconds,
            _request_timeout=float(self.watch_timeout_seconds + 30),
        )
        try:
            while True:
                try:
                    raw = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except kclient.ApiException as err:
                    if err.status == 410:
                        raise Gone(str(err.reason)) from None
                    raise ApiError(f"watch failed: HTTP {err.status} {err.reason}") from None
                except (aiohttp.ClientError, TimeoutError, OSError) as err:
                    raise ApiError(f"watch stream broke: {err!r}") from None
                except Exception as err:  # the library raises bare Exception on bad JSON
                    raise MalformedEvent(f"malformed watch event: {err}") from None
                yield _event(raw)
        finally:
            await watcher.close()

    async def close(self) -> None:
        """Close the HTTP session."""
        await self._api_client.close()  # type: ignore[no-untyped-call]


def _event(raw: object) -> WatchEvent:
    # The library returns a non-JSON line as a bare string.
    if not isinstance(raw, Mapping):
        raise MalformedEvent(f"watch line is not a JSON event: {str(raw)[:200]!r}")
    kind, obj = raw.get("type"), raw.get("raw_object")
    if not isinstance(kind, str) or not isinstance(obj, Mapping):
        raise MalformedEvent("watch event without type/object")
    return WatchEvent(kind, obj)
