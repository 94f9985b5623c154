"""The KV-event workload of one busy engine, derived from the simulated engine.

`record` drives the simulator's own scheduler and cache (`kvroute.sim.engine.scheduler`,
`kvroute.sim.cache`) with a closed loop of multi-turn conversations that keeps an H100-class
engine (Llama-3.1-8B BF16, the roofline of `kvroute/sim/timing.py` at speed 1) always busy,
and keeps each step's KV events with the modelled time at which the step ended. Nothing sleeps:
modelled time is the sum of the modelled step times, so a minute of busy GPU costs seconds.

`rates` states what one such engine publishes per second once its cache is full (stores from
prefill and from decode, removals from eviction, batches and their sizes); `bridge_frames`
passes the recording through the bridge's own decoder, converter and `RankStream`, so the
batches are exactly what a bridge beside that engine sends to its routers.

    python -m bench.fleet_model            # prints the rates of the default engine
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

from kvroute.bridge.convert import convert_batch
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream
from kvroute.bridge.vllm_schema import BatchDecoder, BlockRemoved, BlockStored, encode_batch
from kvroute.proto.events_pb2 import SubscribeRequest, SubscribeResponse
from kvroute.sim.cache import SimCache
from kvroute.sim.cache_api import CacheRequest, CacheSpec
from kvroute.sim.engine.core import Engine
from kvroute.sim.engine.scheduler import Scheduler
from kvroute.sim.events import KvEvent
from kvroute.sim.profiles import PROFILES
from kvroute.sim.timing import DEFAULT_GPU

BLOCK_SIZE = 16  # the dense profile's block size (Llama-3.1-8B in vLLM)
WIRE_VERSION = "0.33"


@dataclass(frozen=True)
class EngineShape:
    """An H100 SXM 80GB serving Llama-3.1-8B BF16 with vLLM's defaults for that GPU.

    KV pool: 0.9 x 80 GB - 16.06 GB of weights - ~2 GB of activations = ~54 GB, at
    131,072 B per token (kvroute/sim/timing.py) and 16 tokens per block = 25,600 blocks
    (409,600 tokens). vLLM 0.33 sets max_num_batched_tokens 8192 and max_num_seqs 1024 for
    an OpenAI server on a GPU of 70 GB or more (vllm/engine/arg_utils.py)."""

    num_blocks: int = 25_600
    max_model_len: int = 40_960
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024


@dataclass(frozen=True)
class Conversations:
    """Multi-turn chat with long contexts (the public trace's prompts average ~12K tokens).

    `active` conversations each have one request in the engine at any time (a closed loop:
    the next turn is sent as the answer ends), which keeps the engine saturated. A turn's
    prompt is the last prompt, its answer and a new user message; a conversation ends after
    `turns` turns and a new one (fresh context) takes its place."""

    active: int = 48
    first_context: tuple[int, int] = (2048, 8192)
    user_tokens: tuple[int, int] = (200, 2000)
    answer_tokens: tuple[int, int] = (100, 600)
    turns: tuple[int, int] = (2, 8)
    vocab: int = 32_000


@dataclass
class Recording:
    """Each step's events with the modelled time it ended, plus the totals behind the rates."""

    steps: list[tuple[float, list[KvEvent]]] = field(default_factory=list)
    busy_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0
    full_at: float | None = None  # modelled time of the first eviction (the cache is full)
    prompts: list[tuple[int, ...]] = field(default_factory=list)  # sample of admitted prompts


def record(
    seconds: float,
    shape: EngineShape = EngineShape(),
    work: Conversations = Conversations(),
    seed: int = 0,
    keep_prompts: int = 64,
) -> Recording:
    """Run one engine for `seconds` of modelled GPU time; see the module docstring."""
    rng = random.Random(seed)
    spec = CacheSpec(
        groups=PROFILES["dense"],
        num_blocks=shape.num_blocks,
        max_model_len=shape.max_model_len,
        max_num_scheduled_tokens=shape.max_num_batched_tokens,
        max_in_flight_tokens=shape.max_num_batched_tokens,
    )
    sched = Scheduler(
        SimCache(spec),
        max_num_seqs=shape.max_num_seqs,
        max_num_scheduled_tokens=shape.max_num_batched_tokens,
    )
    # Engine._step_seconds reads only the scheduler and the GPU model: the engine's own
    # step-time rule, without its event loop
    timing = SimpleNamespace(scheduler=sched, config=SimpleNamespace(gpu=DEFAULT_GPU))
    out = Recording()

    def tokens(span: tuple[int, int]) -> list[int]:
        return [rng.randrange(5, work.vocab) for _ in range(rng.randint(*span))]

    # request id -> (conversation prompt, turns left)
    convs: dict[str, tuple[list[int], int]] = {}
    answers: dict[str, list[int]] = {}

    def submit(prompt: list[int], turns_left: int) -> None:
        rid = f"r{out.requests}"
        out.requests += 1
        budget = shape.max_model_len - len(prompt) - 1
        max_tokens = max(1, min(rng.randint(*work.answer_tokens), budget))
        sched.add(CacheRequest(rid, tuple(prompt), max_tokens=max_tokens))
        convs[rid] = (prompt, turns_left)
        answers[rid] = []
        if len(out.prompts) < keep_prompts:
            out.prompts.append(tuple(prompt))

    def sample(rid: str) -> int:
        token = rng.randrange(5, work.vocab)
        answers[rid].append(token)
        return token

    def new_conversation() -> None:
        submit(tokens(work.first_context), rng.randint(*work.turns) - 1)

    for _ in range(work.active):
        new_conversation()
    now = 0.0
    while now < seconds:
        plan = sched.schedule()
        if not plan.scheduled:
            break  # nothing fits: cannot happen with max_model_len within the pool
        dt = Engine._step_seconds(timing, plan)  # type: ignore[arg-type]
        for s in plan.scheduled:
            sr = sched.requests[s.request_id]
            if s.new:
                out.prompt_tokens += sr.num_prompt
                out.hit_tokens += s.cached_tokens
            if sr.num_computed - s.num_tokens >= sr.num_prompt:
                out.decode_tokens += 1
            else:
                out.prefill_tokens += s.num_tokens
        result = sched.complete(plan, sample, lambda _rid, _tok: False)  # max_tokens ends them
        now += dt
        out.busy_steps += 1
        if result.events:
            out.steps.append((now, result.events))
            if out.full_at is None and any(isinstance(e, BlockRemoved) for e in result.events):
                out.full_at = now
        for rid in result.finished:
            prompt, left = convs.pop(rid)
            answer = answers.pop(rid)
            nxt = prompt + answer + tokens(work.user_tokens)
            if left > 0 and len(nxt) + work.answer_tokens[1] < shape.max_model_len:
                submit(nxt, left - 1)
            else:
                new_conversation()
    return out


@dataclass(frozen=True)
class Rates:
    """What one busy engine publishes per second of GPU time, once its cache is full."""

    window_s: float
    batches_per_s: float
    stored_blocks_per_s: float
    removed_blocks_per_s: float
    prefill_blocks_per_s: float  # computed prefill tokens / block size
    decode_blocks_per_s: float  # decoded tokens / block size
    store_events_per_batch: float
    remove_events_per_batch: float
    blocks_per_batch: float
    token_ids_per_s: float
    bridge_bytes_per_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    mean_prompt_tokens: float
    prefix_hit_ratio: float
    time_to_fill_s: float | None


def rates(rec: Recording, frames: list[tuple[float, bytes]] | None = None) -> Rates:
    """Per-second rates over the recording after its cache filled (all of it if it never did);
    `frames` (from `bridge_frames`) adds the bytes a bridge sends."""
    start = rec.full_at if rec.full_at is not None else 0.0
    steps = [(t, evs) for t, evs in rec.steps if t > start]
    end = rec.steps[-1][0] if rec.steps else 0.0
    window = max(end - start, 1e-9)
    stored = sum(len(e.block_hashes) for _, evs in steps for e in evs if isinstance(e, BlockStored))
    removed = sum(
        len(e.block_hashes) for _, evs in steps for e in evs if isinstance(e, BlockRemoved)
    )
    n_store = sum(1 for _, evs in steps for e in evs if isinstance(e, BlockStored))
    n_remove = sum(1 for _, evs in steps for e in evs if isinstance(e, BlockRemoved))
    toks = sum(len(e.token_ids) for _, evs in steps for e in evs if isinstance(e, BlockStored))
    nbytes = sum(len(b) for t, b in frames if t > start) if frames else 0
    total = max(end, 1e-9)  # token rates over the whole run: the GPU is busy throughout
    batches = max(len(steps), 1)
    return Rates(
        window_s=round(window, 2),
        batches_per_s=len(steps) / window,
        stored_blocks_per_s=stored / window,
        removed_blocks_per_s=removed / window,
        prefill_blocks_per_s=rec.prefill_tokens / total / BLOCK_SIZE,
        decode_blocks_per_s=rec.decode_tokens / total / BLOCK_SIZE,
        store_events_per_batch=n_store / batches,
        remove_events_per_batch=n_remove / batches,
        blocks_per_batch=(stored + removed) / batches,
        token_ids_per_s=toks / window,
        bridge_bytes_per_s=nbytes / window,
        prefill_tokens_per_s=rec.prefill_tokens / total,
        decode_tokens_per_s=rec.decode_tokens / total,
        mean_prompt_tokens=rec.prompt_tokens / max(rec.requests, 1),
        prefix_hit_ratio=rec.hit_tokens / max(rec.prompt_tokens, 1),
        time_to_fill_s=rec.full_at,
    )


def bridge_frames(rec: Recording) -> list[tuple[float, bytes]]:
    """The recording as the `SubscribeResponse` bytes a bridge sends for it (modelled time,
    bytes): each step encoded as vLLM 0.33 publishes it, then decoded, converted and fanned
    out by the bridge's own code."""
    decoder = BatchDecoder()
    stream = RankStream(0, "fleet-model", EngineState(0), BridgeMetrics())
    subscriber = stream.subscribe(SubscribeRequest())
    subscriber.clear()  # the initial (empty) snapshot
    out: list[tuple[float, bytes]] = []
    for seq, (t, events) in enumerate(rec.steps):
        payload = encode_batch(t, events, 0, WIRE_VERSION)
        stream.apply(convert_batch(decoder.decode(payload), seq, dp_rank=0))
        while not subscriber.queue.empty():
            out.append((t, subscriber.queue.get_nowait()))
    return out


async def bridge_snapshots(
    frames: list[tuple[float, bytes]], at: list[float]
) -> list[tuple[int, bytes]]:
    """The snapshots a bridge sends a new subscriber after the frames up to each time in `at`
    (ascending): (how many frames it reflects, `SubscribeResponse` bytes), built by the
    bridge's own `EngineState` and `RankStream` from the frames' batches."""
    stream = RankStream(0, "fleet-model", EngineState(0), BridgeMetrics())
    out: list[tuple[int, bytes]] = []
    todo = list(at)
    for i, (t, raw) in enumerate(frames):
        while todo and t > todo[0]:
            todo.pop(0)
            subscriber = stream.subscribe(SubscribeRequest())
            while subscriber.queue.empty():  # a large state is built in steps, on the loop
                await asyncio.sleep(0)
            out.append((i, subscriber.queue.get_nowait()))
            stream.unsubscribe(subscriber)
        if not todo:
            break
        stream.apply(SubscribeResponse.FromString(raw).batch)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="modelled GPU seconds")
    parser.add_argument("--active", type=int, default=Conversations.active)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rec = record(args.seconds, work=Conversations(active=args.active), seed=args.seed)
    print(json.dumps(asdict(rates(rec, bridge_frames(rec))), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
