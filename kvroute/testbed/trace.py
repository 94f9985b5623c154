"""Request traces: kvroute's own JSONL format and the Mooncake trace format.

kvroute trace (JSONL, one JSON object per line; an optional first line is a header object
with the key ``"kvroute_trace"``). Every other line is one request:

=================  ==========================================================================
field              meaning
=================  ==========================================================================
``id``             unique request id (string)
``t``              earliest send time, seconds from the start of the trace (float, >= 0)
``session``        session id; requests of one session are sent in order, each only after
                   the previous one finished (string)
``turn``           0-based position in the session (int)
``kind``           workload that made it: ``chat``, ``agent``, ``burst``, ``mooncake``, ...
``model``          model name, or null for the replayer's default model
``messages``       OpenAI chat messages (``/v1/chat/completions``), or null
``prompt``         prompt text (``/v1/completions``), or null; exactly one of the two is set
``max_tokens``     output tokens to generate (int >= 1)
``cache_salt``     vLLM ``cache_salt`` (the tenant's cache namespace), or null
``think_time``     seconds the client waits after the previous turn's answer (float >= 0)
``user``           OpenAI ``user`` field (the client's session key), or null
``prompt_tokens``  intended prompt length in tokens (what the generator aimed for; int)
=================  ==========================================================================

Mooncake traces (``FAST'25`` / ``kvcache-ai/Mooncake`` traces) are JSONL lines with
``timestamp`` (milliseconds), ``input_length``, ``output_length`` and ``hash_ids``: one id per
consecutive 512-token block of the prompt, equal ids meaning equal token content. They are
turned into kvroute requests by :func:`from_mooncake`, with text synthesised per hash id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvroute.testbed.textgen import TokenSpace

HEADER_KEY = "kvroute_trace"
FORMAT_VERSION = 1
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that does not follow the format (message names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace (see the module docstring for the fields)."""

    id: str
    t: float
    session: str
    turn: int
    kind: str
    max_tokens: int
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    model: str | None = None
    cache_salt: str | None = None
    think_time: float = 0.0
    user: str | None = None
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise TraceError(f"request {self.id!r}: exactly one of messages/prompt must be set")
        if self.t < 0 or self.think_time < 0:
            raise TraceError(f"request {self.id!r}: negative time")
        if self.max_tokens < 1:
            raise TraceError(f"request {self.id!r}: max_tokens must be >= 1")
        if self.turn < 0:
            raise TraceError(f"request {self.id!r}: negative turn")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TraceRequest:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(obj) - known
        if unknown:
            raise TraceError(f"unknown fields {sorted(unknown)}")
        try:
            return cls(**obj)
        except TypeError as exc:  # missing required fields
            raise TraceError(str(exc)) from None


@dataclass(slots=True)
class TraceHeader:
    """Optional first line: how the trace was made (for reproducing it)."""

    generator: str = ""
    seed: int | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {HEADER_KEY: FORMAT_VERSION, **asdict(self)}


def write_jsonl(
    path: str | Path, requests: Iterable[TraceRequest], header: TraceHeader | None = None
) -> int:
    """Write a trace; returns the number of requests written."""
    n = 0
    with open(path, "w", encoding="utf-8") as out:
        if header is not None:
            out.write(json.dumps(header.to_json()) + "\n")
        for req in requests:
            out.write(json.dumps(req.to_json(), ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[TraceRequest]:
    """Read a kvroute trace, sorted by ``t``; raises :class:`TraceError` naming the bad line."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as src:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{lineno}: not a JSON object")
            if HEADER_KEY in obj:
                continue
            try:
                out.append(TraceRequest.from_json(obj))
            except TraceError as exc:
                raise TraceError(f"{path}:{lineno}: {exc}") from None
    out.sort(key=lambda r: (r.t, r.session, r.turn))
    return out


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def parse_mooncake_line(obj: Any) -> MooncakeRecord:
    """Validate one decoded Mooncake line."""
    if not isinstance(obj, dict):
        raise TraceError("not a JSON object")
    try:
        ts, n_in, n_out, ids = (
            obj["timestamp"],
            obj["input_length"],
            obj["output_length"],
            obj["hash_ids"],
        )
    except KeyError as exc:
        raise TraceError(f"missing field {exc.args[0]!r}") from None
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise TraceError("timestamp must be a non-negative number")
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TraceError(f"{name} must be a non-negative integer")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise TraceError("hash_ids must be a list of integers")
    blocks_needed = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != blocks_needed:
        raise TraceError(
            f"{len(ids)} hash_ids for input_length {n_in} (expected {blocks_needed} blocks of "
            f"{MOONCAKE_BLOCK_TOKENS})"
        )
    return MooncakeRecord(float(ts), n_in, n_out, tuple(ids))


def read_mooncake(path: str | Path) -> Iterator[MooncakeRecord]:
    """Yield the records of a Mooncake trace file; raises :class:`TraceError` on a bad line."""
    with open(path, encoding="utf-8") as src:
        for lineno, line in enumerate(src, 1):
            if not line.strip():
                continue
            try:
                yield parse_mooncake_line(json.loads(line))
            except (json.JSONDecodeError, TraceError) as exc:
                msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise TraceError(f"{path}:{lineno}: {msg}") from None


def from_mooncake(
    records: Iterable[MooncakeRecord],
    space: TokenSpace,
    *,
    model: str | None = None,
    time_scale: float = 1.0,
    max_output_tokens: int | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Turn Mooncake records into completion requests.

    Each hash id becomes ``block_tokens`` tokens of text that depends only on the id, so
    equal ids give equal text (and equal tokens under the space's tokenizer). The last block
    of a prompt is cut to the remaining length: a prefix of that id's full block. Time is
    divided by ``time_scale`` (2.0 replays twice as fast).
    """
    recs = list(records)
    t0 = min((r.timestamp_ms for r in recs), default=0.0)
    out: list[TraceRequest] = []
    for i, rec in enumerate(recs):
        remaining = rec.input_length
        parts: list[str] = []
        for h in rec.hash_ids:
            n = min(block_tokens, remaining)
            parts.append(space.text(("mooncake", h), n))
            remaining -= n
        n_out = max(1, rec.output_length)
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        out.append(
            TraceRequest(
                id=f"mc-{i:06d}",
                t=max(0.0, (rec.timestamp_ms - t0) / 1000.0 / time_scale),
                session=f"mc-{i:06d}",
                turn=0,
                kind="mooncake",
                prompt="".join(parts),
                model=model,
                max_tokens=n_out,
                prompt_tokens=rec.input_length,
            )
        )
    out.sort(key=lambda r: (r.t, r.id))
    return out
