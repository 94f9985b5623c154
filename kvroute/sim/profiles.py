"""Model profiles: the KV cache layouts a simulated engine can have.

- dense: one full-attention group (Llama-like), block 16.
- swa:   Gemma-like hybrid: full attention + sliding window (window 512), both block 16.
- mamba: Qwen3-Next-like hybrid: full attention (block 16) + Mamba state groups with large
         64-token blocks; hash unit 16 (the GCD), so vLLM's fine-grained partial hits are on
         and hits land on 16-token boundaries (reference §7.3, example C).
Retention is vLLM's default (0: sliding-window/Mamba state only at replay boundaries and
shared-prefix junctions) unless overridden.
"""

from __future__ import annotations

from kvroute.sim.cache_api import GroupSpec

PROFILES: dict[str, tuple[GroupSpec, ...]] = {
    "dense": (GroupSpec("full_attention", 16),),
    "swa": (GroupSpec("full_attention", 16), GroupSpec("sliding_window", 16, 512)),
    "mamba": (GroupSpec("full_attention", 16), GroupSpec("mamba", 64)),
}


def profile_groups(name: str, sliding_window: int | None = None) -> tuple[GroupSpec, ...]:
    """The groups of a profile (optionally with another sliding window); KeyError if unknown."""
    if name not in PROFILES:
        raise KeyError(f"unknown model profile {name!r}; choose from {', '.join(PROFILES)}")
    groups = PROFILES[name]
    if sliding_window is not None:
        groups = tuple(
            GroupSpec(g.kind, g.block_size, sliding_window) if g.kind == "sliding_window" else g
            for g in groups
        )
    return groups
