"""A worker's CPU-tier load rate, learned from its engine's /metrics (`policy.learn_cpu_tier_rate`).

The `tier_load` term prices a token a worker loads from its CPU tier at
`policy.cpu_tier_tokens_per_s`, a guess from the host-to-GPU bandwidth and the model's KV
bytes per token. vLLM 0.33 reports what its loads really took, in two counters the router's
metrics scrape already reads (docs/reference/vllm-kv-events.md section 10.7):

- `vllm:kv_offload_load_time_total`: seconds the CPU-to-GPU copies took, measured by the
  offloading worker and added when each copy is done;
- `vllm:prompt_tokens_cached_by_source_total{source="host"}`: prompt tokens the CPU tier
  supplied, added when their request is admitted.

So a worker's rate is (host tokens) / (load seconds) between two scrapes. Both counters move
at nearly the same time but not at once, so a scrape's increments wait (`_pending`) until both
have moved, and then join sums that weigh the past by `KEEP` at each join: the rate is their
ratio (a ratio of sums, not a mean of ratios, so a small load weighs little). Until `MIN_LOADS`
joins and `MIN_TOKENS` tokens, the configured rate stands, and the learned one is used only
within a factor `BOUND` of it. A counter that goes down (the engine restarted) starts a new
baseline and keeps what was learned; a value that is not a finite number >= 0 is ignored and
drops the baseline. A page without the host series (no CPU tier, or a vLLM before it) teaches
nothing; one without the load time (a connector that does not time its loads) only holds
tokens back, so the configured rate stays. Bounded: a few floats per worker. Pure: the caller
passes the counters.

With tensor parallelism vLLM adds up every rank's copy time, so the learned rate is the rate of
one rank copying alone, lower than the engine's when the ranks copy at once: the CPU tier is
priced dearer, never cheaper.
"""

from __future__ import annotations

from math import isfinite

from kvroute.router.fleet.prom_page import sum_series

LOAD_TIME = "vllm:kv_offload_load_time_total"
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
HOST = 'source="host"'

KEEP = 0.8  # weight of the past in the sums at each join (about the last 5 joins count)
MIN_TOKENS = 2048  # host tokens before the learned rate is used
MIN_LOADS = 3  # joins before the learned rate is used
BOUND = 100.0  # the learned rate is used within this factor of the configured one


def parse_cpu_tier_counters(text: str, dp_rank: int) -> tuple[float, float] | None:
    """(host tokens, load seconds) of `dp_rank` from a Prometheus page, or None without the
    host series. A missing load time reads 0 (vLLM declares it at its first load)."""
    tokens = sum_series(text, CACHED_BY_SOURCE, dp_rank, HOST)
    if tokens is None:
        return None
    return tokens, sum_series(text, LOAD_TIME, dp_rank) or 0.0


class CpuTierRate:
    """One worker's CPU-tier load rate in tokens/s (see the module doc)."""

    __slots__ = ("_last", "_pending", "_seconds", "_tokens", "joins", "tokens_seen")

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # the counters at the last scrape
        self._pending = (0.0, 0.0)  # increments not joined yet (tokens, seconds)
        self._tokens = 0.0  # the weighted sums
        self._seconds = 0.0
        self.joins = 0
        self.tokens_seen = 0.0

    def observe(self, host_tokens: float, load_seconds: float) -> None:
        """One scrape's counters."""
        if not (isfinite(host_tokens) and isfinite(load_seconds)):
            self._last = None
            return
        if host_tokens < 0 or load_seconds < 0:
            self._last = None
            return
        last, self._last = self._last, (host_tokens, load_seconds)
        if last is None:
            return  # a baseline
        d_tokens, d_seconds = host_tokens - last[0], load_seconds - last[1]
        if d_tokens < 0 or d_seconds < 0:
            self._pending = (0.0, 0.0)  # a counter reset: this scrape is the new baseline
            return
        tokens, seconds = self._pending[0] + d_tokens, self._pending[1] + d_seconds
        if tokens <= 0 or seconds <= 0:
            self._pending = (tokens, seconds)
            return
        self._pending = (0.0, 0.0)
        self._tokens = KEEP * self._tokens + tokens
        self._seconds = KEEP * self._seconds + seconds
        self.joins += 1
        self.tokens_seen += tokens

    @property
    def learned(self) -> float | None:
        """The measured rate (tokens/s), unbounded; None until enough loads were seen."""
        if self.joins < MIN_LOADS or self.tokens_seen < MIN_TOKENS:
            return None
        return self._tokens / self._seconds

    def tokens_per_s(self, configured: float) -> float:
        """The rate to price this worker's CPU-tier tokens at: the learned one within `BOUND`
        of `configured`, else `configured`."""
        learned = self.learned
        if learned is None:
            return configured
        return min(max(learned, configured / BOUND), configured * BOUND)
