"""Prefill/decode disaggregation in the simulated engine, in the shapes of vLLM's NIXL
connector (pull mode, vLLM 0.33).

A producer (`kv_producer`, or `kv_both` asked with `do_remote_decode`) runs the prompt, keeps
its blocks after the request ends, and answers with `kv_transfer_params` naming itself and
those blocks. A consumer (`kv_consumer`, or `kv_both` asked with `do_remote_prefill`) looks up
its own prefix cache, "pulls" the blocks it lacks from the producer at the modelled link
bandwidth, and then only computes the prompt's last token. The producer frees the blocks when
the consumer's pull reaches it (`POST /sim/kv/pull` on the producer's HTTP port, which stands
for vLLM's side channel) or when its lease runs out, whichever is first.

A model with Mamba layers is split one token earlier, as vLLM 0.33's connector does
(`_prefill_backoff`): the producer runs all of the prompt but its last token and hands over
the state after that, the consumer loads those tokens and computes the last one itself (the
state after the whole prompt cannot produce the state after all but its last token, which
the decode's first step needs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# One 400 Gb/s RDMA NIC per GPU (the ConnectX-7 class H100 servers carry), bytes per second.
DEFAULT_LINK_BYTES_PER_S = 400e9 / 8
# vLLM's kv_lease_duration default: how long a producer keeps blocks nobody pulled, seconds.
DEFAULT_LEASE_S = 30.0
# What a consumer needs to pull (vLLM's update_state_after_alloc checks the same keys).
REQUIRED_REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
PULL_PATH = "/sim/kv/pull"


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """An engine's part in disaggregation and the link it pulls over."""

    role: str  # one of KV_ROLES
    link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")
        if self.link_bytes_per_s <= 0 or self.lease_s <= 0:
            raise ValueError("kv link bandwidth and lease must be > 0")

    def produces(self, params: Mapping[str, Any] | None) -> bool:
        """Whether a request with these params is a prefill whose blocks are kept for a peer."""
        return (
            params is not None
            and self.role in ("kv_producer", "kv_both")
            and bool(params.get("do_remote_decode"))
        )

    def consumes(self, params: Mapping[str, Any] | None) -> bool:
        """Whether a request with these params pulls its prompt's KV from a peer."""
        return (
            params is not None
            and self.role in ("kv_consumer", "kv_both")
            and bool(params.get("do_remote_prefill"))
        )


@dataclass(slots=True)
class Lease:
    """Blocks a producer keeps for a consumer to pull."""

    request_id: str
    block_ids: list[list[int]]
    num_tokens: int
    expires: float


@dataclass(slots=True)
class Pulled:
    """What a consumer's pull brought: prompt tokens now held, blocks moved, time taken."""

    external_tokens: int
    blocks: int
    seconds: float
    outcome: str  # ok, local_hit, invalid, gone, unreachable


@dataclass(slots=True)
class TransferStats:
    """Counters shown in /sim/state."""

    leases_granted: int = 0
    leases_pulled: int = 0
    leases_expired: int = 0
    pulls: dict[str, int] = field(default_factory=dict)  # outcome -> count
    blocks_pulled: int = 0
    pull_seconds: float = 0.0


class KvTransfer:
    """One engine's connector: its leases as a producer, its pulls as a consumer."""

    def __init__(
        self,
        config: TransferConfig,
        *,
        engine_id: str,
        block_size: int,
        kv_bytes_per_token: float,
        speed: float,
        max_leases: int,
        has_mamba: bool = False,
    ) -> None:
        self.config = config
        # trailing prompt tokens a producer leaves to the consumer (see the module doc)
        self.backoff = 1 if has_mamba else 0
        self.engine_id = engine_id
        self.block_size = block_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.speed = speed
        self.max_leases = max_leases
        self.side_channel: tuple[str, int] = ("127.0.0.1", 0)  # set once the server listens
        self.leases: dict[str, Lease] = {}
        self.to_release: list[str] = []  # freed by the engine at its next step boundary
        self.stats = TransferStats()
        self._ratelog = RateLimitedLog(log, interval_s=10.0)

    # ---- producer -------------------------------------------------------------------------
    def prefill_tokens(self, prompt_len: int) -> int:
        """How many of a prefill half's `prompt_len` prompt tokens the producer runs: all but
        the backoff (see the module doc), or all of a prompt no longer than the backoff."""
        return prompt_len - self.backoff if prompt_len > self.backoff else prompt_len

    def hold(self, request_id: str, block_ids: list[list[int]], num_tokens: int) -> bool:
        """Keep a finished prefill's blocks for a consumer; False (free them now) when the
        lease table is full."""
        if len(self.leases) >= self.max_leases:
            self._ratelog.warning(
                "leases_full", "kv lease table full (%d): blocks freed at once", self.max_leases
            )
            return False
        expires = time.monotonic() + self.config.lease_s
        self.leases[request_id] = Lease(request_id, block_ids, num_tokens, expires)
        self.stats.leases_granted += 1
        return True

    def params_for(self, lease: Lease, cached_tokens: int) -> dict[str, Any]:
        """The producer's answer: vLLM's request_finished dict (pull mode, one rank), plus the
        prefill's own cache hit that vLLM's scheduler adds for the consumer to report."""
        host, port = self.side_channel
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": lease.block_ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": lease.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": lease.num_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": cached_tokens,
        }

    def take(self, request_id: str, engine_id: str) -> Lease | None:
        """A consumer pulled these blocks: end the lease (the engine frees them at its next step
        boundary); None if there is no such lease (never granted, or expired)."""
        if engine_id != self.engine_id:
            return None
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return None
        self.to_release.append(request_id)
        self.stats.leases_pulled += 1
        return lease

    def expire(self, now: float) -> None:
        """End the leases whose time is up (their blocks are freed with the pulled ones)."""
        for rid in [rid for rid, lease in self.leases.items() if lease.expires <= now]:
            del self.leases[rid]
            self.to_release.append(rid)
            self.stats.leases_expired += 1

    def drop_all(self) -> None:
        """The engine restarted: every lease is gone with its cache."""
        self.leases.clear()
        self.to_release.clear()

    # ---- consumer -------------------------------------------------------------------------
    async def pull(self, params: Mapping[str, Any], prompt_len: int, local_hit: int) -> Pulled:
        """Fetch the prompt's blocks beyond `local_hit` from the producer the params name,
        taking the modelled transfer time; a producer that no longer holds them (or cannot be
        reached) leaves the consumer to compute the prompt itself (vLLM's recompute policy)."""
        if not all(key in params for key in REQUIRED_REMOTE_KEYS) or not params.get(
            "remote_block_ids"
        ):
            self._ratelog.warning(
                "invalid_params",
                "invalid kv_transfer_params %s: computing the prompt locally",
                sorted(params),
            )
            return self._count(Pulled(0, 0, 0.0, "invalid"))
        remote_tokens = params.get("remote_num_tokens")
        target = prompt_len
        if isinstance(remote_tokens, int) and not isinstance(remote_tokens, bool):
            target = min(prompt_len, remote_tokens)
        missing = max(0, target - local_hit)
        blocks = -(-target // self.block_size) - local_hit // self.block_size if missing else 0
        seconds = blocks * self.block_size * self.kv_bytes_per_token / self.config.link_bytes_per_s
        seconds /= self.speed
        if seconds > 0:
            await asyncio.sleep(seconds)
        # the read ends with a notification that frees the producer's blocks (also on a
        # full local hit, so the producer does not wait for its lease to run out)
        outcome = await self._notify(params, blocks)
        if outcome != "ok":
            return self._count(Pulled(0, 0, seconds, outcome))
        if not missing:
            return self._count(Pulled(0, 0, 0.0, "local_hit"))
        return self._count(Pulled(missing, blocks, seconds, "ok"))

    async def _notify(self, params: Mapping[str, Any], blocks: int) -> str:
        url = f"http://{params['remote_host']}:{params['remote_port']}{PULL_PATH}"
        body = {
            "remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
            "blocks": blocks,
        }
        try:
            timeout = aiohttp.ClientTimeout(total=5.0)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=body) as resp,
            ):
                if resp.status == 200:
                    return "ok"
                return "gone"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self._ratelog.warning("unreachable", "kv pull from %s failed: %r", url, exc)
            return "unreachable"

    def _count(self, pulled: Pulled) -> Pulled:
        stats = self.stats
        stats.pulls[pulled.outcome] = stats.pulls.get(pulled.outcome, 0) + 1
        stats.blocks_pulled += pulled.blocks
        stats.pull_seconds += pulled.seconds
        return pulled

    def state(self) -> dict[str, Any]:
        """What /sim/state shows of the connector."""
        s = self.stats
        return {
            "role": self.config.role,
            "engine_id": self.engine_id,
            "link_bytes_per_s": self.config.link_bytes_per_s,
            "lease_s": self.config.lease_s,
            "leases_held": len(self.leases),
            "leases_granted": s.leases_granted,
            "leases_pulled": s.leases_pulled,
            "leases_expired": s.leases_expired,
            "pulls": dict(s.pulls),
            "blocks_pulled": s.blocks_pulled,
            "pull_seconds": s.pull_seconds,
        }
