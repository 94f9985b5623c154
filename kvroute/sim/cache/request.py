"""A request as the cache sees it: all tokens, chained hashes, computed-token count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvroute.sim.cache.hashing import Digest, chunk_hash, hash_extra_keys
from kvroute.sim.cache_api import CacheRequest


@dataclass(slots=True)
class CacheSeq:
    """One request's cache-side state (vLLM's Request, reduced to what the cache reads)."""

    req: CacheRequest
    hash_unit: int
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[Digest] = field(default_factory=list)
    num_computed_tokens: int = 0
    shared_prefix_boundary: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.req.prompt_token_ids)
        self._extend_hashes()

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids)

    def extra_keys(self, start: int) -> tuple[Any, ...] | None:
        """Tagged extra keys of the block (or chunk) starting at token `start`."""
        return hash_extra_keys(start, self.req.lora_name, self.req.lora_path, self.req.cache_salt)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        unit = self.hash_unit
        start = len(self.block_hashes) * unit
        while start + unit <= len(self.all_token_ids):
            parent = self.block_hashes[-1] if self.block_hashes else None
            chunk = self.all_token_ids[start : start + unit]
            self.block_hashes.append(chunk_hash(parent, chunk, self.extra_keys(start)))
            start += unit
