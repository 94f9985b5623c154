"""Engine endpoints: fixed DP ranks (port offsets) or vLLM's `GET /kv_event_sources` (0.28+)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvroute.bridge.follower import EngineEndpoints

_WILDCARD_HOST = re.compile(r"^(tcp://)(\*|0\.0\.0\.0|\[::\]|::)(:\d+)$")


def offset_port(endpoint: str, dp_rank: int) -> str:
    """The endpoint of DP rank `dp_rank` as vLLM derives it: tcp port + rank (0 unchanged)."""
    if dp_rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return endpoint
    return f"{base}:{int(port) + dp_rank}"


def ranked_endpoints(
    events: str, replay: str | None, topic: str, dp_ranks: int
) -> list[EngineEndpoints]:
    """Endpoints of ranks 0..dp_ranks-1 of one engine (vLLM's port-offset rule, spec §1.7)."""
    return [
        EngineEndpoints(
            dp_rank=rank,
            events=offset_port(events, rank),
            replay=offset_port(replay, rank) if replay else None,
            topic=topic,
        )
        for rank in range(dp_ranks)
    ]


def substitute_host(endpoint: str, host: str) -> str:
    """`tcp://*:5557` (or 0.0.0.0 / ::) -> `tcp://HOST:5557`; other endpoints unchanged."""
    match = _WILDCARD_HOST.match(endpoint)
    if not match:
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{match.group(1)}{host}{match.group(3)}"


def parse_sources(payload: Any, host: str) -> list[EngineEndpoints]:
    """Endpoints from a `/kv_event_sources` JSON body: {"<rank>": KVEventsConfig, ...}.

    Raises ValueError on a body that is not such a mapping.
    """
    if not isinstance(payload, dict):
        raise ValueError("kv_event_sources: expected a JSON object of rank -> config")
    result = []
    for key, config in payload.items():
        if not str(key).isdigit() or not isinstance(config, dict):
            raise ValueError(f"kv_event_sources: bad entry {key!r}")
        endpoint = config.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            raise ValueError(f"kv_event_sources: rank {key} has no endpoint")
        replay = config.get("replay_endpoint")
        topic = config.get("topic") or ""
        result.append(
            EngineEndpoints(
                dp_rank=int(key),
                events=substitute_host(endpoint, host),
                replay=substitute_host(replay, host)
                if isinstance(replay, str) and replay
                else None,
                topic=str(topic),
            )
        )
    return sorted(result, key=lambda e: e.dp_rank)


async def discover(url: str, *, timeout: float = 5.0) -> list[EngineEndpoints]:
    """GET `url` (the engine's base URL or its /kv_event_sources) and parse the sources."""
    if not url.rstrip("/").endswith("/kv_event_sources"):
        url = url.rstrip("/") + "/kv_event_sources"
    host = urlsplit(url).hostname or "127.0.0.1"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
        session.get(url) as response,
    ):
        response.raise_for_status()
        body = await response.json(content_type=None)
    return parse_sources(body, host)
