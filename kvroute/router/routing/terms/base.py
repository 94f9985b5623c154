"""The interface of a cost term, and what the terms of one decision share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvroute.router.config import PolicyConfig
from kvroute.router.routing.records import Candidate, RouteInput


@dataclass(slots=True)
class Pricing:
    """What every term of one decision reads besides the candidates."""

    seconds_per_token: float  # prefill seconds per token (configured or learned rate)
    req: RouteInput


class Term(ABC):
    """One named part of a worker's cost, in seconds.

    A term prices all candidates of a decision at once (one call per decision keeps the hot
    path short) and returns one value per candidate, in order, or None when it is off for
    this decision (every value 0). Time terms add up to the estimated TTFT; a credit
    (`time` False) only ranks: it is added to the cost the policy minimises, not to the TTFT
    the rest of the router uses.
    """

    name: ClassVar[str]
    config: ClassVar[tuple[str, ...]]  # the `policy.*` keys that set it
    time: ClassVar[bool] = True

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg

    @abstractmethod
    def values(self, cands: Sequence[Candidate], p: Pricing) -> list[float] | None:
        """Seconds per candidate, or None when the term is 0 for all of them."""
