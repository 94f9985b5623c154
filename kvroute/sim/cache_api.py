"""The engine-to-cache protocol: what the simulated scheduler asks of a KV cache.

Two backends implement it: `kvroute.sim.cache.SimCache` (kvroute's reimplementation of vLLM's cache
decisions) and `kvroute.sim.vllm_backend.VllmCacheBackend` (vLLM's real `KVCacheManager`, only
inside the vLLM environment). The contract is this module's `CacheBackend`; this module has no
vLLM import so both environments can load it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvroute.sim.events import KvEvent

GroupKind = Literal["full_attention", "mla_attention", "sliding_window", "mamba"]
FULL_KINDS: frozenset[str] = frozenset({"full_attention", "mla_attention"})


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One KV cache group: its kind, block size and (sliding window only) window."""

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kind == "sliding_window" and (self.sliding_window or 0) <= 0:
            raise ValueError("a sliding_window group needs sliding_window > 0")
        if self.kind != "sliding_window" and self.sliding_window is not None:
            raise ValueError(f"sliding_window is only for sliding_window groups, not {self.kind}")


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """A model's KV cache layout and the engine settings that shape cache decisions."""

    groups: tuple[GroupSpec, ...]
    num_blocks: int
    max_model_len: int = 8192
    prefix_match_unit: int | None = None
    retention_interval: int | None = 0
    max_num_scheduled_tokens: int = 2048
    # vLLM's VllmConfig.max_in_flight_tokens (max_num_batched_tokens with one batch in
    # flight); None = max_model_len, which is what KVCacheManager assumes when not told.
    max_in_flight_tokens: int | None = None
    enable_caching: bool = True
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("at least one KV cache group is required")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (one is vLLM's null block)")
        for g in self.groups:
            if g.block_size % self.hash_block_size:
                raise ValueError(
                    f"group block size {g.block_size} is not a multiple of the hash unit "
                    f"{self.hash_block_size}"
                )
        interval = self.retention_interval
        has_sparse = any(g.kind in ("sliding_window", "mamba") for g in self.groups)
        if interval is not None and interval != 0:
            if not has_sparse:
                raise ValueError("retention_interval only applies to sliding-window/Mamba groups")
            if interval < 0 or interval % self.scheduler_block_size:
                raise ValueError(
                    f"retention_interval {interval} must be a non-negative multiple of the "
                    f"scheduler block size {self.scheduler_block_size}"
                )

    @property
    def scheduler_block_size(self) -> int:
        """vLLM's scheduler block size: the block size, or the LCM of all groups'."""
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        """The hash unit: the block size for one group, else prefix_match_unit or the GCD."""
        if len(self.groups) == 1:
            return self.groups[0].block_size
        if self.prefix_match_unit is not None:
            return self.prefix_match_unit
        return math.gcd(*(g.block_size for g in self.groups))

    @property
    def partial_hits(self) -> bool:
        """vLLM's enable_partial_hash_hits (fine-grained hits at the hash unit)."""
        if len(self.groups) == 1:
            return False
        unit = self.hash_block_size
        if not any(g.kind == "mamba" and g.block_size > unit for g in self.groups):
            return False
        # Sliding window cannot look up below its block size.
        return all(g.kind != "sliding_window" or g.block_size == unit for g in self.groups)

    @property
    def alignment(self) -> int:
        """Token granularity of hits: the hash unit with partial hits, else the scheduler block."""
        return self.hash_block_size if self.partial_hits else self.scheduler_block_size

    @property
    def mamba_block_size(self) -> int | None:
        sizes = [g.block_size for g in self.groups if g.kind == "mamba"]
        return sizes[0] if sizes else None


@dataclass(frozen=True, slots=True)
class CacheRequest:
    """A request's identity for the cache: tokens plus what goes into the block hashes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    lora_name: str | None = None
    lora_id: int | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    max_tokens: int = 16


@dataclass(frozen=True, slots=True)
class Lookup:
    """The result of a prefix lookup (vLLM's get_computed_blocks)."""

    hit_tokens: int
    shared_prefix_boundary: int = 0
    handle: object = None


class CacheBackend(Protocol):
    """What the scheduler needs from a KV cache (the contract both backends keep).

    Each method is named after, and behaves as, the vLLM scheduler step it stands for.
    """

    spec: CacheSpec

    def add_request(self, req: CacheRequest) -> None:
        """Create the request (its block hashes); nothing computed yet."""

    def lookup(self, request_id: str) -> Lookup:
        """vLLM's get_computed_blocks (and the shared-prefix boundary); takes no references."""

    def split_chunk(
        self, request_id: str, num_new_tokens: int, num_new_local_computed_tokens: int
    ) -> int:
        """The prefill chunk clipped where a Mamba state must be saved (0: not this step)."""

    def allocate(self, request_id: str, num_new_tokens: int, lookup: Lookup | None = None) -> bool:
        """vLLM's allocate_slots; `lookup` only on admission. False: not enough blocks."""

    def advance(self, request_id: str, num_tokens: int) -> None:
        """The scheduled tokens were computed."""

    def preempt(self, request_id: str) -> None:
        """Give back the request's blocks; it restarts from scratch (tokens kept)."""

    def begin_step(self) -> None:
        """A scheduling step starts."""

    def end_schedule(self) -> None:
        """The step's block copies ran: release what they pinned."""

    def append_token(self, request_id: str, token_id: int) -> None:
        """A token was sampled (extends the block hashes)."""

    def free(self, request_id: str) -> None:
        """The request finished or was aborted; its blocks stay cached."""

    def end_step(self) -> list[KvEvent]:
        """The step's KV events, in vLLM's order."""

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache (False if blocks are in use)."""

    def usage(self) -> float:
        """Fraction of the block pool in use."""

    def per_group_hits(self, request_id: str) -> list[int]:
        """Each group's own longest hit, ignoring the others."""

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The ids of the blocks the request holds, one list per group (vLLM's
        get_block_ids), as a KV connector names them to its peer."""


def missing_methods(cls: type) -> list[str]:
    """The `CacheBackend` methods `cls` lacks (a check for a backend loaded by name)."""
    wanted = [name for name, value in vars(CacheBackend).items() if callable(value)]
    return [
        name
        for name in wanted
        if not name.startswith("_") and not callable(getattr(cls, name, None))
    ]
