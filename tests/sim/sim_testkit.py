"""Helpers for the sim tests: drive a cache through the real scheduler, probe hits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.sim.cache import SimCache
from kvroute.sim.cache.hashing import external
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import CacheRequest, CacheSpec, GroupSpec
from kvroute.sim.engine.scheduler import Scheduler, StepPlan
from kvroute.sim.events import KvEvent

FA16 = GroupSpec("full_attention", 16)
SWA32 = GroupSpec("sliding_window", 16, 32)
MAMBA16 = GroupSpec("mamba", 16)
MAMBA64 = GroupSpec("mamba", 64)


@dataclass
class Run:
    """One request run to completion: its hit, per-step chunks and per-step events."""

    hit: int | None = None
    chunks: list[tuple[int, int]] = field(default_factory=list)
    batches: list[list[KvEvent]] = field(default_factory=list)

    @property
    def events(self) -> list[KvEvent]:
        return [e for b in self.batches for e in b]


class Driver:
    """One request at a time, like reference §9.3, through kvroute.sim.engine.scheduler."""

    def __init__(self, spec: CacheSpec, budget: int = 2048) -> None:
        self.cache = SimCache(spec)
        self.sched = Scheduler(self.cache, max_num_scheduled_tokens=budget)
        self._token = 3000

    def run(self, rid: str, tokens: list[int], max_tokens: int = 1, **kw: object) -> Run:
        self.sched.add(CacheRequest(rid, tuple(tokens), max_tokens=max_tokens, **kw))  # type: ignore[arg-type]
        out = Run()
        done = 0
        while self.sched.has_work():
            plan: StepPlan = self.sched.schedule()
            for s in plan.scheduled:
                if s.request_id == rid:
                    if s.new:
                        out.hit = s.cached_tokens
                        done = s.cached_tokens
                    if done < len(tokens):
                        out.chunks.append((done, done + s.num_tokens))
                    done += s.num_tokens

            def sample(_: str) -> int:
                self._token += 1
                return self._token

            res = self.sched.complete(plan, sample, lambda _r, _t: False)
            if res.events:
                out.batches.append(res.events)
        return out

    def probe(self, tokens: list[int], **kw: object) -> tuple[list[int], int]:
        """(per-group hits, joint hit) for a prompt, without side effects."""
        self.cache.add_request(CacheRequest("probe", tuple(tokens), **kw))  # type: ignore[arg-type]
        per_group = self.cache.per_group_hits("probe")
        hit = self.cache.lookup("probe").hit_tokens
        self.cache.free("probe")
        return per_group, hit


def hashes(tokens: list[int], unit: int = 16, **kw: object) -> list[int]:
    """The wire hash at each hash-unit boundary of `tokens` (h0 ends at `unit`)."""
    seq = CacheSeq(CacheRequest("h", tuple(tokens), **kw), unit)  # type: ignore[arg-type]
    return [external(d) for d in seq.block_hashes]
