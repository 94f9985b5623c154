"""Tokenization benchmark: exact chat ids for 1K / 8K / 32K-token conversations.

    python -m bench.tokenize_bench            # full run (a minute or two)
    python -m bench.tokenize_bench --smoke    # seconds; same code paths

Uses the simulated engine's model directory (kvroute/sim/model: byte-level BPE, ChatML template with
tools). Conversations alternate user and assistant turns of about 250 tokens of generated text.
Measured, per size:

- cold: render + tokenize the whole conversation with an empty prefix cache (split into the
  Jinja render and the encode); the tokenizer is loaded and has seen text before, as in a
  running router (a freshly loaded `tokenizers` BPE also has an empty word cache: its first
  encode is several ms slower);
- multi-turn: the conversation grows turn by turn through one tokenizer; the time of the final
  turn (its history is in the prefix cache) and how many tokens were encoded for it;
- executors: the encode of the cold text run on the loop thread itself, in a pool of 1 or 2
  threads (`encode_batch_fast`, which releases the GIL), or in a pool of 2 processes (text sent
  to a worker process that holds the tokenizer, ids sent back), one request at a time and 8 at
  once; plus the event loop's worst stall meanwhile (a ticker coroutine every 1 ms);
- end to end: `Tokenizers.token_ids` (thread pool + prefix cache), cold and next turn;
- completions (Mooncake-shaped, no chat template): a prompt of 22 blocks of 512 tokens seen
  before, then prompts that extend it by one new block of ~750 tokens (the shape of the
  public Mooncake conversation trace: ~12K-token prompts extending earlier ones). Cold (empty
  prefix cache) and extending (the earlier prompt's ids cached), through `LocalTokenizer`
  (wall and thread CPU time) and `Tokenizers.token_ids` (end to end), against a full encode;
  and departing: the earlier prompt ends in a partial block that the later prompts replace
  (how a Mooncake trace records a conversation's previous turn), so the later prompts share
  all of it but its last few hundred tokens.

Prints a table and writes bench/results/tokenize.json and tokenize.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
from tokenizers import Tokenizer

from kvroute.router.edge.json_input import decode_json, has_long_digit_run
from kvroute.router.tokenize import Tokenizers, TokenizerSpec
from kvroute.router.tokenize.local import LocalTokenizer
from kvroute.router.tokenize.prefix_cache import PrefixCache
from kvroute.testbed.textgen import TokenSpace
from kvroute.testbed.trace import MOONCAKE_BLOCK_TOKENS, MooncakeRecord, from_mooncake

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "kvroute" / "sim" / "model"
RESULTS = Path(__file__).resolve().parent / "results" / "tokenize.json"
TURN_TOKENS = 250


def _word(rng: random.Random) -> str:
    syllables = ["ka", "ro", "ute", "cache", "pre", "fix", "to", "ken", "wor", "ker", "lo", "ad",
                 "hy", "brid", "win", "dow", "ma", "mba", "st", "ate"]  # fmt: skip
    w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
    roll = rng.random()
    if roll < 0.05:
        return str(rng.randint(0, 99999))
    if roll < 0.10:
        return w.capitalize() + rng.choice([".", ",", ":", "?"])
    return w


def make_text(rng: random.Random, tokens: int, tok: Tokenizer) -> str:
    """Generated text of about `tokens` tokens for this tokenizer."""
    words: list[str] = []
    text = ""
    while True:
        words.extend(_word(rng) for _ in range(40))
        text = " ".join(words)
        n = len(tok.encode(text, add_special_tokens=False).ids)
        if n >= tokens:
            return text


def make_conversation(total_tokens: int, seed: int, tok: Tokenizer) -> list[dict[str, str]]:
    """System prompt, then user/assistant turns, ending with a user turn: ~total_tokens."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 4}]
    turns = max(1, (total_tokens - 40) // TURN_TOKENS)
    if turns % 2 == 0:
        turns -= 1
    for i in range(max(1, turns)):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": make_text(rng, TURN_TOKENS, tok)})
    return messages


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _new_local() -> LocalTokenizer:
    return LocalTokenizer.from_spec(
        TokenizerSpec("local", path=str(MODEL)), cache=PrefixCache(4096, 1 << 28)
    )


# ---- process pool worker ------------------------------------------------------------------

_WORKER_TOKENIZER: list[Tokenizer] = []  # one per worker process (set by the initializer)


def _worker_init(path: str) -> None:
    _WORKER_TOKENIZER.append(Tokenizer.from_file(path))


def _worker_encode(text: str) -> list[int]:
    return list(_WORKER_TOKENIZER[0].encode_batch_fast([text], add_special_tokens=False)[0].ids)


def _thread_encode(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode_batch_fast([text], add_special_tokens=False)[0].ids)


async def _executor_run(
    executor: Executor,
    fn: Callable[..., list[int]],
    args: Sequence[Any],
    concurrent: int,
    rounds: int,
) -> tuple[float, float]:
    """(median seconds per request, worst event-loop stall in seconds) for `concurrent` requests
    at once, `rounds` times."""
    loop = asyncio.get_running_loop()
    stall = 0.0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall = max(stall, now - last - 0.001)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.005)
    stall = 0.0
    per_request: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await asyncio.gather(
            *(loop.run_in_executor(executor, fn, *args) for _ in range(concurrent))
        )
        per_request.append((time.perf_counter() - t0) / concurrent)
    done.set()
    await tick
    return statistics.median(per_request), stall


class _Inline(Executor):
    """Runs the work on the calling (event loop) thread: the baseline the pools avoid."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        from concurrent.futures import Future

        fut: Future[Any] = Future()
        fut.set_result(fn(*args, **kwargs))
        return fut


def bench_executors(text: str, reps: int) -> dict[str, Any]:
    """Encode of `text` through: the loop thread itself, 1 and 2 threads, 2 processes."""
    tok_path = str(MODEL / "tokenizer.json")
    tok = Tokenizer.from_file(tok_path)
    out: dict[str, Any] = {}

    def measure(
        name: str, executor: Executor, fn: Callable[..., list[int]], args: tuple[Any, ...]
    ) -> None:
        one, stall1 = asyncio.run(_executor_run(executor, fn, args, 1, reps))
        eight, stall8 = asyncio.run(_executor_run(executor, fn, args, 8, max(1, reps // 2)))
        out[name] = {
            "one_ms": one * 1e3,
            "eight_ms_per_request": eight * 1e3,
            "loop_stall_ms": max(stall1, stall8) * 1e3,
        }

    measure("inline", _Inline(), _thread_encode, (tok, text))
    for n in (1, 2):
        with ThreadPoolExecutor(n) as threads:
            measure(f"thread{n}", threads, _thread_encode, (tok, text))
    with ProcessPoolExecutor(2, initializer=_worker_init, initargs=(tok_path,)) as procs:
        list(procs.map(_worker_encode, ["warm up", "warm up"]))
        measure("process2", procs, _worker_encode, (text,))
    return out


async def _end_to_end(messages: list[dict[str, str]], reps: int) -> dict[str, float]:
    cold: list[float] = []
    warm: list[float] = []
    for _ in range(reps):
        tz = Tokenizers({"m": TokenizerSpec("local", path=str(MODEL))}, threads=2)
        await tz.start()
        t0 = time.perf_counter()
        await tz.token_ids("m", "/v1/chat/completions", {"model": "m", "messages": messages}, None)
        cold.append(time.perf_counter() - t0)
        nxt = [
            *messages,
            {"role": "assistant", "content": "Sure."},
            {"role": "user", "content": "More please."},
        ]
        t0 = time.perf_counter()
        await tz.token_ids("m", "/v1/chat/completions", {"model": "m", "messages": nxt}, None)
        warm.append(time.perf_counter() - t0)
        await tz.aclose()
    return {"cold_ms": statistics.median(cold) * 1e3, "next_turn_ms": statistics.median(warm) * 1e3}


def bench_size(total: int, reps: int) -> dict[str, Any]:
    base_tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    messages = make_conversation(total, seed=total, tok=base_tok)
    body = {"model": "m", "messages": messages}
    probe = _new_local()
    text, _ = probe.render_chat(body)
    n_tokens = len(probe.encoder.encode(text))

    render_s = _median_time(lambda: probe.render_chat(body), reps)
    encode_s = _median_time(lambda: probe.encoder.encode(text), reps)

    def cold() -> None:
        probe.cache.clear()  # an empty prefix cache (the tokenizer itself stays loaded and warm)
        probe.chat_ids(body)

    cold_s = _median_time(cold, reps)

    # multi-turn: each request adds the assistant's answer and the next user turn, as a chat
    # client does; the time of the last request, whose history is in the prefix cache
    last_times: list[float] = []
    last_encoded = 0
    tok = _new_local()
    for _ in range(reps):
        tok.cache.clear()
        for end in range(2, len(messages) + 1, 2):
            t0 = time.perf_counter()
            ids, stats = tok.chat_ids({"model": "m", "messages": messages[:end]})
            elapsed = time.perf_counter() - t0
        last_times.append(elapsed)
        last_encoded = stats.encoded_tokens
    assert ids == probe.encoder.encode(text)

    result: dict[str, Any] = {
        "tokens": n_tokens,
        "chars": len(text),
        "messages": len(messages),
        "render_ms": render_s * 1e3,
        "encode_ms": encode_s * 1e3,
        "cold_ms": cold_s * 1e3,
        "multi_turn_last_ms": statistics.median(last_times) * 1e3,
        "multi_turn_last_encoded_tokens": last_encoded,
        "executors": bench_executors(text, reps),
        "end_to_end": asyncio.run(_end_to_end(messages, max(1, reps // 2))),
    }
    return result


# ---- completions: a Mooncake-shaped prompt extending an earlier one -------------------------

EARLIER_BLOCKS = 22  # 11,264 tokens
NEW_TOKENS = 750
# The earlier prompt's last block when it departs: partly filled, with a hash id of its own,
# as a Mooncake trace records a conversation's previous turn.
PARTIAL_TOKENS = 300


def mooncake_prompts(
    reps: int, blocks: int = EARLIER_BLOCKS, partial: int = 0
) -> tuple[str, list[str]]:
    """(earlier prompt, `reps` later prompts): each later one is the earlier one's `blocks`
    full blocks plus new blocks of its own (hash ids as in a Mooncake trace, text from the
    sim's vocabulary). With `partial`, the earlier prompt ends with a block of that many
    tokens that the later ones do not share (they depart from it there)."""
    space = TokenSpace.from_tokenizer_file(MODEL / "tokenizer.json")
    ids = tuple(range(blocks))
    n = blocks * MOONCAKE_BLOCK_TOKENS
    records = [MooncakeRecord(0.0, n + partial, 1, (*ids, 999) if partial else ids)]
    new_blocks = -(-NEW_TOKENS // MOONCAKE_BLOCK_TOKENS)
    records += [
        MooncakeRecord(
            float(i + 1),
            n + NEW_TOKENS,
            1,
            (*ids, *range(1000 + i * new_blocks, 1000 + (i + 1) * new_blocks)),
        )
        for i in range(reps)
    ]
    prompts = [r.prompt for r in sorted(from_mooncake(records, space), key=lambda r: r.id)]
    return prompts[0], prompts[1:]


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall seconds, this thread's CPU seconds, result)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    out = fn()
    return time.perf_counter() - w0, time.thread_time() - c0, out


async def _completions_end_to_end(earlier: str, later: list[str]) -> dict[str, float]:
    """Medians through `Tokenizers.token_ids`: wall ms, and the process's CPU ms (every
    thread: the event loop's and the pool's) for cold and extending prompts."""
    spec = {"m": TokenizerSpec("local", path=str(MODEL))}
    times: dict[str, list[float]] = {"cold": [], "cold_cpu": [], "ext": [], "ext_cpu": []}

    async def one(tz: Tokenizers, prompt: str, key: str) -> None:
        w0, c0 = time.perf_counter(), time.process_time()
        await tz.token_ids("m", "/v1/completions", {"model": "m", "prompt": prompt}, None)
        times[key].append(time.perf_counter() - w0)
        times[key + "_cpu"].append(time.process_time() - c0)

    for prompt in later:
        tz = Tokenizers(spec, threads=2)
        await tz.start()
        await one(tz, prompt, "cold")
        await tz.aclose()
    tz = Tokenizers(spec, threads=2)
    await tz.start()
    await tz.token_ids("m", "/v1/completions", {"model": "m", "prompt": earlier}, None)
    for prompt in later:
        await one(tz, prompt, "ext")
    await tz.aclose()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "cold_ms": med["cold"],
        "cold_cpu_ms": med["cold_cpu"],
        "extending_ms": med["ext"],
        "extending_cpu_ms": med["ext_cpu"],
    }


def bench_completions(reps: int, blocks: int = EARLIER_BLOCKS) -> dict[str, Any]:
    """Cold and extending completions prompts (module docstring)."""
    earlier, later = mooncake_prompts(reps, blocks)
    tok = _new_local()
    full = [_timed(lambda p=p: tok.encoder.encode(p, add_special_tokens=True)) for p in later]
    cold = []
    for p in later:
        tok.cache.clear()
        cold.append(_timed(lambda p=p: tok.text_ids(p, True)))
    tok.cache.clear()
    tok.text_ids(earlier, True)
    warm = [_timed(lambda p=p: tok.text_ids(p, True)) for p in later]
    for (_, _, (ids, _)), (_, _, expected) in zip(warm, full, strict=True):
        assert ids == expected  # the point: exact ids
    stats = [w[2][1] for w in warm]
    # departing: the earlier prompt ends in a partial block the later ones replace
    dep_earlier, dep_later = mooncake_prompts(len(later), blocks, PARTIAL_TOKENS)
    tok.cache.clear()
    tok.text_ids(dep_earlier, True)
    dep = [_timed(lambda p=p: tok.text_ids(p, True)) for p in dep_later]
    for (_, _, (ids, _)), p in zip(dep, dep_later, strict=True):
        assert ids == tok.encoder.encode(p, add_special_tokens=True)
    dep_stats = [d[2][1] for d in dep]
    body = bench_body(later)
    return {
        "prompt_tokens": statistics.median(len(f[2]) for f in full),
        "earlier_tokens": len(tok.encoder.encode(earlier, add_special_tokens=True)),
        "chars": statistics.median(len(p) for p in later),
        "full_encode_ms": statistics.median(f[0] for f in full) * 1e3,
        "cold_ms": statistics.median(c[0] for c in cold) * 1e3,
        "extending_ms": statistics.median(w[0] for w in warm) * 1e3,
        "extending_cpu_ms": statistics.median(w[1] for w in warm) * 1e3,
        "extending_encoded_tokens": statistics.median(s.encoded_tokens for s in stats),
        "extending_hits": sum(s.cache_hit for s in stats),
        "departing_ms": statistics.median(d[0] for d in dep) * 1e3,
        "departing_cpu_ms": statistics.median(d[1] for d in dep) * 1e3,
        "departing_encoded_tokens": statistics.median(s.encoded_tokens for s in dep_stats),
        "departing_hits": sum(s.cache_hit for s in dep_stats),
        "partial_tokens": PARTIAL_TOKENS,
        "reps": len(later),
        "earlier_blocks": blocks,
        "end_to_end": asyncio.run(_completions_end_to_end(earlier, later)),
        "body": body,
    }


def bench_body(prompts: Sequence[str], rounds: int = 5) -> dict[str, Any]:
    """The router's decoding of such a prompt's request body (`decode_json`), the JSON decode
    alone, and its check for long digit runs against the regex it replaced, side by side."""
    bodies = [
        json.dumps({"model": "m", "prompt": p, "max_tokens": 256, "stream": True}).encode()
        for p in prompts
    ]
    regex = re.compile(rb"[0-9]{20}")

    def per_body(fn: Callable[[bytes], Any]) -> float:
        runs = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for b in bodies:
                fn(b)
            runs.append((time.perf_counter() - t0) / len(bodies))
        return statistics.median(runs) * 1e3

    return {
        "bytes": statistics.median(len(b) for b in bodies),
        "msgspec_decode_ms": per_body(msgspec.json.decode),
        "decode_json_ms": per_body(decode_json),
        "digit_check_ms": per_body(has_long_digit_run),
        "digit_regex_ms": per_body(regex.search),
    }


EXECUTORS = ("inline", "thread1", "thread2", "process2")


def _markdown(
    results: list[dict[str, Any]], completions: dict[str, Any], smoke: bool, load: str
) -> str:
    lines = [
        "# Tokenization (kvroute/router/tokenize)" + (" — smoke run" if smoke else ""),
        "",
        "Model: kvroute/sim/model (byte-level BPE, ChatML template).",
        f"Machine: {os.cpu_count()} cores, Python {platform.python_version()}. Medians.",
        "",
        "| tokens | render ms | encode ms | cold ms | next turn (cached) ms "
        "| encoded on next turn | end to end cold / next turn ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        e = r["end_to_end"]
        lines.append(
            f"| {r['tokens']} | {r['render_ms']:.2f} | {r['encode_ms']:.2f} | {r['cold_ms']:.2f} | "
            f"{r['multi_turn_last_ms']:.2f} | {r['multi_turn_last_encoded_tokens']} | "
            f"{e['cold_ms']:.2f} / {e['next_turn_ms']:.2f} |"
        )
    lines += [
        "",
        "Where the encode runs (ms; one request alone / per request with 8 at once / worst "
        "event-loop stall meanwhile):",
        "",
        "| tokens | " + " | ".join(EXECUTORS) + " |",
        "|---:|" + "---:|" * len(EXECUTORS),
    ]
    for r in results:
        cells = []
        for name in EXECUTORS:
            x = r["executors"][name]
            cells.append(
                f"{x['one_ms']:.1f} / {x['eight_ms_per_request']:.1f} / {x['loop_stall_ms']:.1f}"
            )
        lines.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    c, e, b = completions, completions["end_to_end"], completions["body"]
    lines += [
        "",
        "Completions prompt extending an earlier one (Mooncake-shaped, no chat template; "
        f"medians of {c['reps']}):",
        "",
        "| prompt tokens | earlier prompt tokens | full encode ms | cold ms | extending ms "
        "(CPU ms) | encoded when extending | end to end cold / extending ms (CPU ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {c['prompt_tokens']} | {c['earlier_tokens']} | {c['full_encode_ms']:.2f} | "
        f"{c['cold_ms']:.2f} | {c['extending_ms']:.2f} ({c['extending_cpu_ms']:.2f}) | "
        f"{c['extending_encoded_tokens']:.0f} | {e['cold_ms']:.2f} ({e['cold_cpu_ms']:.2f}) / "
        f"{e['extending_ms']:.2f} ({e['extending_cpu_ms']:.2f}) |",
        "",
        f"Departing: the earlier prompt ends in a block of {c['partial_tokens']} tokens with an "
        "id of its own, which the later prompts replace (a Mooncake trace's previous turn):",
        "",
        "| cold ms | departing ms (CPU ms) | encoded when departing | cache hits |",
        "|---:|---:|---:|---:|",
        f"| {c['cold_ms']:.2f} | {c['departing_ms']:.2f} ({c['departing_cpu_ms']:.2f}) | "
        f"{c['departing_encoded_tokens']:.0f} | {c['departing_hits']} of {c['reps']} |",
        "",
        "Request body: such a prompt as a streamed completions body, decoded as the router "
        "decodes every client body (`decode_json`, with its check for integers beyond 64 "
        "bits), and that check against the regex it replaced (medians of 5 rounds):",
        "",
        "| body bytes | msgspec decode alone ms | decode_json ms | digit-run check ms "
        "| regex ms (before) |",
        "|---:|---:|---:|---:|---:|",
        f"| {b['bytes']:.0f} | {b['msgspec_decode_ms']:.3f} | {b['decode_json_ms']:.3f} | "
        f"{b['digit_check_ms']:.3f} | {b['digit_regex_ms']:.3f} |",
        "",
        "- cold: render + encode with an empty prefix cache; next turn: the last turn of a "
        "conversation grown turn by turn through one tokenizer (history from the prefix cache).",
        "- inline: on the event loop thread (what the pools avoid); thread1/thread2: a pool "
        "of 1 or 2 threads (`encode_batch_fast` releases the GIL); process2: 2 worker "
        "processes holding the tokenizer (text and ids pickled across). The loop stall with "
        "a pool is CPU oversubscription (pool workers + the loop on 2 cores), not the GIL.",
        f"- completions: {c['earlier_blocks']} blocks of 512 tokens seen (the earlier prompt), "
        f"then that prompt plus {NEW_TOKENS} new tokens (new blocks), with add_special_tokens "
        "(BOS); cold: empty prefix cache; extending: the earlier prompt's ids cached, so only "
        "the text after the earlier prompt's last cut (a pre-tokenizer cut, before a space) "
        "is encoded; CPU: the thread's CPU time (end to end: the process's, all threads); end to "
        "end: `Tokenizers.token_ids` (encodes of at most 4,096 uncached characters run on the "
        "calling thread). Wall times include waiting for a core on a loaded machine; CPU times "
        "do not.",
        f"- machine load average during the run: {load}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="seconds: 1K tokens, few repetitions")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = [1024] if args.smoke else [1024, 8192, 32768]
    reps = 2 if args.smoke else 9
    completions = bench_completions(3 if args.smoke else 21, 2 if args.smoke else EARLIER_BLOCKS)
    c = completions
    print(
        f"completions {c['prompt_tokens']} tokens: full encode {c['full_encode_ms']:.2f} ms, "
        f"cold {c['cold_ms']:.2f} ms, extending {c['extending_ms']:.2f} ms "
        f"(CPU {c['extending_cpu_ms']:.2f} ms, {c['extending_encoded_tokens']:.0f} encoded), "
        f"departing {c['departing_ms']:.2f} ms (CPU {c['departing_cpu_ms']:.2f} ms, "
        f"{c['departing_encoded_tokens']:.0f} encoded, {c['departing_hits']} hits), "
        f"end to end {c['end_to_end']['cold_ms']:.2f} / {c['end_to_end']['extending_ms']:.2f} ms",
        flush=True,
    )
    results = []
    for size in sizes:
        r = bench_size(size, reps)
        results.append(r)
        print(
            f"{r['tokens']:>6} tokens: render {r['render_ms']:.2f} ms, encode "
            f"{r['encode_ms']:.2f} ms, cold {r['cold_ms']:.2f} ms, next turn "
            f"{r['multi_turn_last_ms']:.2f} ms ({r['multi_turn_last_encoded_tokens']} encoded)",
            flush=True,
        )
        for name in EXECUTORS:
            x = r["executors"][name]
            print(
                f"        {name:>8}: one {x['one_ms']:.2f} ms, 8 at once "
                f"{x['eight_ms_per_request']:.2f} ms/request, "
                f"loop stall {x['loop_stall_ms']:.1f} ms",
                flush=True,
            )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    payload = {
        "benchmark": "tokenize",
        "smoke": args.smoke,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": load},
        "results": results,
        "completions": completions,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(results, completions, args.smoke, load))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
