"""Benchmark of the indexer: score time over fleets, ingest rate, memory per entry.

    python -m bench.index_bench            # full run (minutes), writes bench/results/index.*
    python -m bench.index_bench --smoke    # seconds; writes index-smoke.* beside it

Fleet content imitates vLLM under the default settings: every worker holds a shared
system prompt and conversations stored in 2,048-token prefill chunks (full attention
dense; in the hybrid layout also a sliding-window tail and a Mamba state at each
prompt's replay boundary and at the system-prompt junction). The scored request is a
follow-up turn: its conversation is cached to 90% on two workers and to half on two
more, while every worker has its system prompt ("hot"); "cold" is a new conversation
that shares only the system prompt. Background content per worker shrinks as the fleet
grows (a few million blocks in all: Python memory, not realism, is the limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.report import index_plot
from kvroute.indexer import FleetIndex, content_keys
from kvroute.indexer.keys import MASK64
from kvroute.proto import events_pb2 as pb

UNIT = 16
CHUNK = 2048  # tokens per prefill step
SYSTEM = 2048  # system prompt tokens
FULL = [("full_attention", 16, 0)]
HYBRID = [("full_attention", 16, 0), ("sliding_window", 16, 1024), ("mamba", 16, 0)]
LAYOUTS = {"full": FULL, "hybrid": HYBRID}


def tokens(n: int, seed: int) -> list[int]:
    """n pseudo-random token ids (vocabulary 65,536), deterministic per seed."""
    state = (seed * 0x9E3779B97F4A7C15 + 1) & MASK64
    raw = bytearray()
    while len(raw) < 2 * n:
        state = (state * 6364136223846793005 + 1442695040888963407) & MASK64
        raw += state.to_bytes(8, "little")
    return list(array("H", bytes(raw[: 2 * n])))


def engine_hashes(toks: Sequence[int]) -> list[bytes]:
    """Stand-in engine hashes: prefix-chained (equal prefixes, equal hashes), opaque."""
    return [((k & MASK64) ^ 0x5BD1E995).to_bytes(8, "big") for k in content_keys(toks)]


@dataclass
class Engine:
    """One worker's event source."""

    layout: list[tuple[str, int, int]]
    seq: int = 0
    stored_blocks: int = 0

    def prompt(self, toks: list[int], start: int = 0) -> list[pb.KvEventBatch]:
        """Batches vLLM would publish for prefilling `toks`, cached up to `start`."""
        hashes = engine_hashes(toks)
        n_blocks = len(toks) // UNIT
        boundary = (len(toks) - 1) // UNIT  # replay boundary, in blocks
        junction = SYSTEM // UNIT if start < SYSTEM < len(toks) else None
        out = []
        first = start // UNIT
        for c0 in range(first, n_blocks, CHUNK // UNIT):
            c1 = min(c0 + CHUNK // UNIT, n_blocks)
            parent = hashes[c0 - 1] if c0 else b""
            span = toks[c0 * UNIT : c1 * UNIT]
            events = []
            for gid, (kind, bs, window) in enumerate(self.layout):
                ends = [b for b in (junction, boundary) if b is not None]
                if kind == "full_attention":
                    chosen = hashes[c0:c1]
                elif kind == "sliding_window":  # the window's blocks before each boundary
                    need = -(-(window - 1) // bs)
                    chosen = [
                        hashes[i] for i in range(c0, c1) if any(b - need <= i < b for b in ends)
                    ]
                else:  # Mamba: the state at each boundary
                    chosen = [hashes[i] for i in range(c0, c1) if i + 1 in ends]
                events.append(
                    pb.KvGroupEvent(
                        operation=pb.KvGroupEvent.STORE,
                        group_id=gid,
                        block_hashes=chosen,
                        parent_block_hash=parent,
                        token_ids=span,
                        block_size=bs,
                        kind=kind,
                        sliding_window=window,
                    )
                )
                self.stored_blocks += len(chosen)
            out.append(pb.KvEventBatch(sequence=self.seq, timestamp=0.0, events=events))
            self.seq += 1
        return out


def build_fleet(
    n_workers: int, layout: list[tuple[str, int, int]], background_tokens: int, seed: int
) -> tuple[FleetIndex, list[Engine]]:
    fleet = FleetIndex()
    engines = []
    system = tokens(SYSTEM, seed)
    for w in range(n_workers):
        eng = Engine(layout)
        engines.append(eng)
        name = f"w{w}"
        for b in eng.prompt(system):
            fleet.apply(name, b)
        budget, i = background_tokens, 0
        while budget > 0:
            length = min(budget, 4096 + (w * 7919 + i * 104729) % 28672)
            convo = system + tokens(length, seed + 1000 * w + i + 1)
            for b in eng.prompt(convo, start=SYSTEM):
                fleet.apply(name, b)
            budget -= length
            i += 1
    return fleet, engines


def place_request(
    fleet: FleetIndex, engines: list[Engine], n_tokens: int, seed: int
) -> tuple[list[int], list[int]]:
    """A follow-up request cached in part on a few workers; and a cold one. Both start
    with (up to half the prompt of) the system prompt every worker holds."""
    shared = min(SYSTEM, n_tokens // 2)
    system = tokens(SYSTEM, seed)[:shared]
    hot = system + tokens(n_tokens - shared, seed + 77)
    n = len(engines)
    for w, frac in ((0, 0.9), (n // 2, 0.9), (n // 3, 0.5), (n - 1, 0.5)):
        cut = int(n_tokens * frac)
        # from token 0: with sliding-window groups the shared prefix alone is no hit, so
        # vLLM computes (and stores) the whole prompt
        for b in engines[w].prompt(hot[:cut]):
            fleet.apply(f"w{w}", b)
    cold = system + tokens(n_tokens - shared, seed + 99)
    return hot, cold


def timed(fn: Callable[[], object], repeat: int, rounds: int = 3) -> dict[str, object]:
    """Median and p99 wall time, and median CPU time of this process, of the quietest of
    `rounds` rounds (the lowest median): the 2-core machine is shared with other jobs,
    which only ever add time. Every round's median is kept too."""
    best: dict[str, object] | None = None
    medians = []
    for _ in range(rounds):
        wall, cpu = [], []
        for _ in range(repeat):
            c0 = time.process_time_ns()
            t0 = time.perf_counter_ns()
            fn()
            wall.append((time.perf_counter_ns() - t0) / 1e6)
            cpu.append((time.process_time_ns() - c0) / 1e6)
        wall.sort()
        p99 = wall[min(len(wall) - 1, int(len(wall) * 0.99))]
        median = round(statistics.median(wall), 4)
        medians.append(median)
        result: dict[str, object] = {
            "median_ms": median,
            "p99_ms": round(p99, 4),
            "cpu_median_ms": round(statistics.median(cpu), 4),
        }
        if best is None or median < best["median_ms"]:  # type: ignore[operator]
            best = result
    assert best is not None
    best["round_medians_ms"] = medians
    return best


def score_row(
    fleet: FleetIndex, engines: list[Engine], n_tokens: int, repeat: int
) -> dict[str, object]:
    hot, cold = place_request(fleet, engines, n_tokens, seed=1)
    result = fleet.score(hot)
    reps = max(5, repeat * 8192 // max(n_tokens, 8192))
    keys = content_keys(hot)
    return {
        "prompt_tokens": n_tokens,
        "hot": timed(lambda: fleet.score(hot), reps),
        "cold": timed(lambda: fleet.score(cold), reps),
        "hash_only": timed(lambda: content_keys(hot), reps),
        "score_keys_hot": timed(lambda: fleet.score_keys(keys, n_tokens), reps),
        "best_hit": max(v for v in result.values() if v is not None),
    }


def bench_score(
    prompt_sizes: list[int],
    fleet_sizes: list[int],
    layouts: list[str],
    background_blocks: int,
    repeat: int,
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for layout_name in layouts:
        for n_workers in fleet_sizes:
            per_worker = max(8192, background_blocks * UNIT // n_workers)
            fleet, engines = build_fleet(n_workers, LAYOUTS[layout_name], per_worker, seed=1)
            for n_tokens in prompt_sizes:
                row: dict[str, object] = {
                    "layout": layout_name,
                    "workers": n_workers,
                    "background_tokens_per_worker": per_worker,
                    **score_row(fleet, engines, n_tokens, repeat),
                }
                rows.append(row)
                hot, cold, hashing = row["hot"], row["cold"], row["hash_only"]
                assert isinstance(hot, dict) and isinstance(cold, dict)
                assert isinstance(hashing, dict)
                print(
                    f"score {layout_name:6} workers={n_workers:5} tokens={n_tokens:6} "
                    f"hot median={hot['median_ms']:.3f} ms p99={hot['p99_ms']:.3f} ms "
                    f"cpu={hot['cpu_median_ms']:.3f} ms cold median={cold['median_ms']:.3f} ms "
                    f"(hash {hashing['median_ms']:.3f} ms) best hit={row['best_hit']}",
                    flush=True,
                )
    return rows


def bench_sharing(prompt_sizes: list[int], repeat: int) -> list[dict[str, object]]:
    """The router's junction-credit bookkeeping per request
    (kvroute.router.routing.prefix_sharing), next to
    hashing the same prompt. Conversations share a system prompt and the map holds each
    one's previous turn (the first three quarters of its prompt); each timed `note` records
    a different conversation's next turn, as the router does, so a quarter of its keys are
    new every time; `own_from` looks up where that turn's own history starts."""
    from kvroute.router.routing.prefix_sharing import PrefixSharing

    rows: list[dict[str, object]] = []
    rounds = 3  # timed()'s
    for n_tokens in prompt_sizes:
        shared = min(SYSTEM, n_tokens // 2)
        system = tokens(shared, 3)
        reps = max(5, repeat * 8192 // max(n_tokens, 8192))
        sessions = reps * rounds  # one turn per timed call
        turns = [
            (content_keys(system + tokens(n_tokens - shared, 700 + i)), f"s{i}")
            for i in range(sessions)
        ]
        sharing = PrefixSharing(UNIT, max_keys=sessions * (n_tokens // UNIT) + 1)
        for keys, owner in turns:
            sharing.note(keys[: len(keys) * 3 // 4], owner)  # the previous turn
        keys, owner = turns[0]
        own = sharing.own_from(keys, owner)
        assert own == shared, own  # its own history starts after the shared system prompt
        held = len(sharing)
        own_from = timed(partial(sharing.own_from, keys, owner), reps)
        hashing = timed(partial(content_keys, system + tokens(n_tokens - shared, 700)), reps)
        pending = iter(turns)
        note = timed(lambda: sharing.note(*next(pending)), reps, rounds)  # noqa: B023
        rows.append(
            {
                "prompt_tokens": n_tokens,
                "sessions": sessions,
                "remembered_keys": held,
                "note": note,
                "own_from": own_from,
                "hash_only": hashing,
            }
        )
        print(
            f"sharing tokens={n_tokens:6} keys held={held} "
            f"note={note['median_ms']:.4f} ms own_from={own_from['median_ms']:.4f} ms "
            f"(hash {hashing['median_ms']:.3f} ms)",
            flush=True,
        )
    return rows


def bench_ingest(total_blocks: int, layout_name: str) -> dict[str, object]:
    """Stored blocks per second (hashes in STORE events, all groups) through apply()."""
    eng = Engine(LAYOUTS[layout_name])
    batches: list[pb.KvEventBatch] = []
    i = 0
    while eng.stored_blocks < total_blocks:
        batches.extend(eng.prompt(tokens(SYSTEM + 30720, 500 + i), start=0))
        i += 1
    fleet = FleetIndex()
    t0 = time.perf_counter()
    for b in batches:
        fleet.apply("w", b)
    elapsed = time.perf_counter() - t0
    rate = eng.stored_blocks / elapsed
    print(f"ingest {layout_name}: {eng.stored_blocks} blocks in {elapsed:.2f} s = {rate:,.0f}/s")
    return {"layout": layout_name, "blocks": eng.stored_blocks, "seconds": elapsed, "rate": rate}


def bench_memory(total_blocks: int, n_workers: int, layout_name: str) -> dict[str, object]:
    """Bytes per (worker, group, block) held, measured with tracemalloc."""
    per_worker = total_blocks // n_workers
    engines = [Engine(LAYOUTS[layout_name]) for _ in range(n_workers)]
    plans = []
    system = tokens(SYSTEM, 3)
    for w, eng in enumerate(engines):
        batches = eng.prompt(system)
        i = 0
        while eng.stored_blocks < per_worker:
            batches += eng.prompt(system + tokens(30720, 9000 + 1000 * w + i), start=SYSTEM)
            i += 1
        plans.append(batches)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    fleet = FleetIndex()
    for w, batches in enumerate(plans):
        for b in batches:
            fleet.apply(f"w{w}", b)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = sum(sum(fleet.stats(f"w{w}").blocks_per_group.values()) for w in range(n_workers))
    per_entry = (after - before) / entries
    print(
        f"memory {layout_name} workers={n_workers}: {entries} (worker, group, block) entries, "
        f"{(after - before) / 2**20:.1f} MiB, {per_entry:.1f} bytes each"
    )
    return {
        "layout": layout_name,
        "workers": n_workers,
        "entries": entries,
        "bytes": after - before,
        "bytes_per_entry": round(per_entry, 1),
    }


def markdown(result: dict[str, object]) -> str:
    lines = [
        "# Indexer benchmark",
        "",
        f"`{result['command']}` on {result['machine']} (Python {result['python']}).",
        "",
        "## Score time (ms)",
        "",
        "Hot: a follow-up request cached deep on a few workers; cold: a new conversation",
        "sharing only the system prompt. Wall-clock median and p99, and the median CPU time",
        "of the process, of the quietest of 3 rounds (the 2-core machine is shared with",
        "other jobs). Hashing: the request's content keys alone (included in the scores).",
        "",
        "| layout | workers | prompt tokens | hot median | hot p99 | hot CPU | cold median "
        "| hashing |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["score"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['layout']} | {r['workers']} | {r['prompt_tokens']} | "
            f"{r['hot']['median_ms']:.3f} | {r['hot']['p99_ms']:.3f} | "
            f"{r['hot']['cpu_median_ms']:.3f} | "
            f"{r['cold']['median_ms']:.3f} | {r['hash_only']['median_ms']:.3f} |"
        )
    lines += [
        "",
        "## Junction-credit bookkeeping (ms)",
        "",
        "What the router adds per request on hybrid fleets",
        "(`kvroute.router.routing.prefix_sharing`): a conversation's next turn noted as asked",
        "for by it (a quarter of its keys new, each",
        "call a different conversation), and the lookup of where its own history starts, with",
        "every conversation's previous turn held; hashing the same prompt for scale. Medians",
        "of the quietest of 3 rounds.",
        "",
        "| prompt tokens | conversations | keys held | note | own_from | hashing |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["sharing"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['prompt_tokens']} | {r['sessions']} | {r['remembered_keys']} | "
            f"{r['note']['median_ms']:.4f} | {r['own_from']['median_ms']:.4f} | "
            f"{r['hash_only']['median_ms']:.3f} |"
        )
    lines += ["", "## Ingest", "", "| layout | blocks | blocks/s |", "|---|---|---|"]
    for r in result["ingest"]:  # type: ignore[attr-defined]
        lines.append(f"| {r['layout']} | {r['blocks']} | {r['rate']:,.0f} |")
    lines += [
        "",
        "## Memory",
        "",
        "| layout | workers | (worker, group, block) entries | bytes per entry |",
        "|---|---|---|---|",
    ]
    for r in result["memory"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['layout']} | {r['workers']} | {r['entries']} | {r['bytes_per_entry']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.smoke:
        prompts, fleets, layouts = [1024, 8192], [1, 4, 16], ["full", "hybrid"]
        background, repeat, ingest, memory = 2048, 10, 20_000, [(20_000, 1), (20_000, 8)]
    else:
        prompts, fleets, layouts = (
            [1024, 8192, 32768, 131072],
            [1, 4, 16, 256, 1024],
            [
                "full",
                "hybrid",
            ],
        )
        background, repeat, ingest = 1_000_000, 200, 1_000_000
        memory = [(1_000_000, 1), (1_000_000, 64)]
    result: dict[str, object] = {
        "command": "python -m bench.index_bench" + (" --smoke" if args.smoke else ""),
        "machine": f"{platform.machine()} x{os.cpu_count()}",
        "python": platform.python_version(),
        "score": bench_score(prompts, fleets, layouts, background, repeat),
        "sharing": bench_sharing(prompts, repeat),
        "ingest": [bench_ingest(ingest, name) for name in ("full", "hybrid")],
        "memory": [bench_memory(n, w, name) for n, w in memory for name in ("full", "hybrid")],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "index-smoke" if args.smoke else "index"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    index_plot(result, args.out / f"{stem}.png")
    print(f"wrote {args.out / stem}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
