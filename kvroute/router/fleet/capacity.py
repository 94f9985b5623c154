"""A worker's KV cache capacity: what its engine says, and the most the index saw it hold.

vLLM exports its cache configuration as an info metric, `vllm:cache_config_info`: a gauge set
to 1 whose labels are the engine's `CacheConfig` fields (`num_gpu_blocks`, `block_size`,
`kv_cache_size_tokens`, ...) plus `engine`, the DP rank. Two details matter:

- `kv_cache_size_tokens` is per engine and group-aware (on hybrid models a token occupies a
  block in several groups, so blocks x block size overstates it); it is preferred.
- `num_gpu_blocks` is summed over the DP engines one API server fronts, and every engine's
  line repeats the sum, so without `kv_cache_size_tokens` it is divided by the number of
  engine lines on the page.

The events give a second view that needs no scrape: the most blocks each KV group was ever
seen holding (a lower bound on the pool, reached once the pool has filled).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

CACHE_CONFIG_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class EngineCache:
    """The capacity one engine reports (`vllm:cache_config_info`)."""

    num_gpu_blocks: int | None  # this engine's share when the page fronts several DP engines
    block_size: int | None
    kv_cache_size_tokens: int | None  # per engine, group-aware (vLLM computes it)

    @property
    def tokens(self) -> int | None:
        """Prompt tokens the pool holds: the group-aware figure, else blocks x block size."""
        if self.kv_cache_size_tokens:
            return self.kv_cache_size_tokens
        if self.num_gpu_blocks and self.block_size:
            return self.num_gpu_blocks * self.block_size
        return None


@dataclass(slots=True)
class KvCapacity:
    """One worker's capacity as this router knows it."""

    engine: EngineCache | None = None  # from the last /metrics scrape that carried it
    # the most blocks the index ever saw each KV group hold (group id -> blocks)
    peak_blocks: dict[int, int] = field(default_factory=dict)

    def observe_blocks(self, blocks_per_group: Mapping[int, int]) -> None:
        """Raise each group's peak to what the index holds now."""
        peaks = self.peak_blocks
        for group, n in blocks_per_group.items():
            if n > peaks.get(group, 0):
                peaks[group] = n

    def tokens(self) -> int | None:
        """The pool in tokens as the engine reports it (None: not reported). The events' peak
        is not used here: until the pool has filled it understates the pool."""
        return None if self.engine is None else self.engine.tokens


def parse_cache_config(text: str, dp_rank: int) -> EngineCache | None:
    """`dp_rank`'s `vllm:cache_config_info` line on a Prometheus text page, or None.

    A line whose `engine` label is another rank is skipped; a line without one counts for any
    rank. Label values that are not integers ("None" before the engine has profiled) read as
    unknown."""
    chosen: dict[str, str] | None = None
    engines = 0
    start = 0
    name = CACHE_CONFIG_INFO + "{"
    while True:
        at = text.find(name, start)
        if at < 0:
            break
        start = at + len(name)
        if at > 0 and text[at - 1] != "\n":
            continue  # in a comment
        close = text.find("}", start)
        if close < 0:
            break
        labels = _labels(text[start:close])
        engine = labels.get("engine")
        if engine is not None and engine != "":
            engines += 1
            if engine != str(dp_rank):
                continue
        if chosen is None:
            chosen = labels
    if chosen is None:
        return None
    blocks = _int(chosen.get("num_gpu_blocks"))
    if blocks is not None and engines > 1:
        blocks //= engines
    return EngineCache(
        blocks, _int(chosen.get("block_size")), _int(chosen.get("kv_cache_size_tokens"))
    )


def _labels(body: str) -> dict[str, str]:
    """`a="1",b="x"` -> {"a": "1", "b": "x"} (values with escaped quotes are kept raw)."""
    out: dict[str, str] = {}
    i, n = 0, len(body)
    while i < n:
        eq = body.find('="', i)
        if eq < 0:
            break
        key = body[i:eq].strip().lstrip(",").strip()
        j = eq + 2
        while True:
            end = body.find('"', j)
            if end < 0:
                return out
            if body[end - 1] != "\\":
                break
            j = end + 1
        out[key] = body[eq + 2 : end]
        i = end + 1
    return out


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None
