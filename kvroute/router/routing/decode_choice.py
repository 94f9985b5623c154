"""Choosing the decode worker of a disaggregated request: the fewest blocks to pull, then load.

A decode worker pulls from the prefill worker only the prompt blocks it does not hold yet
(vLLM's NIXL connector reads just those), so a worker that decoded the conversation's earlier
turns pulls little. Each candidate is priced in seconds: the transfer of the prompt tokens it
lacks at the configured link bandwidth, plus a charge per sequence it already runs
(`pd.running_s`: what one more sequence adds to a decode step, about 0.12 ms for
Llama-3.1-8B on an H100, so a running sequence weighs about three blocks of transfer at
400 Gb/s and a conversation goes back to the decode worker holding its history unless that
one is much busier; docs/decisions/pd-decode-choice.md). Saturated workers (KV usage or
running sequences at the policy's limits) are passed over while another can take the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvroute.router.config import PdConfig
from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.cost import LoadModel
from kvroute.router.routing.records import Candidate

TERMS = ("transfer", "decode_load")
TIE_S = 1e-6  # costs closer than this are equal


@dataclass(slots=True)
class DecodeChoice:
    """The chosen decode worker (None: no decode worker can take it) and every candidate."""

    chosen: Candidate | None
    candidates: list[Candidate]
    tied: int = 0  # how many equal best ones the choice took its turn among


def choose_decode(
    workers: Sequence[Worker],
    reuse: Mapping[str, int | None],
    n_tokens: int,
    load: LoadModel,
    cfg: PdConfig,
    now: float,
    link_bytes_per_s: float | None = None,
    turn: int = 0,
    in_turn: bool = False,
) -> DecodeChoice:
    """Price every decode worker (see the module doc) and pick the cheapest unsaturated one;
    ties go to the worker with fewer running sequences, then in turn (`turn`: a counter the
    caller advances after each choice among ties, `DecodeChoice.tied` > 1).
    `link_bytes_per_s`: the link's rate (default: `cfg.link_gbps`). `in_turn`: every
    unsaturated worker counts as a tie, whatever it holds (a cache-blind policy's choice)."""
    cands = load.candidates(workers, reuse, n_tokens, now)
    rate = link_bytes_per_s if link_bytes_per_s is not None else cfg.link_gbps * 1e9 / 8
    seconds_per_token = cfg.kv_bytes_per_token / rate
    for c in cands:
        held = min(c.reuse or 0, n_tokens)
        c.uncached = n_tokens - held  # here: prompt tokens to pull
        transfer = c.uncached * seconds_per_token
        running = c.running * cfg.running_s
        c.queued_tokens = 0
        c.est_ttft_s = transfer
        c.cost_s = transfer + running
        c.term_names = TERMS
        c.term_values = (transfer, running)
    open_ = [c for c in cands if not c.saturated] or cands
    best = min(open_, key=lambda c: (c.cost_s, c.running), default=None)
    if best is None:
        return DecodeChoice(None, cands)
    # equal ones (typically a new conversation nobody holds) take turns, so decode workers
    # fill alike instead of the first listed taking every new conversation
    if in_turn:
        ties = sorted(open_, key=lambda c: c.name)
    else:
        ties = [c for c in open_ if c.running == best.running and c.cost_s - best.cost_s < TIE_S]
    return DecodeChoice(ties[turn % len(ties)], cands, len(ties))
