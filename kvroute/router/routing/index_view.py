"""What the router asks of the KV index, in the router's own terms.

`policy`, `proxy`, `events`, `verify` and `admin` depend on this protocol, not on the indexer's
classes; `kvroute.router.routing.fleet_index_view` adapts `indexer.FleetIndex` to it (namespaces,
the clock for
expectations, statistics as plain records).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.proto import events_pb2

# vLLM kv_cache_spec_kind values that full-attention-only routers (llm-d, Dynamo) index.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "full", "mla", "sink_full"})


@dataclass(frozen=True, slots=True)
class GroupReuse:
    group_id: int
    kind: str
    block_size: int
    sliding_window: int
    accepted_tokens: int | None  # the longest prefix this group alone accepts


@dataclass(frozen=True, slots=True)
class ReuseExplanation:
    reusable_tokens: int | None  # None = no usable evidence for this worker
    groups: list[GroupReuse] = field(default_factory=list)
    alignment: int = 0
    reason: str = ""
    expected_tokens: int = 0  # credit from a live expectation (speculative entry)

    def full_attention_only(self) -> int | None:
        """What a router that indexes only full-attention groups would predict (with the same
        speculative credit as the full rule, as llm-d and Dynamo keep speculative entries)."""
        accepted = [
            g.accepted_tokens
            for g in self.groups
            if g.kind in FULL_ATTENTION_KINDS and g.accepted_tokens is not None
        ]
        if not accepted:
            return self.expected_tokens or None
        return max(min(accepted), self.expected_tokens)

    @classmethod
    def of(cls, e: Any) -> ReuseExplanation:
        """The explanation of a worker's reuse as the indexer (or an index shard's answer)
        states it: any record with the indexer's field names."""
        groups = [
            GroupReuse(g.group_id, g.kind, g.block_size, g.sliding_window, g.accepted_tokens)
            for g in e.groups
        ]
        return cls(e.reusable_tokens, groups, e.alignment, e.reason, e.expected_tokens)


@dataclass(frozen=True, slots=True)
class TierReuse:
    """Prompt tokens a worker restores beyond its GPU hit by loading them from a lower tier
    (docs/reference/vllm-kv-events.md section 10.4): `cpu` first, then `storage` more."""

    cpu: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.cpu + self.storage


@dataclass(frozen=True, slots=True)
class IndexStats:
    valid: bool
    last_sequence: int | None
    blocks_per_group: dict[int, int]
    entries: int
    pending: int
    evicted: int
    resets: int


class IndexView(Protocol):
    """Every query takes the prompt's token ids and namespace; `keys`, when given, must be
    what `prompt_keys` returned for exactly those, so a request is hashed once however many
    queries it makes (score, reach, expectation)."""

    def prompt_keys(
        self, token_ids: Sequence[int], lora_name: str = "", cache_salt: str = ""
    ) -> Sequence[int] | None:
        """The prompt's keys in this namespace (None: this view does not use any)."""
        ...

    def score(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, int | None]:
        """Predicted reusable tokens per known worker (None = no evidence)."""
        ...

    def explain(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, ReuseExplanation]: ...

    def reach(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> tuple[Mapping[str, int | None], Mapping[str, int]]:
        """`score`, and the prompt tokens held by the full-attention groups of each worker
        that also has sliding-window or Mamba groups (may exceed its reuse; workers with
        only full attention are absent: their coverage is their reuse)."""
        ...

    def expect(
        self,
        worker: str,
        token_ids: Sequence[int],
        lora_name: str,
        cache_salt: str,
        ttl_s: float,
        keys: Sequence[int] | None = None,
        junction: int = 0,
    ) -> None:
        """Credit `worker` with the prompt for `ttl_s` seconds (until its events arrive);
        `junction` > 0: its full attention held that many prompt tokens beyond the reuse, so
        vLLM will save sliding-window / Mamba state there as well."""
        ...

    def tiers(
        self,
        token_ids: Sequence[int],
        gpu: Mapping[str, int | None],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, TierReuse]:
        """For each worker with a GPU answer in `gpu` (what `score` or `reach` gave), the
        prompt tokens its CPU and storage tiers add beyond it; workers whose lower tiers add
        nothing are absent (so a fleet without offloading gets an empty map)."""
        ...

    def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None: ...
    def apply_snapshot(self, worker: str, snapshot: events_pb2.Snapshot) -> None: ...
    def apply_snapshot_steps(
        self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
    ) -> Iterator[None]:
        """`apply_snapshot` in steps of about `blocks_per_step` blocks, yielding between
        them; the worker's old view answers until the new one is complete."""
        ...

    def invalidate(self, worker: str) -> None: ...
    def remove_worker(self, worker: str) -> None: ...
    def set_alignment(self, worker: str, alignment: int | None) -> None: ...
    def stats(self, worker: str) -> IndexStats | None: ...
