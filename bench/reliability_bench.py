"""Load, soak, faults under traffic and fuzzing, against real processes on loopback.

1. Burst: N concurrent streaming requests through one router in front of fast simulated
   engines; every stream must be intact (status 200, events parse, text equal to what the
   engine produces for that prompt, ends with [DONE]). Router RSS before and after.
2. Soak: sustained streaming traffic for D seconds with churned caches (small KV pools, a
   stream of new documents), same checks; router RSS sampled.
3. Faults under traffic: while clients keep streaming, each fault is applied and healed
   (engine killed mid-stream, engine restarted, bridge killed, gap beyond replay, malformed
   frames and payloads, a flapping worker, every worker hung, clients that disconnect, the
   router restarted). A request is *lost* when the client got no answer, a hang, a truncated
   or corrupted stream; an explicit error (an HTTP error status, or an SSE error event ending
   with [DONE]) is *reported*, not lost.
4. Fuzz: random bodies to every router endpoint over HTTP (the router must answer each with
   a 4xx/2xx/503 and stay up), random and nonsense protobuf into the index, random config
   documents into the config loader.

    python -m bench.reliability_bench [--streams 2000] [--soak 60] [--smoke]

Writes bench/results/reliability.json (smoke: --out, or reliability_smoke.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.loopback import Engine, Loopback, Router
from bench.traffic import (
    StreamResult,
    completion_body,
    expected_text,
    metric,
    metrics,
    post_json,
    stream,
    workers,
)

RESULTS = Path(__file__).resolve().parent / "results"
_WORDS = ("river", "stone", "cloud", "paper", "garden", "window", "silver", "orange", "market")


def prompts(seed: int, n: int, words: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) + f" #{i}" for i in range(n)]


def _endless(rng: random.Random, words: int) -> Any:
    while True:
        yield " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Outcome:
    sent: int = 0
    intact: int = 0
    reported: int = 0  # explicit errors the client can act on
    lost: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, r: StreamResult, expected: str | None) -> None:
        self.sent += 1
        if r.intact(expected):
            self.intact += 1
        else:
            if (r.status not in (0, 200)) or (r.status == 200 and r.done and r.error):
                self.reported += 1
            else:
                self.lost += 1
            # what went wrong, for the assertion message (reported errors too: their cause)
            if len(self.examples) < 5:
                self.examples.append(
                    f"status={r.status} done={r.done} error={r.error} "
                    f"text_ok={r.text == expected} events={r.events} body={r.body[:200]!r}"
                )


class Expected:
    """Each prompt's reference text, asked once of an engine directly (not streamed)."""

    def __init__(self, http: aiohttp.ClientSession, engine: Engine, max_tokens: int) -> None:
        self._http, self._engine, self._max = http, engine, max_tokens
        self._texts: dict[str, str] = {}

    async def of(self, prompt: str) -> str:
        if prompt not in self._texts:
            body = completion_body(prompt, self._max)
            self._texts[prompt] = await expected_text(self._http, self._engine.url, body)
        return self._texts[prompt]


async def burst(
    http: aiohttp.ClientSession,
    router: str,
    texts: Expected,
    pool: list[str],
    n: int,
    max_tokens: int,
) -> tuple[Outcome, float]:
    """`n` streams at once; (outcome, seconds)."""
    for p in pool:
        await texts.of(p)
    started = time.monotonic()
    picks = [pool[i % len(pool)] for i in range(n)]
    results = await asyncio.gather(
        *(stream(http, router, completion_body(p, max_tokens), timeout=120) for p in picks)
    )
    took = time.monotonic() - started
    out = Outcome()
    for p, r in zip(picks, results, strict=True):
        out.add(r, await texts.of(p))
    return out, took


async def sustained(
    http: aiohttp.ClientSession,
    router: str,
    texts: Expected,
    seconds: float,
    concurrency: int,
    max_tokens: int,
    seed: int,
    outcome: Outcome,
) -> None:
    """Clients streaming new and repeated documents for `seconds` (churns the caches)."""
    stop = time.monotonic() + seconds
    rng = random.Random(seed)
    fresh = (f"{p} {seed}.{i}" for i, p in enumerate(_endless(rng, 120)))
    recent: list[str] = []

    async def client() -> None:
        while time.monotonic() < stop:
            if recent and rng.random() < 0.5:
                p = rng.choice(recent)
            else:
                p = next(fresh)
                recent.append(p)
                del recent[:-200]
            expected = await texts.of(p)
            outcome.add(await stream(http, router, completion_body(p, max_tokens)), expected)

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def _heal(
    lb: Loopback,
    http: aiohttp.ClientSession,
    engines: list[Engine],
    bridges: list[Any],
    router: Router,
) -> None:
    for e in engines:
        if not e.proc.alive():
            lb.restart_engine(e)
        else:
            await post_json(http, e.url + "/sim/faults", {"fail_rate": 0.0, "hang": False})
    for b in bridges:
        if not b.proc.alive():
            lb.restart_bridge(b)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ws = await workers(http, router.url)
        if all(w["healthy"] and w["events"]["state"] == "live" for w in ws.values()):
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("fleet did not heal")


async def faults_under_traffic(
    lb: Loopback,
    http: aiohttp.ClientSession,
    engines: list[Engine],
    bridges: list[Any],
    router: Router,
    texts: Expected,
    per_fault_s: float,
    only: set[str] | None = None,
) -> tuple[dict[str, dict[str, int]], Outcome]:
    """Apply each fault while clients stream; per fault the traffic outcome."""
    total = Outcome()
    report: dict[str, dict[str, int]] = {}
    victim, other = engines[0], engines[1]

    async def kill_engine() -> None:
        await post_json(http, victim.url + "/sim/faults", {"slowdown": 20.0})
        await asyncio.sleep(per_fault_s / 3)
        victim.proc.kill()
        await asyncio.sleep(per_fault_s / 3)
        await asyncio.to_thread(lb.restart_engine, victim)

    async def restart_engine() -> None:
        await asyncio.to_thread(lb.restart_engine, victim)

    async def kill_bridge() -> None:
        bridges[0].proc.kill()
        await asyncio.sleep(per_fault_s / 2)
        await asyncio.to_thread(lb.restart_bridge, bridges[0])

    async def gap() -> None:
        await post_json(
            http, victim.url + "/sim/faults", {"drop_batches": 3, "drop_from_replay": True}
        )

    async def malformed() -> None:
        await post_json(http, victim.url + "/sim/faults", {"malformed": "frames"})
        await asyncio.sleep(per_fault_s / 3)
        await post_json(http, other.url + "/sim/faults", {"malformed": "payload"})

    async def flapping() -> None:
        for i in range(int(per_fault_s / 0.25)):
            await post_json(http, victim.url + "/sim/faults", {"fail_rate": float(i % 2)})
            await asyncio.sleep(0.25)
        await post_json(http, victim.url + "/sim/faults", {"fail_rate": 0.0})

    async def all_hung() -> None:
        for e in engines:
            await post_json(http, e.url + "/sim/faults", {"hang": True})
        await asyncio.sleep(per_fault_s / 2)
        for e in engines:
            await post_json(http, e.url + "/sim/faults", {"hang": False})

    async def disconnects() -> None:
        body = completion_body("a story that never ends", 2000, ignore_eos=True)
        await asyncio.gather(
            *(stream(http, router.url, body, stop_after_events=2) for _ in range(20))
        )

    async def restart_router() -> None:
        # SIGTERM: in-flight streams finish, new connections are refused until it is back
        await asyncio.to_thread(lb.restart_router, router, kill=False)

    scenarios = [
        ("engine_killed_mid_stream", kill_engine),
        ("engine_restarted", restart_engine),
        ("bridge_killed_and_restarted", kill_bridge),
        ("gap_beyond_replay", gap),
        ("malformed_frames_and_payload", malformed),
        ("worker_flapping", flapping),
        ("all_workers_hung", all_hung),
        ("clients_disconnect_mid_stream", disconnects),
        ("router_restarted", restart_router),
    ]
    if only:
        scenarios = [(n, f) for n, f in scenarios if n in only]
    for i, (name, fault) in enumerate(scenarios):
        outcome = Outcome()
        traffic = asyncio.create_task(
            sustained(http, router.url, texts, per_fault_s, 8, 16, 100 + i, outcome)
        )
        await asyncio.sleep(0.2)
        await fault()
        await traffic
        await _heal(lb, http, engines, bridges, router)
        report[name] = {k: v for k, v in asdict(outcome).items() if k != "examples"}
        if outcome.examples:
            report[name]["examples"] = outcome.examples  # type: ignore[assignment]
        print(name, report[name], flush=True)
        for k in ("sent", "intact", "reported", "lost"):
            setattr(total, k, getattr(total, k) + getattr(outcome, k))
    return report, total


# -- fuzz -------------------------------------------------------------------------------------
def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**63, 1.5, float("1e308")])
    if kind == 3:
        return rng.choice(["", "x", "\u0000", "kvroute-sim", "é" * 50, "user"])
    if kind == 4:
        return rng.randint(-5, 100000)
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["model", "prompt", "messages", "input", "stream", "max_tokens", "cache_salt",
            "stream_options", "user", "role", "content", "n", "tools", "x"]  # fmt: skip
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randint(0, 5))}


def _mutated_body(rng: random.Random) -> bytes:
    base: dict[str, Any] = rng.choice(
        [
            {"model": "kvroute-sim", "prompt": "hello", "max_tokens": 2},
            {
                "model": "kvroute-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            {"model": "kvroute-sim", "input": "hello"},
        ]
    )
    body = dict(base)
    for _ in range(rng.randint(1, 3)):
        body[rng.choice([*base, "stream", "cache_salt", "stream_options", "n"])] = _random_json(rng)
    raw = json.dumps(body, allow_nan=True).encode()
    if rng.random() < 0.2:
        cut = rng.randrange(len(raw))
        raw = raw[:cut] + rng.randbytes(rng.randint(0, 8)) + raw[cut + 1 :]
    return raw


async def fuzz_http(http: aiohttp.ClientSession, router: str, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
             "/tokenize", "/detokenize"]  # fmt: skip
    statuses: dict[str, int] = {}
    bad: list[str] = []

    async def one(i: int) -> None:
        path = paths[i % len(paths)]
        raw = _mutated_body(rng) if rng.random() < 0.7 else rng.randbytes(rng.randint(0, 64))
        try:
            async with http.post(
                router + path, data=raw, headers={"content-type": "application/json"}
            ) as r:
                await r.read()
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
                if r.status >= 500 and r.status not in (502, 503, 504):
                    bad.append(f"{path} {r.status} {raw[:80]!r}")
        except aiohttp.ClientError as exc:
            bad.append(f"{path} {type(exc).__name__} {raw[:80]!r}")

    for start in range(0, n, 32):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 32))))
    return {"inputs": n, "statuses": statuses, "server_errors": len(bad), "examples": bad[:5]}


def fuzz_index(n: int, seed: int) -> dict[str, Any]:
    from kvroute.indexer import FleetIndex, Namespace
    from kvroute.proto import events_pb2

    rng = random.Random(seed)
    crashes = 0
    examples: list[str] = []
    idx = FleetIndex(16, max_entries_per_worker=5000, max_pending_per_worker=500)
    for i in range(n):
        raw = rng.randbytes(rng.randint(0, 200))
        try:
            msg = events_pb2.SubscribeResponse.FromString(raw)
        except Exception:
            msg = _nonsense(rng)
        try:
            if msg.HasField("snapshot"):
                idx.apply_snapshot(f"w{i % 3}", msg.snapshot)
            else:
                idx.apply(f"w{i % 3}", msg.batch)
            idx.score([rng.randint(0, 50) for _ in range(rng.randint(0, 80))], Namespace())
        except Exception as exc:  # counted: the target is zero
            crashes += 1
            if len(examples) < 5:
                examples.append(f"{type(exc).__name__}: {exc}")
    return {"inputs": n, "crashes": crashes, "examples": examples}


def _nonsense(rng: random.Random) -> Any:
    from kvroute.proto import events_pb2

    events = [
        events_pb2.KvGroupEvent(
            operation=rng.choice([0, 1, 2, 3]),
            group_id=rng.choice([0, 1, 4]),
            block_hashes=[rng.randbytes(8) for _ in range(rng.randint(0, 3))],
            parent_block_hash=rng.choice([b"", rng.randbytes(8)]),
            token_ids=[rng.randint(0, 60) for _ in range(rng.choice([0, 16, 32, 5]))],
            block_size=rng.choice([0, 16, 32, 7]),
            kind=rng.choice(["full_attention", "sliding_window", "mamba", "x"]),
            sliding_window=rng.choice([0, 32, 1]),
        )
        for _ in range(rng.randint(0, 5))
    ]
    if rng.random() < 0.2:
        return events_pb2.SubscribeResponse(
            snapshot=events_pb2.Snapshot(
                sequence=rng.randint(0, 9), has_sequence=True, events=events
            )
        )
    return events_pb2.SubscribeResponse(
        batch=events_pb2.KvEventBatch(sequence=rng.randint(0, 40), events=events)
    )


def fuzz_config(n: int, seed: int) -> dict[str, Any]:
    from kvroute.router.config_load import ConfigError, config_from_dict

    rng = random.Random(seed)
    crashes = 0
    examples: list[str] = []
    sections = ["workers", "models", "policy", "limits", "timeouts", "retry", "breaker",
                "health", "load", "events", "verify", "admin", "discovery", "tokenizer",
                "port", "host"]  # fmt: skip
    for _ in range(n):
        doc: Any = {rng.choice(sections): _random_json(rng) for _ in range(rng.randint(0, 4))}
        if rng.random() < 0.3:
            text = yaml.safe_dump(doc)
            cut = rng.randrange(len(text) + 1)
            text = (
                text[:cut] + rng.choice(["{", ":", "- ", "\t", "!!python/object", "]"]) + text[cut:]
            )
            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError:
                continue
            if not isinstance(doc, dict):
                continue
        try:
            config_from_dict(doc)
        except ConfigError:
            pass
        except Exception as exc:  # counted: the target is zero
            crashes += 1
            if len(examples) < 5:
                examples.append(f"{type(exc).__name__}: {exc} for {doc!r}"[:300])
    return {"inputs": n, "crashes": crashes, "examples": examples}


# -- main -------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace) -> dict[str, Any]:
    engine_args = ["--speed", "1000", "--max-num-seqs", "1024", "--num-blocks", "2048"]
    result: dict[str, Any] = {"smoke": args.smoke}
    with Loopback() as lb:
        engines = lb.engines(2, *engine_args)
        bridges = lb.bridges(engines)
        # the same engine outside the fleet: the reference answers, untouched by faults
        reference = lb.engine("reference", *engine_args)
        config = lb.router_config(
            engines,
            bridges,
            limits={"upstream_connections": 4096, "max_in_flight": 8192},
            # the router's defaults: a burst of thousands slows the engines' /health answers
            health={"interval_s": 1.0, "unhealthy_after": 2},
            timeouts={"health_s": 2.0, "connect_s": 3.0},
            breaker={"open_s": 0.5, "failure_threshold": 3},
        )
        router = lb.router(config)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            texts = Expected(http, reference, 16)
            pool = prompts(1, 64, 40)
            await burst(http, router.url, texts, pool, 100, 16)  # warm-up
            rss0 = router.proc.rss_bytes()
            load, took = await burst(http, router.url, texts, pool, args.streams, 16)
            rss1 = router.proc.rss_bytes()
            load2, took2 = await burst(http, router.url, texts, pool, args.streams, 16)
            rss2 = router.proc.rss_bytes()
            result["load"] = {
                "concurrent_streams": args.streams,
                "rounds": 2,
                "seconds": [round(took, 2), round(took2, 2)],
                "intact": load.intact + load2.intact,
                "lost_or_corrupted": load.lost + load2.lost + load.reported + load2.reported,
                "examples": load.examples + load2.examples,
                "router_rss_mb": {
                    "before": round(rss0 / 2**20, 1),
                    "after_round_1": round(rss1 / 2**20, 1),
                    "after_round_2": round(rss2 / 2**20, 1),
                },
            }
            print("load", json.dumps(result["load"]), flush=True)

            soak = Outcome()
            samples = []
            task = asyncio.create_task(
                sustained(http, router.url, texts, args.soak, args.soak_concurrency, 16, 7, soak)
            )
            while not task.done():
                samples.append(round(router.proc.rss_bytes() / 2**20, 1))
                await asyncio.wait([task], timeout=max(1.0, args.soak / 10))
            page = await metrics(http, router.url)
            result["soak"] = {
                "seconds": args.soak,
                "concurrency": args.soak_concurrency,
                "requests": soak.sent,
                "intact": soak.intact,
                "lost": soak.lost,
                "reported_errors": soak.reported,
                "examples": soak.examples,
                "router_rss_mb_samples": samples,
                "predictions": {
                    o: metric(page, "kvroute_prediction_outcomes_total", outcome=o)
                    for o in ("exact", "over", "under", "tokenizer_mismatch")
                },
            }
            print("soak", json.dumps(result["soak"]), flush=True)

            only = {n for n in args.faults.split(",") if n} or None
            report, total = await faults_under_traffic(
                lb, http, engines, bridges, router, texts, args.per_fault, only
            )
            result["faults"] = {
                "scenarios": report,
                "survived": sum(1 for r in report.values() if r["lost"] == 0),
                "of": len(report),
                "requests": total.sent,
                "lost": total.lost,
                "reported_errors": total.reported,
            }
            result["fuzz"] = {
                "http": await fuzz_http(http, router.url, args.fuzz_http, 11),
                "index_protobuf": fuzz_index(args.fuzz_index, 12),
                "config": fuzz_config(args.fuzz_config, 13),
            }
            result["fuzz"]["router_alive"] = router.proc.alive()
    fz = result["fuzz"]
    result["summary"] = {
        "load_held": f"{args.streams} concurrent streams x2, {result['load']['intact']} intact",
        "faults_survived": f"{result['faults']['survived']}/{result['faults']['of']}",
        "inputs_tried": fz["http"]["inputs"]
        + fz["index_protobuf"]["inputs"]
        + fz["config"]["inputs"],
        "requests_lost": result["load"]["lost_or_corrupted"]
        + result["soak"]["lost"]
        + result["faults"]["lost"],
        "fuzz_failures": fz["http"]["server_errors"]
        + fz["index_protobuf"]["crashes"]
        + fz["config"]["crashes"],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--soak", type=float, default=60.0, help="soak seconds")
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--per-fault", type=float, default=3.0, help="seconds of traffic per fault")
    p.add_argument("--fuzz-http", type=int, default=5000)
    p.add_argument("--fuzz-index", type=int, default=20000)
    p.add_argument("--fuzz-config", type=int, default=5000)
    p.add_argument("--faults", default="", help="comma-separated scenario names (default all)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.smoke:
        args.streams, args.soak, args.soak_concurrency, args.per_fault = 50, 1.0, 8, 0.5
        args.fuzz_http, args.fuzz_index, args.fuzz_config = 60, 200, 100
        args.faults = "gap_beyond_replay,malformed_frames_and_payload"
    result = asyncio.run(bench(args))
    out = args.out or RESULTS / ("reliability_smoke.json" if args.smoke else "reliability.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return (
        0
        if result["summary"]["requests_lost"] == 0 and result["summary"]["fuzz_failures"] == 0
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
