"""Bridge benchmark: blocks/s decoded + converted on one core, and snapshot-state memory.

    python -m bench.bridge_bench            # full run (about a minute)
    python -m bench.bridge_bench --smoke    # seconds; same code paths
    python -m bench.bridge_bench --baseline main   # also kvroute/bridge/state.py of a git ref,
                                                   # interleaved, printed side by side

Prints a table and writes bench/results/bridge.json. Workloads use 16-token blocks, random
64-bit hashes (vLLM's int mode) and vLLM 0.33 wire payloads unless said otherwise:
- prefill: one full-attention store of 32 blocks per batch (a 512-token prefill chunk);
- hybrid: the same plus a sliding-window store (2 hashes) and a Mamba store (1 hash) over the
  same span, as vLLM sends for a hybrid model;
- decode: one single-block store per batch (one block completed during decoding: the worst
  case, per-batch costs dominate);
- decode-8: eight single-block stores of different requests per batch (a busy decode step);
- prefill-0.23: the prefill workload in the array-like wire format of vLLM <= 0.23.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvroute.bridge import vllm_schema as s
from kvroute.bridge.convert import ConvertStats, convert_batch
from kvroute.bridge.state import EngineState
from kvroute.proto.events_pb2 import KvEventBatch, SubscribeResponse

BLOCK = 16
RESULTS = Path(__file__).resolve().parent / "results" / "bridge.json"


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def make_payloads(
    workload: str, batches: int, *, vocab: int = 150_000, seed: int = 0
) -> tuple[list[bytes], int]:
    """Encoded engine payloads for a workload, and the stored blocks they carry."""
    rng = random.Random(seed)
    version = "0.23" if workload.endswith("0.23") else "0.33"
    payloads, blocks = [], 0
    parent: int | None = None
    parents: list[int | None] = [None] * 8
    for index in range(batches):
        events: list[s.Event] = []
        if workload == "decode-8":
            for lane in range(8):
                block_hash = rng.getrandbits(64)
                if index % 64 == 0:
                    parents[lane] = None
                events.append(
                    s.BlockStored(
                        [block_hash],
                        parents[lane],
                        _tokens(rng, BLOCK, vocab),
                        BLOCK,
                        group_idx=0,
                        kv_cache_spec_kind="full_attention",
                    )
                )
                parents[lane] = block_hash
            blocks += 8
            payloads.append(s.encode_batch(time.time(), events, 0, version))
            continue
        if workload == "decode":
            hashes = [rng.getrandbits(64)]
            if index % 64 == 0:
                parent = None  # a new request every 64 blocks
        else:
            hashes = [rng.getrandbits(64) for _ in range(32)]
            if index % 4 == 0:
                parent = None  # 128-block prompts in 4 chunks
        tokens = _tokens(rng, BLOCK * len(hashes), vocab)
        events.append(
            s.BlockStored(
                hashes, parent, tokens, BLOCK, group_idx=0, kv_cache_spec_kind="full_attention"
            )
        )
        if workload == "hybrid":
            events.append(
                s.BlockStored(
                    hashes[-2:],
                    parent,
                    tokens,
                    BLOCK,
                    group_idx=1,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=32,
                )
            )
            events.append(
                s.BlockStored(
                    hashes[-1:], parent, tokens, BLOCK, group_idx=2, kv_cache_spec_kind="mamba"
                )
            )
        blocks += sum(len(e.block_hashes) for e in events if isinstance(e, s.BlockStored))
        payloads.append(s.encode_batch(time.time(), events, 0, version))
        parent = hashes[-1]
    return payloads, blocks


def _timed(fn: Callable[[], None], min_seconds: float) -> tuple[float, int]:
    # CPU time of this (single-threaded) process: blocks per second of one core, less
    # sensitive to other processes on a shared machine than wall time.
    rounds, start = 0, time.process_time()
    while True:
        fn()
        rounds += 1
        elapsed = time.process_time() - start
        if elapsed >= min_seconds:
            return elapsed, rounds


def baseline_state(ref: str) -> type[EngineState]:
    """`EngineState` of kvroute/bridge/state.py at git ref `ref` (its other imports: this
    tree's)."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(
        ["git", "-C", str(root), "show", f"{ref}:kvroute/bridge/state.py"],
        check=True,
        capture_output=True,
    ).stdout
    with tempfile.NamedTemporaryFile(suffix=".py", delete=False) as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location("baseline_state", file.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    os.unlink(file.name)
    state: type[EngineState] = module.EngineState
    return state


def throughput(
    workload: str, batches: int, min_seconds: float, state_type: type[EngineState] = EngineState
) -> dict[str, Any]:
    """Stored blocks per second: decode+convert, and the whole per-batch path of the bridge
    (decode, convert, apply to the snapshot state, serialize the response once)."""
    payloads, blocks = make_payloads(workload, batches)
    decoder, stats = s.BatchDecoder(), ConvertStats()

    def decode_convert() -> None:
        for seq, payload in enumerate(payloads):
            convert_batch(decoder.decode(payload), seq, dp_rank=0, stats=stats)

    def full_path() -> None:
        state = state_type(max_blocks=10**9)
        for seq, payload in enumerate(payloads):
            batch = state.apply(convert_batch(decoder.decode(payload), seq, dp_rank=0))
            SubscribeResponse(batch=batch).SerializeToString()

    decode_convert()  # warm up
    elapsed, rounds = _timed(decode_convert, min_seconds)
    full_elapsed, full_rounds = _timed(full_path, min_seconds)
    return {
        "workload": workload,
        "blocks_per_batch": blocks / batches,
        "decode_convert_blocks_per_s": round(blocks * rounds / elapsed),
        "decode_convert_batches_per_s": round(batches * rounds / elapsed),
        "full_path_blocks_per_s": round(blocks * full_rounds / full_elapsed),
    }


def memory(
    workload: str, batches: int, vocab: int, state_type: type[EngineState] = EngineState
) -> dict[str, Any]:
    """Bytes per stored block held by the snapshot state (tracemalloc), and the cost of
    building a snapshot of it."""
    payloads, _ = make_payloads(workload, batches, vocab=vocab, seed=1)
    decoder = s.BatchDecoder()
    converted: list[KvEventBatch] = [
        convert_batch(decoder.decode(p), seq, dp_rank=0) for seq, p in enumerate(payloads)
    ]
    gc.collect()
    tracemalloc.start()
    state = state_type(max_blocks=10**9)
    base = tracemalloc.get_traced_memory()[0]
    for batch in converted:
        state.apply(batch)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    start = time.perf_counter()
    snapshot = state.snapshot(stream_id="bench", reason="initial")
    wire = SubscribeResponse(snapshot=snapshot).SerializeToString()
    build = time.perf_counter() - start
    return {
        "workload": workload,
        "vocab": vocab,
        "stored_blocks": state.blocks,
        "bytes_per_block": round(used / state.blocks, 1),
        "snapshot_build_s": round(build, 3),
        "snapshot_wire_bytes_per_block": round(len(wire) / state.blocks, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, runs in seconds")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--baseline",
        metavar="GIT_REF",
        help="also measure kvroute/bridge/state.py of this ref, interleaved (before/after)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="throughput runs per case; medians reported"
    )
    args = parser.parse_args(argv)
    if args.baseline:
        return compare(args)
    batches, seconds = (40, 0.2) if args.smoke else (400, 3.0)
    mem_batches = 60 if args.smoke else 3_000
    rates = [
        throughput(w, batches if w != "decode" else batches * 8, seconds)
        for w in ("prefill", "hybrid", "decode", "decode-8", "prefill-0.23")
    ]
    # Several sizes: a Python dict's load factor moves the per-entry cost by ~20 bytes.
    sizes = [mem_batches, mem_batches * 2 // 3] if not args.smoke else [mem_batches]
    mems = [
        memory(w, n if w != "decode" else n * 32, vocab)
        for w, vocab in (
            ("prefill", 150_000),
            ("prefill", 32_000),
            ("hybrid", 150_000),
            ("decode", 150_000),
        )
        for n in sizes
    ]
    result = {
        "benchmark": "bridge",
        "smoke": args.smoke,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "block_tokens": BLOCK,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "targets": {"decode_convert_blocks_per_s": 200_000, "bytes_per_block": 150},
        "throughput": rates,
        "memory": mems,
    }
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine)\n")
    print(f"{'workload':<14}{'blocks/batch':>13}{'decode+convert/s':>18}{'full path/s':>14}")
    for r in rates:
        print(
            f"{r['workload']:<14}{r['blocks_per_batch']:>13.0f}"
            f"{r['decode_convert_blocks_per_s']:>18,}{r['full_path_blocks_per_s']:>14,}"
        )
    print(f"\n{'workload':<10}{'vocab':>8}{'blocks':>10}{'B/block':>9}{'snapshot s':>12}")
    for m in mems:
        print(
            f"{m['workload']:<10}{m['vocab']:>8}{m['stored_blocks']:>10}"
            f"{m['bytes_per_block']:>9}{m['snapshot_build_s']:>12}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def compare(args: argparse.Namespace) -> int:
    """Before (`--baseline` ref) and after (this tree), interleaved in one run: medians."""
    before_type = baseline_state(args.baseline)
    batches, seconds = (40, 0.2) if args.smoke else (400, 3.0)
    mem_batches = 60 if args.smoke else 3_000
    sizes = [mem_batches, mem_batches * 2 // 3] if not args.smoke else [mem_batches]
    mems: list[dict[str, Any]] = []
    for workload, vocab in (
        ("prefill", 150_000),
        ("prefill", 32_000),
        ("hybrid", 150_000),
        ("decode", 150_000),
    ):
        for size in sizes:
            count = size if workload != "decode" else size * 32
            before = memory(workload, count, vocab, before_type)
            after = memory(workload, count, vocab, EngineState)
            mems.append({"workload": workload, "vocab": vocab, "before": before, "after": after})
    rates: list[dict[str, Any]] = []
    for workload in ("prefill", "hybrid", "decode", "decode-8", "prefill-0.23"):
        n = batches if workload != "decode" else batches * 8
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for _ in range(args.repeat):
            for key, state_type in (("before", before_type), ("after", EngineState)):
                runs[key].append(throughput(workload, n, seconds, state_type))
        rates.append(
            {
                "workload": workload,
                **{
                    key: {
                        field: statistics.median(r[field] for r in results)
                        for field in ("decode_convert_blocks_per_s", "full_path_blocks_per_s")
                    }
                    for key, results in runs.items()
                },
            }
        )
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine)")
    print(f"before = kvroute/bridge/state.py at {args.baseline}; after = this tree\n")
    print(f"{'workload':<10}{'vocab':>8}{'blocks':>8}{'B/block before':>16}{'after':>8}"
          f"{'snapshot s before':>19}{'after':>7}")  # fmt: skip
    for m in mems:
        b, a = m["before"], m["after"]
        print(
            f"{m['workload']:<10}{m['vocab']:>8}{a['stored_blocks']:>8}"
            f"{b['bytes_per_block']:>16}{a['bytes_per_block']:>8}"
            f"{b['snapshot_build_s']:>19}{a['snapshot_build_s']:>7}"
        )
    print(f"\nmedian of {args.repeat} runs, blocks/s")
    print(f"{'workload':<14}{'decode+convert before':>22}{'after':>11}"
          f"{'full path before':>18}{'after':>10}")  # fmt: skip
    for r in rates:
        b, a = r["before"], r["after"]
        print(
            f"{r['workload']:<14}{b['decode_convert_blocks_per_s']:>22,.0f}"
            f"{a['decode_convert_blocks_per_s']:>11,.0f}"
            f"{b['full_path_blocks_per_s']:>18,.0f}{a['full_path_blocks_per_s']:>10,.0f}"
        )
    if args.out != RESULTS:
        result = {"benchmark": "bridge-compare", "baseline": args.baseline, "smoke": args.smoke,
                  "repeat": args.repeat, "memory": mems, "throughput": rates}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
