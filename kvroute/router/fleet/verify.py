"""Checking predictions against what the engines report.

Each response's `usage.prompt_tokens_details.cached_tokens` is compared with the reuse the
router predicted for the worker it chose. A differing `prompt_tokens` means the router's token
ids were not the engine's: a tokenizer mismatch, counted on its own and kept out of the drift
judgement. When most recent predictions for a worker miss, its view is discarded and
resynchronised from a snapshot, logged once per episode.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.router.config import VerifyConfig
from kvroute.router.ops.metrics import RouterMetrics

log = logging.getLogger("kvroute.router.verify")

EXACT = "exact"
OVER = "over"  # predicted more than the engine reused
UNDER = "under"
TOKENIZER_MISMATCH = "tokenizer_mismatch"
NOT_REPORTED = "not_reported"


@dataclass(slots=True)
class WorkerAccuracy:
    recent: deque[bool]  # True = miss
    verified: int = 0
    misses: int = 0
    tokenizer_mismatches: int = 0
    abs_error_sum: int = 0
    last_resync_at: float | None = None
    resyncs: int = 0
    in_episode: bool = False
    last_error: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def mean_abs_error(self) -> float:
        return self.abs_error_sum / self.verified if self.verified else 0.0


class Verifier:
    """Per-worker prediction accuracy and the resync trigger."""

    def __init__(
        self,
        cfg: VerifyConfig,
        metrics: RouterMetrics,
        resync: Callable[[str], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cfg = cfg
        self._metrics = metrics
        self._resync = resync
        self._clock = clock
        self._workers: dict[str, WorkerAccuracy] = {}

    def accuracy(self, worker: str) -> WorkerAccuracy | None:
        return self._workers.get(worker)

    def forget(self, worker: str) -> None:
        self._workers.pop(worker, None)

    def observe(
        self,
        worker: str,
        predicted: int | None,
        cached: int | None,
        prompt_tokens: int | None,
        router_tokens: int | None,
        tolerance: int = 0,
    ) -> str:
        """Record one response; returns the outcome label.

        `predicted` is the reuse the router predicted (None = no evidence, counted as 0),
        `cached`/`prompt_tokens` what the engine reported, `router_tokens` the length of the
        router's ids (None when it had none), `tolerance` the allowed error in tokens.
        """
        if not self._cfg.enabled:
            return NOT_REPORTED
        m = self._metrics
        if cached is None:
            m.child(m.prediction_outcomes, worker, NOT_REPORTED).inc()
            return NOT_REPORTED
        acc = self._workers.get(worker)
        if acc is None:
            acc = WorkerAccuracy(recent=deque(maxlen=self._cfg.window))
            self._workers[worker] = acc
        if (
            router_tokens is not None
            and prompt_tokens is not None
            and (prompt_tokens != router_tokens)
        ):
            acc.tokenizer_mismatches += 1
            m.child(m.prediction_outcomes, worker, TOKENIZER_MISMATCH).inc()
            return TOKENIZER_MISMATCH
        if router_tokens is None:
            return NOT_REPORTED  # no ids, no prediction to judge
        guess = predicted or 0
        error = guess - cached
        tol = tolerance + self._cfg.tolerance_tokens
        outcome = EXACT if abs(error) <= tol else (OVER if error > 0 else UNDER)
        miss = outcome != EXACT
        acc.verified += 1
        acc.abs_error_sum += abs(error)
        acc.last_error = error
        acc.misses += int(miss)
        acc.recent.append(miss)
        m.child(m.predicted_tokens, worker).inc(guess)
        m.child(m.reported_tokens, worker).inc(cached)
        m.child(m.prediction_outcomes, worker, outcome).inc()
        m.child(m.prediction_error, worker).observe(abs(error))
        self._judge(worker, acc)
        return outcome

    def _judge(self, worker: str, acc: WorkerAccuracy) -> None:
        cfg = self._cfg
        n = len(acc.recent)
        if n < cfg.min_samples:
            return
        missing = sum(acc.recent)
        if missing < cfg.miss_fraction * n:
            if acc.in_episode and missing == 0:
                acc.in_episode = False
                log.info("worker %s: predictions match again", worker)
            return
        now = self._clock()
        if acc.last_resync_at is not None and now - acc.last_resync_at < cfg.resync_cooldown_s:
            return
        if not acc.in_episode:
            log.warning(
                "worker %s: %d of the last %d predictions missed; resynchronising its view",
                worker,
                missing,
                n,
            )
        acc.in_episode = True
        acc.last_resync_at = now
        acc.resyncs += 1
        acc.recent.clear()
        if self._resync(worker):
            self._metrics.child(self._metrics.resyncs, worker, "drift").inc()
