"""The benchmark's own reference routers: a small OpenAI proxy with simple policies.

Not kvroute: these are yardsticks that run in the same kind of process (a Python HTTP
proxy on loopback) so the comparison with kvroute is fair on overhead.

Policies:

- ``round_robin``: next engine in turn.
- ``least_load``: fewest requests in flight through this proxy.
- ``session_hash``: session affinity, a consistent (rendezvous) hash of the conversation's id
  (the ``x-session-id`` header, else the body's ``user``) over the engines, so every turn of
  a conversation goes to one engine whatever its load; requests without either go round robin.
- ``prefix``: a naive approximate prefix router (what text-based routers do): it hashes the
  request text in 256-character chunks, remembers which engine it sent each chunk chain
  to (bounded LRU), and sends a request to the engine with the longest remembered match
  when that match covers at least ``--threshold`` of the text, else to the least loaded.
- ``oracle``: asks every engine how many prompt tokens it would reuse for this request right
  now (the simulated engine's probe endpoint, exact by construction), and adds what each
  engine is about to hold: the longest 16-token-block common prefix with the requests in
  flight on it (exact token ids from the engine's ``/tokenize``), so simultaneous requests
  that share a new prefix go together. It picks the largest, and treats as tied every engine
  whose reuse falls short of the largest by less than ``--tie-share`` of the prompt (default
  0.1): ties go to the fewest requests in flight. Without that margin a prefix every prompt
  shares (one system block) held by one busy engine, and by its requests in flight, outbids
  the idle engines for every request, and that one engine takes the whole trace.
  A yardstick for cache reuse, not a policy a deployment could run (one probe per engine per
  request).

``python -m bench.proxy --policy NAME --engines URL,URL --port P``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import xxhash
from aiohttp import web

log = logging.getLogger("bench.proxy")

POLICIES = ("round_robin", "least_load", "prefix", "oracle", "session_hash")
SESSION_HEADER = "x-session-id"
CHUNK_CHARS = 256
PROBE_PATH = "/sim/probe"


def request_text(body: dict[str, Any]) -> str:
    """The text a text-based router sees: the prompt, or the messages joined in order."""
    if isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    parts = []
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<{m.get('role', '')}>{content or ''}")
    return "".join(parts)


class PrefixTable:
    """Chunk-chain hash -> engine index, LRU-bounded to ``max_entries``."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._map: OrderedDict[int, int] = OrderedDict()

    @staticmethod
    def keys(text: str, namespace: str) -> list[int]:
        h = xxhash.xxh3_64_intdigest(namespace.encode())
        out = []
        for i in range(0, len(text) - len(text) % CHUNK_CHARS, CHUNK_CHARS):
            h = xxhash.xxh3_64_intdigest(text[i : i + CHUNK_CHARS].encode(), seed=h)
            out.append(h)
        return out

    def match(self, keys: Sequence[int], n_engines: int) -> list[int]:
        """Matched chunks per engine (longest prefix of ``keys`` each engine was sent)."""
        best = [0] * n_engines
        alive = set(range(n_engines))
        for depth, k in enumerate(keys, 1):
            e = self._map.get(k)
            if e is None:
                break
            self._map.move_to_end(k)
            if e in alive:
                best[e] = depth
        return best

    def record(self, keys: Sequence[int], engine: int) -> None:
        for k in keys:
            self._map[k] = engine
            self._map.move_to_end(k)
        while len(self._map) > self.max_entries:
            self._map.popitem(last=False)


BLOCK = 16


def block_keys(ids: Sequence[int], namespace: str) -> list[int]:
    """Chained hashes of the full 16-token blocks of ``ids`` under ``namespace``."""
    h = xxhash.xxh3_64_intdigest(namespace.encode())
    out = []
    for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
        chunk = b"".join(t.to_bytes(4, "little") for t in ids[i : i + BLOCK])
        h = xxhash.xxh3_64_intdigest(chunk, seed=h)
        out.append(h)
    return out


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def session_engine(key: str, n_engines: int) -> int:
    """Rendezvous hashing: the engine with the highest hash of (key, engine index). Removing an
    engine moves only its own sessions."""
    return max(range(n_engines), key=lambda i: xxhash.xxh3_64_intdigest(f"{i}/{key}".encode()))


def oracle_pick(
    scores: Sequence[int], inflight: Sequence[int], prompt_tokens: int, tie_share: float
) -> int:
    """The oracle's engine: among those whose score is within ``tie_share`` of the prompt of
    the best score, the one with the fewest requests in flight (then the lowest index)."""
    top = max(scores)
    margin = tie_share * prompt_tokens
    tied = [i for i, s in enumerate(scores) if top - s <= margin]
    return min(tied, key=lambda i: (inflight[i], i))


@dataclass
class ProxyState:
    engines: list[str]
    policy: str
    threshold: float
    http: aiohttp.ClientSession
    inflight: list[int]
    rr: itertools.count[int]
    table: PrefixTable
    pending: list[dict[int, list[int]]]  # per engine: request serial -> block keys in flight
    serial: itertools.count[int]
    probe_failures: int = 0
    tie_share: float = 0.1

    def least_loaded(self, among: Sequence[int] | None = None) -> int:
        cands = list(range(len(self.engines))) if among is None else list(among)
        return min(cands, key=lambda i: (self.inflight[i], i))

    async def probe(self, i: int, body: dict[str, Any]) -> int:
        try:
            async with self.http.post(self.engines[i] + PROBE_PATH, json=body) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"probe http {resp.status}")
                data = await resp.json()
                return int(data["cached_tokens"])
        except (aiohttp.ClientError, KeyError, ValueError, TimeoutError) as exc:
            self.probe_failures += 1
            if self.probe_failures in (1, 10, 100, 1000):
                log.warning(
                    "oracle probe to %s failed (%d so far): %s",
                    self.engines[i],
                    self.probe_failures,
                    exc,
                )
            return -1

    async def token_ids(self, body: dict[str, Any]) -> list[int]:
        keys = ("model", "messages") if "messages" in body else ("model", "prompt")
        req = {k: body[k] for k in keys if k in body}
        i = next(self.rr) % len(self.engines)
        try:
            async with self.http.post(self.engines[i] + "/tokenize", json=req) as resp:
                data = await resp.json()
                return [int(t) for t in data["tokens"]]
        except (aiohttp.ClientError, KeyError, ValueError, TypeError, TimeoutError):
            return []

    async def choose_oracle(self, body: dict[str, Any]) -> tuple[int, list[int]]:
        n = len(self.engines)
        # Tokenize once, then probe every engine with the ids: no engine renders the prompt.
        ids = await self.token_ids(body)
        probe: dict[str, Any] = {"model": body.get("model"), "prompt": ids, "max_tokens": 1}
        if body.get("cache_salt"):
            probe["cache_salt"] = body["cache_salt"]
        hits = await asyncio.gather(*(self.probe(i, probe) for i in range(n)))
        keys = block_keys(ids, str(body.get("cache_salt") or ""))
        cap = max(0, len(ids) - 1)
        scores = []
        for i in range(n):
            ahead = max((common_blocks(keys, p) for p in self.pending[i].values()), default=0)
            scores.append(max(hits[i], min(ahead * BLOCK, cap)))
        return oracle_pick(scores, self.inflight, len(ids), self.tie_share), keys

    async def choose(self, body: dict[str, Any], session: str | None = None) -> int:
        n = len(self.engines)
        if self.policy == "session_hash":
            key = session or (body.get("user") if isinstance(body.get("user"), str) else None)
            return session_engine(key, n) if key else next(self.rr) % n
        if self.policy == "round_robin":
            return next(self.rr) % n
        if self.policy == "least_load":
            return self.least_loaded()
        # prefix
        text = request_text(body)
        keys = self.table.keys(text, str(body.get("cache_salt") or ""))
        matched = self.table.match(keys, n)
        best = max(range(n), key=lambda i: (matched[i], -self.inflight[i]))
        total = max(1, len(text) // CHUNK_CHARS)
        chosen = best if matched[best] / total >= self.threshold else self.least_loaded()
        self.table.record(keys, chosen)
        return chosen


_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


async def _proxy(request: web.Request) -> web.StreamResponse:
    st: ProxyState = request.app["state"]
    raw = await request.read()
    try:
        body = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return web.json_response({"error": {"message": "invalid JSON", "code": 400}}, status=400)
    serial = next(st.serial)
    if request.method != "POST":
        i = next(st.rr) % len(st.engines)
    elif st.policy == "oracle":
        i, keys = await st.choose_oracle(body)
        st.pending[i][serial] = keys
    else:
        i = await st.choose(body, request.headers.get(SESSION_HEADER))
    st.inflight[i] += 1
    try:
        async with st.http.request(
            request.method,
            st.engines[i] + request.rel_url.path_qs,
            data=raw if raw else None,
            headers={"content-type": request.headers.get("content-type", "application/json")},
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for k, v in up.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    resp.headers[k] = v
            resp.headers["x-bench-worker"] = str(i)
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
    except aiohttp.ClientError as exc:
        return web.json_response({"error": {"message": str(exc), "code": 502}}, status=502)
    finally:
        st.inflight[i] -= 1
        st.pending[i].pop(serial, None)


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(
    engines: Sequence[str], policy: str, threshold: float = 0.3, tie_share: float = 0.1
) -> web.Application:
    """The proxy as an aiohttp app (the HTTP client is created on start-up)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    if not engines:
        raise ValueError("no engines")
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def on_startup(app: web.Application) -> None:
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=600),
        )
        app["state"] = ProxyState(
            engines=[e.rstrip("/") for e in engines],
            policy=policy,
            threshold=threshold,
            http=http,
            inflight=[0] * len(engines),
            rr=itertools.count(),
            table=PrefixTable(),
            pending=[{} for _ in engines],
            serial=itertools.count(),
            tie_share=tie_share,
        )

    async def on_cleanup(app: web.Application) -> None:
        await app["state"].http.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/{tail:.*}", _proxy)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__)
    p.add_argument("--policy", choices=POLICIES, required=True)
    p.add_argument("--engines", required=True, help="comma-separated engine base URLs")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threshold", type=float, default=0.3, help="prefix: min match ratio")
    p.add_argument(
        "--tie-share",
        type=float,
        default=0.1,
        help="oracle: reuse within this share of the prompt (0-1) of the best counts as a tie, "
        "broken by requests in flight",
    )
    args = p.parse_args(argv)
    if not 0 <= args.tie_share <= 1:
        p.error("--tie-share must be in [0, 1]")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = make_app(args.engines.split(","), args.policy, args.threshold, args.tie_share)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
