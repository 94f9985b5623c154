"""Conversation chains in a Mooncake trace, and a development / held-out split by chain.

A Mooncake trace has no session ids: a later turn of a conversation shows up only as a
request whose ``hash_ids`` start with an earlier request's blocks. This module links each
request to its *parent*, the most recent earlier request that shares the longest block prefix
with it (at least ``min_shared_blocks`` blocks, so a system prompt that every request shares
does not join unrelated conversations), and calls each connected group a *chain*.

Policies are judged on public traces with the split decided before any change: every chain is
on exactly one side (development or held-out), chosen by a keyed hash of the chain's first
request index, so the split does not depend on the order chains are visited, on Python's
hash seed, or on anything a policy run does. Sampling takes whole chains only.

Command line (writes Mooncake-format JSONL, which ``kvroute.testbed.workload --mooncake``
converts into a replayable trace)::

    python -m kvroute.testbed.trace_chains --trace conversation_trace.jsonl \\
        --side heldout --start-s 600 --duration-s 120 --out heldout.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvroute.testbed.trace import MOONCAKE_BLOCK_TOKENS, MooncakeRecord, read_mooncake

Side = Literal["dev", "heldout"]

#: The split's key. Changing it changes which chains are held out: never change it for an
#: existing results folder (the folder records the key it used).
SPLIT_KEY = "kvroute-public-trace-split-v1"
HELDOUT_FRACTION = 0.5
MIN_SHARED_BLOCKS = 2


@dataclass(frozen=True, slots=True)
class ChainLinks:
    """Per request (trace order): its parent, blocks shared with it, and its chain id.

    ``chain[i]`` is the index of the first request of ``i``'s chain.
    """

    parent: tuple[int | None, ...]
    shared_blocks: tuple[int, ...]
    chain: tuple[int, ...]


def link_chains(
    hash_lists: Sequence[Sequence[int]], min_shared_blocks: int = MIN_SHARED_BLOCKS
) -> ChainLinks:
    """Link each request to the latest earlier one with the longest common block prefix.

    A request whose longest common prefix with every earlier request is shorter than
    ``min_shared_blocks`` starts a chain. Runs in time linear in the total number of blocks.
    """
    if min_shared_blocks < 1:
        raise ValueError("min_shared_blocks must be at least 1")
    # A trie of block ids; each node remembers the latest request that passed through it.
    children: list[dict[int, int]] = [{}]
    latest: list[int] = [-1]
    parent: list[int | None] = []
    shared: list[int] = []
    for i, blocks in enumerate(hash_lists):
        node, depth = 0, 0
        for h in blocks:
            nxt = children[node].get(h)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        found = depth >= min_shared_blocks
        parent.append(latest[node] if found else None)
        shared.append(depth if found else 0)
        node = 0
        for h in blocks:
            nxt = children[node].get(h)
            if nxt is None:
                nxt = len(children)
                children.append({})
                latest.append(i)
                children[node][h] = nxt
            node = nxt
            latest[node] = i
    chain: list[int] = []
    for i, p in enumerate(parent):
        chain.append(i if p is None else chain[p])
    return ChainLinks(tuple(parent), tuple(shared), tuple(chain))


def side_of(
    chain_id: int, key: str = SPLIT_KEY, heldout_fraction: float = HELDOUT_FRACTION
) -> Side:
    """The side of the split a chain is on: a keyed hash of its first request's index."""
    digest = hashlib.blake2b(str(chain_id).encode(), key=key.encode(), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "big") < heldout_fraction * 2**64 else "dev"


def sample(
    records: Sequence[MooncakeRecord],
    links: ChainLinks,
    side: Side,
    start_s: float,
    duration_s: float,
    key: str = SPLIT_KEY,
) -> list[int]:
    """Indexes (trace order) of every request of the chains on ``side`` that start in the window.

    A chain is taken whole, including its requests after the window ends.
    """
    lo, hi = start_s * 1000.0, (start_s + duration_s) * 1000.0
    taken = {
        i
        for i, rec in enumerate(records)
        if links.chain[i] == i and lo <= rec.timestamp_ms < hi and side_of(i, key) == side
    }
    return [i for i in range(len(records)) if links.chain[i] in taken]


def describe(
    records: Sequence[MooncakeRecord], links: ChainLinks, picked: Sequence[int]
) -> dict[str, float]:
    """Counts of a sample: requests, chains, mean prompt tokens, share of prompt tokens that
    extend the request's parent (what an ideal cache could reuse within chains)."""
    tokens = sum(records[i].input_length for i in picked)
    shared = sum(
        min(links.shared_blocks[i] * MOONCAKE_BLOCK_TOKENS, records[i].input_length) for i in picked
    )
    return {
        "requests": len(picked),
        "chains": len({links.chain[i] for i in picked}),
        "mean_prompt_tokens": round(tokens / len(picked), 1) if picked else 0.0,
        "chain_prefix_share": round(shared / tokens, 4) if tokens else 0.0,
    }


def _to_json(rec: MooncakeRecord) -> str:
    ts = int(rec.timestamp_ms) if rec.timestamp_ms.is_integer() else rec.timestamp_ms
    return json.dumps(
        {
            "timestamp": ts,
            "input_length": rec.input_length,
            "output_length": rec.output_length,
            "hash_ids": list(rec.hash_ids),
        }
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvroute.testbed.trace_chains",
        description="Sample whole conversation chains of one side of the public-trace split.",
    )
    p.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--side", choices=["dev", "heldout"], required=True, help="side of the split")
    p.add_argument("--start-s", type=float, default=0.0, help="window start, trace seconds (>= 0)")
    p.add_argument("--duration-s", type=float, required=True, help="window length, seconds (> 0)")
    p.add_argument(
        "--min-shared-blocks",
        type=int,
        default=MIN_SHARED_BLOCKS,
        help="blocks a request must share with an earlier one to join its chain (>= 1)",
    )
    p.add_argument("--out", default="-", help="output Mooncake JSONL ('-' for stdout)")
    args = p.parse_args(argv)
    records = list(read_mooncake(args.trace))
    links = link_chains([r.hash_ids for r in records], args.min_shared_blocks)
    picked = sample(records, links, args.side, args.start_s, args.duration_s)
    lines = "".join(_to_json(records[i]) + "\n" for i in picked)
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        with open(args.out, "w", encoding="utf-8") as dst:
            dst.write(lines)
    print(json.dumps(describe(records, links, picked)), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
