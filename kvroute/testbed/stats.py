"""Per-request records of a load run and their summary."""

from __future__ import annotations

import gzip
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in seconds from the start of the run)."""

    id: str
    session: str
    kind: str
    scheduled: float  # when the trace wanted it sent (open loop), or 0
    turn: int | None = None  # position in its session (0 = the first turn)
    sent: float = math.nan
    ttft: float | None = None  # first content chunk
    latency: float | None = None  # end of the response
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    output_tokens: int = 0  # usage.completion_tokens, else content chunks counted
    status: int | None = None  # HTTP status
    error: str | None = None
    worker: str | None = None  # from a response header naming the worker, when a router sets one
    # Where the TTFT went, when a named simulated engine reports its timing (seconds): from the
    # send to the engine's receipt of the headers (the router's forward hop), the engine
    # reading and tokenizing the body, waiting for admission, the prefill step(s), and from
    # the engine's first token to the client's (the way back).
    forward_s: float | None = None
    parse_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    return_s: float | None = None
    # KV blocks the answering (decode) engine pulled from a prefill peer for this request
    pulled_blocks: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    return _pct(sorted(values), q)


@dataclass(frozen=True, slots=True)
class Difference:
    """A percentile of one router's TTFTs minus the same percentile of another's, with a
    bootstrap confidence interval (seconds; negative = the first router is faster)."""

    diff: float
    low: float
    high: float
    level: float

    @property
    def verdict(self) -> str:
        """ "lower" / "higher" when the interval excludes zero, else "not distinguishable"."""
        if self.high < 0:
            return "lower"
        if self.low > 0:
            return "higher"
        return "not distinguishable"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def paired_bootstrap(
    clusters: Sequence[tuple[Sequence[float], Sequence[float]]],
    q: float,
    iterations: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Difference | None:
    """Percentile ``q`` of the first values minus that of the second, pooled over clusters,
    with a paired cluster-bootstrap interval.

    A cluster is one session of one trace as the two routers served it (first, second TTFTs):
    both routers replayed the same sessions, so resampling whole sessions, the same ones for
    both, keeps the pairing and the correlation between a session's turns. Seeded, so the
    same inputs give the same interval. None when either side has no values."""
    return _paired(clusters, lambda xs: _pct(xs, q), iterations, level, seed)


def paired_bootstrap_mean(
    clusters: Sequence[tuple[Sequence[float], Sequence[float]]],
    iterations: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Difference | None:
    """As `paired_bootstrap`, for the mean of the pooled values (e.g. KV blocks pulled per
    request) instead of a percentile."""
    return _paired(clusters, statistics.fmean, iterations, level, seed)


def _paired(
    clusters: Sequence[tuple[Sequence[float], Sequence[float]]],
    stat: Callable[[Sequence[float]], float],
    iterations: int,
    level: float,
    seed: int,
) -> Difference | None:
    """`stat` (given sorted values) of the first values minus that of the second, with the
    paired cluster-bootstrap interval of `paired_bootstrap`."""
    kept = [(list(a), list(b)) for a, b in clusters if a or b]
    first = [x for a, _ in kept for x in a]
    second = [x for _, b in kept for x in b]
    if not first or not second:
        return None
    diff = stat(sorted(first)) - stat(sorted(second))
    rng = random.Random(seed)
    n = len(kept)
    draws: list[float] = []
    for _ in range(iterations):
        xs: list[float] = []
        ys: list[float] = []
        for i in rng.choices(range(n), k=n):
            a, b = kept[i]
            xs += a
            ys += b
        if xs and ys:
            xs.sort()
            ys.sort()
            draws.append(stat(xs) - stat(ys))
    draws.sort()
    tail = (1.0 - level) / 2 * 100
    return Difference(diff, _pct(draws, tail), _pct(draws, 100 - tail), level)


def _pct(xs: Sequence[float], q: float) -> float:
    """`percentile` of already sorted, non-empty values."""
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class Summary:
    """Aggregate of a run. Token ratios count only requests the engine answered."""

    requests: int
    ok: int
    errors: int
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    cached_ratio: float
    output_tokens: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    ttft_mean: float | None
    latency_p50: float | None
    latency_p99: float | None
    req_per_s: float
    output_tok_per_s: float
    slo_ttft_s: float
    goodput_req_per_s: float  # OK requests with TTFT <= SLO, per second
    slo_attainment: float  # fraction of all requests that were OK and met the SLO
    error_kinds: dict[str, int]
    # Median of each TTFT part (seconds; TTFT_PARTS), over the requests whose engine reported
    # its timing; empty when none did.
    ttft_parts_p50: dict[str, float] = field(default_factory=dict)
    # Time per output token after the first (seconds), over the requests with two or more.
    tpot_p50: float | None = None
    tpot_p99: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


# The parts a TTFT splits into when the engine reports its timing (RequestRecord fields).
TTFT_PARTS = ("forward_s", "parse_s", "queue_s", "prefill_s", "return_s")
TTFT_PART_LABELS = ("to the engine", "engine parses", "queued", "prefill", "back to client")


def ttft_parts_p50(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Median of each TTFT part over the records that have them all (empty if none do)."""
    split = [r for r in records if r.ok and r.return_s is not None]
    if not split:
        return {}
    return {k: _r(percentile([getattr(r, k) for r in split], 50), 5) or 0.0 for k in TTFT_PARTS}


def tpot(record: RequestRecord) -> float | None:
    """A request's time per output token after its first: (latency - TTFT) / (tokens - 1);
    None when it has fewer than two tokens or no times."""
    if record.ttft is None or record.latency is None or record.output_tokens < 2:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def summarize(records: Sequence[RequestRecord], slo_ttft_s: float) -> Summary:
    """Summary of ``records`` (duration = first send to last completion)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    lats = [r.latency for r in ok if r.latency is not None]
    sent = [r.sent for r in records if not math.isnan(r.sent)]
    ends = [r.sent + r.latency for r in ok if r.latency is not None]
    duration = (max(ends) - min(sent)) if ends and sent else 0.0
    good = sum(1 for r in ok if r.ttft is not None and r.ttft <= slo_ttft_s)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    output = sum(r.output_tokens for r in ok)
    kinds: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"http {r.status}" if r.status not in (None, 200) else (r.error or "?")[:60]
            kinds[key] = kinds.get(key, 0) + 1
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=len(records) - len(ok),
        duration_s=round(duration, 3),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_ratio=round(cached / prompt, 4) if prompt else 0.0,
        output_tokens=output,
        ttft_p50=_r(percentile(ttfts, 50)),
        ttft_p90=_r(percentile(ttfts, 90)),
        ttft_p99=_r(percentile(ttfts, 99)),
        ttft_mean=_r(sum(ttfts) / len(ttfts)) if ttfts else None,
        latency_p50=_r(percentile(lats, 50)),
        latency_p99=_r(percentile(lats, 99)),
        req_per_s=round(per_s(len(ok)), 3),
        output_tok_per_s=round(per_s(output), 1),
        slo_ttft_s=slo_ttft_s,
        goodput_req_per_s=round(per_s(good), 3),
        slo_attainment=round(good / len(records), 4) if records else 0.0,
        error_kinds=kinds,
        ttft_parts_p50=ttft_parts_p50(ok),
        tpot_p50=_r(percentile(tpots, 50), 5),
        tpot_p99=_r(percentile(tpots, 99), 5),
    )


def read_records(path: Path) -> list[dict[str, Any]]:
    """The rows of a records JSONL file, or of its gzipped copy (``path`` + ``.gz``); [] if
    neither exists."""
    packed = path.with_name(path.name + ".gz")
    if path.exists():
        text = path.read_text("utf-8")
    elif packed.exists():
        text = gzip.decompress(packed.read_bytes()).decode("utf-8")
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
