"""A bounded log of recent routing decisions (for GET /admin/decisions and the dashboard).

Records keep the policy's per-candidate view as it was, each cost term's value included, plus
the outcome filled in when the response ends (status, attempts, what the engine reported).
JSON is built only when read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvroute.router.routing.policy import Candidate, Decision


@dataclass(slots=True)
class PhaseAttempt:
    """One try of one half of a disaggregated request."""

    worker: str
    outcome: str  # a status code, or the failure's cause (connect, timeout, 5xx, ...)
    seconds: float  # dispatch to answer (prefill) or to first byte (decode)


@dataclass(slots=True)
class PdRecord:
    """Both halves of a disaggregated request: the prefill tries, the decode choice (every
    decode candidate as priced) and the decode tries."""

    prefill: list[PhaseAttempt] = field(default_factory=list)
    decode_candidates: list[Candidate] = field(default_factory=list)
    decode: list[PhaseAttempt] = field(default_factory=list)

    def to_json(self, *, candidates: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefill": [_phase_json(a) for a in self.prefill],
            "decode": [_phase_json(a) for a in self.decode],
        }
        if candidates:
            out["decode_candidates"] = [candidate_json(c) for c in self.decode_candidates]
        return out


def _phase_json(a: PhaseAttempt) -> dict[str, Any]:
    return {"worker": a.worker, "outcome": a.outcome, "seconds": round(a.seconds, 6)}


@dataclass(slots=True)
class DecisionRecord:
    id: int
    at: float  # wall clock
    request_id: str
    endpoint: str
    model: str
    lora_name: str
    cache_salt_set: bool
    token_source: str
    decision: Decision
    attempts: list[str] = field(default_factory=list)
    status: int | None = None
    reported_cached_tokens: int | None = None
    reported_prompt_tokens: int | None = None
    outcome: str | None = None
    duration_s: float | None = None
    # the engine endpoint the request went to (a chat request sent as a completion of the
    # router's token ids, `send_token_ids`, differs from `endpoint`)
    upstream_endpoint: str | None = None
    pd: PdRecord | None = None  # set when the request was split into prefill and decode

    def to_json(self, *, candidates: bool = True) -> dict[str, Any]:
        d = self.decision
        out: dict[str, Any] = {
            "id": self.id,
            "time": self.at,
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "model": self.model,
            "lora_name": self.lora_name,
            "cache_salt": self.cache_salt_set,
            "prompt_tokens": d.n_tokens,
            "token_source": self.token_source,
            "policy": d.policy,
            "chosen": d.chosen.name if d.chosen else None,
            "reason": d.reason,
            "detail": d.detail,
            "predicted_cached_tokens": d.predicted_reuse,
            "session": d.session_key is not None,
            "attempts": list(self.attempts),
            "status": self.status,
            "reported_cached_tokens": self.reported_cached_tokens,
            "reported_prompt_tokens": self.reported_prompt_tokens,
            "outcome": self.outcome,
            "duration_s": self.duration_s,
            "upstream_endpoint": self.upstream_endpoint,
            "pd": None if self.pd is None else self.pd.to_json(candidates=candidates),
        }
        if candidates:
            out["candidates"] = [candidate_json(c) for c in d.candidates]
        return out


def candidate_json(c: Candidate) -> dict[str, Any]:
    return {
        "worker": c.name,
        "predicted_reuse": c.reuse,
        "uncached_tokens": c.uncached,
        "running": c.running,
        "queued_prefill_tokens": c.queued_tokens,
        "kv_usage": c.kv_usage,
        "est_ttft_s": round(c.est_ttft_s, 6),
        "saturated": c.saturated,
        "affinity_tokens": c.affinity,
        # the prompt's tokens by where the worker gets them: reused on GPU, loaded from its
        # CPU or storage tier, prefilled (gpu is 0 without evidence)
        "tier_tokens": {
            "gpu": c.reuse or 0,
            "cpu": c.cpu_tokens,
            "storage": c.storage_tokens,
            "prefill": c.uncached,
        },
        # what the policy ranked by (est_ttft_s plus credits) and each term of it, seconds
        "cost_s": round(c.cost_s, 6),
        "terms": {name: round(v, 6) for name, v in c.terms.items()},
    }


class DecisionLog:
    def __init__(self, capacity: int) -> None:
        self._records: deque[DecisionRecord] = deque(maxlen=capacity)
        self._next_id = 1

    def add(
        self,
        request_id: str,
        endpoint: str,
        model: str,
        lora_name: str,
        cache_salt_set: bool,
        token_source: str,
        decision: Decision,
    ) -> DecisionRecord:
        record = DecisionRecord(
            self._next_id,
            time.time(),
            request_id,
            endpoint,
            model,
            lora_name,
            cache_salt_set,
            token_source,
            decision,
        )
        self._next_id += 1
        self._records.append(record)
        return record

    def recent(self, limit: int = 50, after_id: int = 0) -> list[DecisionRecord]:
        """Newest last; only records with id > after_id; at most `limit`."""
        out = [r for r in self._records if r.id > after_id]
        return out[-limit:] if limit > 0 else []

    def __len__(self) -> int:
        return len(self._records)
