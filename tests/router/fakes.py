"""A scripted stand-in for the KV index (a test double for proxy and admin tests that must not
depend on event timing; the real `indexer.FleetIndex` is used by the integration tests)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvroute.proto import events_pb2
from kvroute.router.routing.index_view import IndexStats, ReuseExplanation, TierReuse


@dataclass
class ScriptedIndex:
    scores: dict[str, int | None] = field(default_factory=dict)
    expected: list[tuple[str, int, str, str]] = field(default_factory=list)
    invalidated: list[str] = field(default_factory=list)
    batches: list[tuple[str, int]] = field(default_factory=list)
    snapshots: list[tuple[str, str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def prompt_keys(
        self, token_ids: Sequence[int], lora_name: str = "", cache_salt: str = ""
    ) -> Sequence[int] | None:
        return None

    def score(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, int | None]:
        return {
            k: (None if v is None else min(v, len(token_ids) - 1)) for k, v in self.scores.items()
        }

    def explain(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, ReuseExplanation]:
        return {
            k: ReuseExplanation(v, [], 16, "scripted") for k, v in self.score(token_ids).items()
        }

    coverages: dict[str, int] = field(default_factory=dict)

    def reach(
        self,
        token_ids: Sequence[int],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> tuple[Mapping[str, int | None], Mapping[str, int]]:
        return self.score(token_ids, lora_name, cache_salt, keys), dict(self.coverages)

    tier_tokens: dict[str, TierReuse] = field(default_factory=dict)

    def tiers(
        self,
        token_ids: Sequence[int],
        gpu: Mapping[str, int | None],
        lora_name: str = "",
        cache_salt: str = "",
        keys: Sequence[int] | None = None,
    ) -> Mapping[str, TierReuse]:
        return {k: v for k, v in self.tier_tokens.items() if gpu.get(k) is not None}

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
        self.expected.append((worker, len(token_ids), lora_name, cache_salt))

    def apply(self, worker: str, batch: events_pb2.KvEventBatch) -> None:
        self.batches.append((worker, batch.sequence))

    def apply_snapshot(self, worker: str, snapshot: events_pb2.Snapshot) -> None:
        self.snapshots.append((worker, snapshot.reason))

    def apply_snapshot_steps(
        self, worker: str, snapshot: events_pb2.Snapshot, blocks_per_step: int
    ) -> Iterator[None]:
        self.apply_snapshot(worker, snapshot)
        yield

    def invalidate(self, worker: str) -> None:
        self.invalidated.append(worker)

    def remove_worker(self, worker: str) -> None:
        self.removed.append(worker)

    def set_alignment(self, worker: str, alignment: int | None) -> None:
        pass

    def stats(self, worker: str) -> IndexStats | None:
        return IndexStats(True, None, {}, 0, 0, 0, 0)
