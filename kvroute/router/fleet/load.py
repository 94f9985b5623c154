"""Per-worker load: the router's own in-flight accounting, corrected by the engines' /metrics.

Each router process counts what it sent and has not finished (running requests) and the
uncached prefill tokens it sent whose first byte has not come back (queued prefill). Another
replica's traffic is invisible to that count, so each engine's `/metrics` is read periodically:
whatever the engine reports beyond what this process had in flight at scrape time is other
replicas' load, and it is added (waiting requests at the learned mean prefill size).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvroute.router.fleet.capacity import KvCapacity
from kvroute.router.fleet.cpu_tier_rate import CpuTierRate
from kvroute.router.fleet.prom_page import sum_series
from kvroute.router.fleet.step_clock import StepClock

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the name before vLLM 0.10


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of an engine's /metrics, for one DP rank."""

    running: float
    waiting: float
    kv_usage: float | None
    at: float  # monotonic time of the scrape
    own_running_at: int  # this process's running count at scrape time
    own_prefilling_at: int
    # (running, waiting) requests the engine had that this process did not send: fixed by
    # the scrape, so worked out once here instead of per candidate of every decision
    others: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        others_total = max(0, round(self.running + self.waiting) - self.own_running_at)
        others_waiting = max(0, round(self.waiting) - self.own_prefilling_at)
        object.__setattr__(self, "others", (others_total, min(others_waiting, others_total)))


@dataclass(slots=True)
class ScrapeBackoff:
    """When a worker's /metrics is next read. A scrape costs the engine's frontend CPU (a
    Python Prometheus page of several kB), so while scrapes keep showing nothing this process
    does not already know (no other router's requests, KV usage clear of saturation), the
    period doubles up to a cap; the first scrape that shows something resets it."""

    interval: float = 0.0  # 0: not scraped yet
    due_at: float = 0.0

    def due(self, now: float) -> bool:
        return now >= self.due_at

    def scraped(self, now: float, quiet: bool, base_s: float, max_s: float) -> None:
        """Schedule the next scrape after one that was `quiet` (or not)."""
        if quiet and self.interval > 0:
            self.interval = min(self.interval * 2, max_s)
        else:
            self.interval = base_s
        # a hair early, so the periodic job running every base_s finds it due
        self.due_at = now + self.interval - base_s / 4


@dataclass(slots=True)
class WorkerLoad:
    """Live load of one worker as seen by this process."""

    running: int = 0  # own requests sent and not finished
    prefilling: int = 0  # own requests whose first byte has not come back
    queued_prefill_tokens: int = 0  # their uncached prompt tokens
    engine: EngineMetrics | None = None
    started_total: int = 0
    steps: StepClock = field(default_factory=StepClock)  # learned from relayed stream chunks
    scrape: ScrapeBackoff = field(default_factory=ScrapeBackoff)
    capacity: KvCapacity = field(default_factory=KvCapacity)  # the engine's and the events'
    cpu_tier: CpuTierRate = field(default_factory=CpuTierRate)  # learned from /metrics

    def others(self, now: float, stale_after: float) -> tuple[int, int]:
        """(running, waiting) requests the engine had that this process did not send."""
        m = self.engine
        if m is None or now - m.at > stale_after:
            return 0, 0
        return m.others

    def kv_usage(self, now: float, stale_after: float) -> float | None:
        m = self.engine
        if m is None or now - m.at > stale_after:
            return None
        return m.kv_usage


class LoadTicket:
    """One request's share of a worker's load; release is idempotent."""

    __slots__ = ("_done_prefill", "_finished", "_load", "tokens")

    def __init__(self, load: WorkerLoad, tokens: int) -> None:
        self._load = load
        self.tokens = tokens
        self._done_prefill = False
        self._finished = False
        load.running += 1
        load.prefilling += 1
        load.queued_prefill_tokens += tokens
        load.started_total += 1

    def prefill_done(self) -> None:
        """The first byte came back (or the prefill is assumed done)."""
        if self._done_prefill:
            return
        self._done_prefill = True
        self._load.prefilling -= 1
        self._load.queued_prefill_tokens -= self.tokens

    def finish(self) -> None:
        self.prefill_done()
        if self._finished:
            return
        self._finished = True
        self._load.running -= 1


class PromptSizeEstimate:
    """Exponential moving average of uncached prefill tokens per request (for others' queue)."""

    __slots__ = ("alpha", "value")

    def __init__(self, initial: float, alpha: float = 0.05) -> None:
        self.value = float(initial)
        self.alpha = alpha

    def observe(self, tokens: int) -> None:
        self.value += self.alpha * (tokens - self.value)


class PrefillRateEstimate:
    """The fleet's prefill throughput (tokens/s), learned from streamed requests' first bytes.

    vLLM streams nothing until a request's prefill is done, so the time from dispatch to the
    first byte is the time to prefill the tokens ahead of it plus its own uncached tokens.
    Over the last `window` samples this fits first-byte seconds = a + tokens / rate by least
    squares (a absorbs step overhead and decode interference) and reports the rate; until
    `min_samples` samples with spread in their sizes exist the configured rate stands, and
    when a later refit is not positive the last good fit stands. Bounded: a fixed window of
    (tokens, seconds) pairs.
    """

    __slots__ = ("_configured", "_min", "_samples", "_sx", "_sxx", "_sxy", "_sy", "value")

    def __init__(self, configured: float, window: int = 512, min_samples: int = 32) -> None:
        self._configured = float(configured)
        self.value = float(configured)
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._min = min_samples
        # running sums over the window, so a refit costs O(1) on the request path
        self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One streamed request: tokens ahead of its first byte (queued + own uncached)."""
        if tokens <= 0 or not 0.0 < seconds < 600.0:
            return
        x, y = float(tokens), float(seconds)
        samples = self._samples
        if len(samples) == samples.maxlen:
            ox, oy = samples[0]
            self._sx -= ox
            self._sy -= oy
            self._sxx -= ox * ox
            self._sxy -= ox * oy
        samples.append((x, y))
        self._sx += x
        self._sy += y
        self._sxx += x * x
        self._sxy += x * y
        self._refit()

    def wall_seconds(self, estimated_s: float, estimated_at_rate: float) -> float:
        """`estimated_s` seconds of prefill estimated at `estimated_at_rate` tokens/s, in
        wall time at the measured rate (the configured one until a fit exists)."""
        return estimated_s * estimated_at_rate / self.value

    def _refit(self) -> None:
        n = len(self._samples)
        if n < self._min:
            return
        var = n * self._sxx - self._sx * self._sx
        # sizes must spread (a coefficient of variation of 10% at least) for a slope to mean
        # anything; float sums drift, so guard against a tiny or negative variance
        if var <= 0.01 * self._sx * self._sx:
            return
        slope = (n * self._sxy - self._sx * self._sy) / var
        if slope <= 0:
            return
        # stay within a factor of 100 of the configured rate: a wild fit must not route
        self.value = min(max(1.0 / slope, self._configured / 100), self._configured * 100)


def parse_engine_metrics(text: str, dp_rank: int) -> tuple[float, float, float | None] | None:
    """(running, waiting, kv_usage) for `dp_rank` from a Prometheus text page, or None (each
    series summed as `kvroute.router.fleet.prom_page.sum_series` does)."""
    running = sum_series(text, RUNNING, dp_rank)
    waiting = sum_series(text, WAITING, dp_rank)
    if running is None and waiting is None:
        return None
    usage = sum_series(text, KV_USAGE, dp_rank)
    if usage is None:
        usage = sum_series(text, KV_USAGE_OLD, dp_rank)
    return running or 0.0, waiting or 0.0, usage
