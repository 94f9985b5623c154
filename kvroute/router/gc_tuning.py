"""The garbage-collector settings of every long-lived kvroute router-side process (router
processes and index shards alike)."""

from __future__ import annotations

import gc


def tune_gc() -> None:
    """Collect garbage less often, and never look at start-up objects again.

    A request allocates a few hundred objects (its decoded body holds a list per prompt,
    1024 ids long for a 1024-token prompt); with Python's default first-generation
    threshold (700) and dozens of requests in flight, the collector ran every few requests
    and walked every live prompt list each time: ~10 % of the router's CPU. The router
    makes few reference cycles, so rarer collections cost little memory.
    """
    gc.freeze()  # modules, config, index structures built so far: permanent
    gen0, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0, 20_000), gen1, gen2)
