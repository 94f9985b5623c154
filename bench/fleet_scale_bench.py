"""One router replica in front of a fleet of N busy engines: event lag, ingest CPU, decisions,
proxy overhead and memory, at N = 64, 256, 1,024, 4,096.

Per point, all on loopback, each in its own process:
- `bench.fleet_feed`: N synthetic engines behind one gRPC KvEvents server (dp_rank k = engine
  k), replaying the busy H100 engine recorded by `bench.fleet_model` with the bridge's own
  frames, each starting from a snapshot of a full cache;
- `bench.instant_engine`: every worker's HTTP side (answers at once);
- `kvroute serve` with N workers (bridge = the feed, dp_rank k), its config written here
  (`--router-set key=value` changes any setting, e.g. one that moves the index elsewhere:
  CPU and memory are summed over the router's whole process group).
Then, after every stream is live: an ingest-only window (the router's CPU per second, per
block and per batch; lag from `kvroute_event_lag_seconds`), and one window each of 8K- and
32K-token prompts sent as token ids (decision time from `kvroute_routing_decision_seconds`;
each routed request is paired with the same request sent straight to the engine, and the
difference is the proxy's added latency). A point whose lag keeps growing, or whose feed had
to resynchronise an engine the router did not drain, is stopped there with the reason.

    python -m bench.fleet_scale_bench --engines 64 256 1024@0.1 [--window-s 20] [--smoke]

`N@f` runs N engines at f times the modelled busy rate (to measure the cost per event where
the full rate cannot be fed on this machine). Writes <out>/fleet_scale.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pickle
import platform
import pstats
import random
import signal
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet_feed import engine_token
from bench.fleet_model import (
    Conversations,
    EngineShape,
    bridge_frames,
    bridge_snapshots,
    rates,
    record,
)
from kvroute.testbed.procs import (
    Child,
    ProcessGroup,
    free_port,
    group_cpu_by_command,
    group_cpu_seconds,
    wait_http,
)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "m"
SIZES = (8192, 32768)
STARTS = 8  # snapshot offsets engines start from


# -- the recorded engine -------------------------------------------------------------------


def build_template(path: Path, seconds: float, active: int, seed: int = 0) -> dict[str, Any]:
    """Record the busy engine, turn it into bridge frames and start snapshots; save to `path`
    (pickle, read by fleet_feed) and return the rates."""
    rec = record(seconds, EngineShape(), Conversations(active=active), seed=seed)
    frames = bridge_frames(rec)
    full = rec.full_at if rec.full_at is not None else 0.0
    end = frames[-1][0] if frames else 0.0
    # starts spread over the first half of the full-cache part: an engine can run for the
    # second half before its recording ends (then it restarts, from empty)
    at = [full + 1.0 + i * (end - full) / 2 / STARTS for i in range(STARTS)]
    snaps = asyncio.run(bridge_snapshots(frames, at))
    r = rates(rec, frames)
    data = {"frames": frames, "snapshots": snaps, "prompts": rec.prompts, "rates": asdict(r)}
    path.write_bytes(pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL))
    return {"rates": asdict(r), "recorded_s": round(end, 1), "starts": [round(a, 1) for a in at]}


# -- metrics -------------------------------------------------------------------------------


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of the router's /metrics, by sample name."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in m.get(name, []))


def buckets(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts (upper bound -> count)."""
    return {float(labels["le"]): v for labels, v in m.get(name + "_bucket", [])}


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile of the observations between two scrapes of one histogram, linear within
    a bucket (inf when it falls in the open last bucket; None without observations)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    n = counts[-1] if counts else 0.0
    if n <= 0:
        return None
    rank = q * n
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if bound == float("inf"):
                return float("inf")
            inside = cum - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cum
    return float("inf")


def rss_bytes(pgid: int) -> int:
    """Resident memory of every live process of one process group."""
    found = 0
    for pid in group_cpu_by_command(pgid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    found += int(line.split()[1]) * 1024
    return found


# -- processes -----------------------------------------------------------------------------


def feed_stats(child: Child) -> dict[str, Any]:
    """The feed's latest once-a-second counters (the last JSON line of its log)."""
    text = child.log.read_text(errors="replace") if child.log.exists() else ""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
    return {}


def _set(config: dict[str, Any], dotted: str) -> None:
    key, _, raw = dotted.partition("=")
    if not key or not _:
        raise ValueError(f"--router-set wants key=value, got {dotted!r}")
    node = config
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(raw)


def router_config(
    engines: int, engine_url: str, feed_port: int, port: int, sets: list[str]
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "workers": [
            {
                "name": f"e{k}",
                "url": engine_url,
                "bridge": f"127.0.0.1:{feed_port}",
                "dp_rank": k,
                "model": MODEL,
            }
            for k in range(engines)
        ],
        "models": {MODEL: {"tokenizer": "request"}},
        "host": "127.0.0.1",
        "port": port,
        "log_level": "warning",
    }
    for dotted in sets:
        _set(config, dotted)
    return config


# -- the request load ----------------------------------------------------------------------


def request_bodies(
    prompts: list[tuple[int, ...]], engines: int, size: int, n: int, seed: int
) -> list[bytes]:
    """`n` completions bodies of `size` token ids: a recorded conversation as engine k caches
    it (token 0 = k's own), cut or extended with fresh tokens to `size`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randrange(engines)
        ids = [engine_token(k), *rng.choice(prompts)[1:size]]
        ids += [rng.randrange(5, 32_000) for _ in range(size - len(ids))]
        out.append(json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode())
    return out


@dataclass
class Paired:
    routed_s: list[float] = field(default_factory=list)
    direct_s: list[float] = field(default_factory=list)
    errors: int = 0


async def paired_load(
    router: str, engine: str, bodies: list[bytes], seconds: float, rate: float
) -> Paired:
    """Each body through the router, then straight to the engine, at `rate` pairs/s."""
    out = Paired()
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def timed(url: str, body: bytes) -> float | None:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", data=body, headers=headers) as r:
                await r.read()
                ok = r.status == 200
            return time.perf_counter() - t0 if ok else None

        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            tick = time.monotonic()
            body = bodies[i % len(bodies)]
            i += 1
            routed = await timed(router, body)
            direct = await timed(engine, body)
            if routed is None or direct is None:
                out.errors += 1
            else:
                out.routed_s.append(routed)
                out.direct_s.append(direct)
            await asyncio.sleep(max(0.0, 1.0 / rate - (time.monotonic() - tick)))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- one point -----------------------------------------------------------------------------


@dataclass
class Point:
    engines: int
    rate_scale: float
    status: str = "ok"
    reason: str = ""
    live_after_s: float | None = None
    ingest: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, Any] = field(default_factory=dict)
    rss_mib: float | None = None
    rss_mib_per_engine: float | None = None
    index_entries: float | None = None
    feed: dict[str, Any] = field(default_factory=dict)
    profile: list[str] = field(default_factory=list)  # with --profile: top own-time functions


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


class Run:
    """One point's processes and measurements."""

    def __init__(self, args: argparse.Namespace, template: Path, engines: int, scale: float):
        self.args = args
        self.template = template
        self.point = Point(engines, scale)
        self.pg = ProcessGroup(args.out / "logs" / f"n{engines}-x{scale}")

    def start(self) -> None:
        a, p = self.args, self.point
        engine = self.pg.start(
            "engine", [sys.executable, "-m", "bench.instant_engine", "--port", "0"], cwd=ROOT
        )
        self.engine_url = _port_url(engine)
        self.feed = self.pg.start(
            "feed",
            [sys.executable, "-m", "bench.fleet_feed", "--template", str(self.template),
             "--engines", str(p.engines), "--rate-scale", str(p.rate_scale),
             "--restart-interval-s", str(a.restart_interval_s), "--start", a.start],
            cwd=ROOT,
        )  # fmt: skip
        feed_port = int(_port_url(self.feed, 120).rsplit(":", 1)[1])
        port = free_port()
        config = router_config(p.engines, self.engine_url, feed_port, port, a.router_set)
        path = self.pg.log_dir / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        serve = ["kvroute", "serve", "--config", str(path)]
        if a.profile:  # cProfile on the router's main thread (bench/profiled.py)
            serve = ["bench.profiled", "--out", str(self.pg.log_dir / "router.prof"), *serve]
        self.router = self.pg.start("router", [sys.executable, "-m", *serve], cwd=ROOT)
        self.url = f"http://127.0.0.1:{port}"
        wait_http(self.url + "/v1/models", 120, self.router.popen)

    def wait_live(self) -> bool:
        p = self.point
        started = time.monotonic()
        while time.monotonic() - started < self.args.warmup_timeout_s:
            live = total(scrape(self.url), "kvroute_worker_events_live")
            if live >= p.engines:
                p.live_after_s = round(time.monotonic() - started, 1)
                return True
            time.sleep(2.0)
        p.status, p.reason = "no", f"only {live:.0f} of {p.engines} streams live after warm-up"
        return False

    def wait_settled(self) -> bool:
        """Wait until the backlog of the warm-up (batches queued behind the start snapshots)
        is applied: the lag's median over `settle_s` falls below `settled_lag_s`."""
        p, a = self.point, self.args
        deadline = time.monotonic() + a.warmup_timeout_s
        before, sent = scrape(self.url), feed_stats(self.feed).get("batches", 0)
        median = None
        while time.monotonic() < deadline:
            time.sleep(a.settle_s)
            after, now_sent = scrape(self.url), feed_stats(self.feed).get("batches", 0)
            lag = [buckets(x, "kvroute_event_lag_seconds") for x in (before, after)]
            median = quantile(lag[0], lag[1], 0.5)
            if median is not None and median < a.settled_lag_s:
                return True
            if median is None and now_sent == sent:
                return True  # nothing sent, nothing applied: no backlog (an idle fleet)
            before, sent = after, now_sent
        p.status = "no"
        p.reason = f"the warm-up backlog was not applied: lag p50 still {_ms(median)} ms"
        return False

    def ingest_window(self) -> bool:
        """Events only; False if the router does not keep up."""
        p, w = self.point, self.args.window_s
        pgid = self.router.popen.pid
        feed_pgid = self.feed.popen.pid
        halves = []
        m0 = scrape(self.url)
        c0, f0, s0 = group_cpu_seconds(pgid), group_cpu_seconds(feed_pgid), feed_stats(self.feed)
        t0 = time.monotonic()
        for _ in range(2):
            before = scrape(self.url) if halves else m0
            time.sleep(w / 2)
            after = scrape(self.url)
            b0, b1 = (buckets(x, "kvroute_event_lag_seconds") for x in (before, after))
            halves.append((quantile(b0, b1, 0.5), quantile(b0, b1, 0.99)))
        dt = time.monotonic() - t0
        c1, f1, s1 = group_cpu_seconds(pgid), group_cpu_seconds(feed_pgid), feed_stats(self.feed)
        m1 = after
        lag0, lag1 = (buckets(x, "kvroute_event_lag_seconds") for x in (m0, m1))
        # the feed's counters are once a second: its own clock gives their interval
        feed_dt = max(s1.get("t", 0.0) - s0.get("t", 0.0), 1e-9)
        batches = (s1.get("batches", 0) - s0.get("batches", 0)) * dt / feed_dt
        blocks = (s1.get("blocks", 0) - s0.get("blocks", 0)) * dt / feed_dt
        applied = total(m1, "kvroute_event_batches_total") - total(
            m0, "kvroute_event_batches_total"
        )
        cpu = c1 - c0
        p.ingest = {
            "window_s": round(dt, 1),
            "batches_per_s": round(batches / dt, 1),
            "blocks_per_s": round(blocks / dt, 1),
            "applied_batches_per_s": round(applied / dt, 1),
            "router_cpu_per_s": round(cpu / dt, 3),
            # per batch and block the router applied (a router behind applies fewer than sent)
            "router_cpu_us_per_batch": round(cpu / applied * 1e6, 1) if applied else None,
            "router_cpu_us_per_block": (
                round(cpu / (applied * blocks / batches) * 1e6, 3) if applied and blocks else None
            ),
            "lag_p50_ms": _ms(quantile(lag0, lag1, 0.5)),
            "lag_p99_ms": _ms(quantile(lag0, lag1, 0.99)),
            "lag_p50_ms_halves": [_ms(h[0]) for h in halves],
            "feed_cpu_per_s": round((f1 - f0) / dt, 3),
            "feed_late_mean_ms": _ms(s1.get("late_mean_s")),
        }
        self._memory(m1)
        p.feed = {k: s1.get(k) for k in ("overflows", "restarts", "snapshots", "subscribed")}
        first, second = halves[0][0], halves[1][0]
        if s1.get("overflows", 0) > s0.get("overflows", 0):
            p.status = "no"
            p.reason = "the router did not drain its streams (feed queues overflowed)"
        elif second is not None and second > self.args.settled_lag_s:
            p.status = "no"
            p.reason = f"events applied late: lag p50 {_ms(first)} ms then {_ms(second)} ms"
        elif applied < 0.9 * batches:
            p.status = "no"
            p.reason = f"applied {applied:.0f} of {batches:.0f} batches sent"
        return p.status == "ok"

    def profile_top(self, n: int = 15) -> None:
        """Write the router's profile so far; keep its top functions by own time."""
        out = self.pg.log_dir / "router.prof"
        os.kill(self.router.popen.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # let the dump finish
        stats = pstats.Stats(str(out))
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        whole = sum(v[2] for _, v in rows) or 1.0
        self.point.profile = [
            f"{v[2] / whole:6.1%} {v[2]:8.2f}s {Path(f).name}:{line} {fn}"
            for (f, line, fn), v in rows[:n]
        ]

    def _memory(self, m: dict[str, list[tuple[dict[str, str], float]]]) -> None:
        p = self.point
        rss = rss_bytes(self.router.popen.pid)
        p.rss_mib = round(rss / 2**20, 1)
        p.rss_mib_per_engine = round(rss / 2**20 / p.engines, 3)
        p.index_entries = total(m, "kvroute_worker_index_entries")

    def request_windows(self, prompts: list[tuple[int, ...]]) -> None:
        p, a = self.point, self.args
        for size in SIZES:
            bodies = request_bodies(prompts, p.engines, size, 32, seed=size)
            m0 = scrape(self.url)
            c0 = group_cpu_seconds(self.router.popen.pid)
            got = asyncio.run(
                paired_load(self.url, self.engine_url, bodies, a.window_s, a.request_rate)
            )
            c1 = group_cpu_seconds(self.router.popen.pid)
            m1 = scrape(self.url)
            d0, d1 = (buckets(x, "kvroute_routing_decision_seconds") for x in (m0, m1))
            added = [r - d for r, d in zip(got.routed_s, got.direct_s, strict=True)]
            p.requests[str(size)] = {
                "requests": len(got.routed_s),
                "errors": got.errors,
                "decision_p50_ms": _ms(quantile(d0, d1, 0.5)),
                "decision_p99_ms": _ms(quantile(d0, d1, 0.99)),
                "direct_p50_ms": _ms(pct(got.direct_s, 0.5)),
                "routed_p50_ms": _ms(pct(got.routed_s, 0.5)),
                "added_p50_ms": _ms(pct(added, 0.5)),
                "added_p99_ms": _ms(pct(added, 0.99)),
                "router_cpu_per_s": round((c1 - c0) / a.window_s, 3),
            }
        self._memory(scrape(self.url))

    def stop(self) -> None:
        self.pg.stop_all()


def _port_url(child: Child, timeout_s: float = 30.0) -> str:
    """The base URL of a child that prints "PORT <n>" once listening."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = child.log.read_text(errors="replace") if child.log.exists() else ""
        for line in text.splitlines():
            if line.startswith("PORT "):
                return f"http://127.0.0.1:{int(line.split()[1])}"
        if child.popen.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{child.name} did not start: {child.tail()}")


def run_point(args: argparse.Namespace, template: Path, engines: int, scale: float) -> Point:
    run = Run(args, template, engines, scale)
    try:
        run.start()
        prompts = pickle.loads(template.read_bytes())["prompts"]
        if run.wait_live():
            held = run.wait_settled() and run.ingest_window()
            if args.profile:  # also of a point that never caught up: where its time went
                run.profile_top()
            if held:
                run.request_windows(prompts)
    except Exception as exc:  # a point that fails says why; the next one still runs
        run.point.status, run.point.reason = "error", f"{type(exc).__name__}: {exc}"
    finally:
        run.stop()
    return run.point


# -- report --------------------------------------------------------------------------------


def table(points: list[Point]) -> str:
    rows = [
        "| engines | rate | holds | blocks/s | router CPU/s | µs/block | lag p50/p99 ms | "
        "8K decision p50/p99 ms | 32K decision p50/p99 ms | added p50 8K/32K ms | RSS MiB | "
        "MiB/engine |",
        "|" + "---|" * 12,
    ]
    for p in points:
        i, r8, r32 = p.ingest, p.requests.get("8192", {}), p.requests.get("32768", {})
        why = f" ({p.reason})" if p.reason else ""
        rows.append(
            f"| {p.engines} | {p.rate_scale} | {p.status}{why}"
            f" | {i.get('blocks_per_s', '-')} | {i.get('router_cpu_per_s', '-')}"
            f" | {i.get('router_cpu_us_per_block', '-')}"
            f" | {i.get('lag_p50_ms', '-')} / {i.get('lag_p99_ms', '-')}"
            f" | {r8.get('decision_p50_ms', '-')} / {r8.get('decision_p99_ms', '-')}"
            f" | {r32.get('decision_p50_ms', '-')} / {r32.get('decision_p99_ms', '-')}"
            f" | {r8.get('added_p50_ms', '-')} / {r32.get('added_p50_ms', '-')}"
            f" | {p.rss_mib if p.rss_mib is not None else '-'}"
            f" | {p.rss_mib_per_engine if p.rss_mib_per_engine is not None else '-'} |"
        )
    return "\n".join(rows)


def parse_point(text: str) -> tuple[int, float]:
    n, _, f = text.partition("@")
    return int(n), float(f) if f else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="*", default=["64", "256", "1024"], help="N or N@rate")
    ap.add_argument("--window-s", type=float, default=20.0, help="each measurement window")
    ap.add_argument("--settle-s", type=float, default=5.0, help="lag check period, warm-up")
    ap.add_argument(
        "--settled-lag-s", type=float, default=0.5, help="warm-up ends below this lag p50"
    )
    ap.add_argument("--warmup-timeout-s", type=float, default=240.0)
    ap.add_argument("--request-rate", type=float, default=10.0, help="request pairs per second")
    ap.add_argument("--restart-interval-s", type=float, default=3600.0, help="engine seconds")
    ap.add_argument("--template-s", type=float, default=600.0, help="modelled seconds recorded")
    ap.add_argument(
        "--template",
        type=Path,
        default=None,
        help="recorded engine: reused if it exists, else kept",
    )
    ap.add_argument("--active", type=int, default=Conversations.active, help="conversations")
    ap.add_argument(
        "--start", choices=("full", "empty"), default="full", help="engines' caches at start"
    )
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the router through the ingest window"
    )
    ap.add_argument("--router-set", action="append", default=[], help="config key=value")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/fleet-scale-latest")
    ap.add_argument("--smoke", action="store_true", help="tiny: 4 engines, 2 s windows")
    args = ap.parse_args(argv)
    # SIGTERM unwinds like an exception, so every point's processes are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.engines, args.window_s, args.settle_s = ["4@0.2"], 2.0, 0.5
        args.template_s, args.request_rate = min(args.template_s, 60.0), 5.0
    args.out.mkdir(parents=True, exist_ok=True)
    template = args.template or args.out / "template.pkl"
    t0 = time.monotonic()
    if template.exists() and args.template:
        model = {"rates": pickle.loads(template.read_bytes())["rates"], "reused": str(template)}
    else:
        model = build_template(template, args.template_s, args.active)
    print(f"template: {time.monotonic() - t0:.1f}s {json.dumps(model['rates'])}", flush=True)
    points = []
    for spec in args.engines:
        n, f = parse_point(spec)
        point = run_point(args, template, n, f)
        print(json.dumps(asdict(point)), flush=True)
        points.append(point)
    result = {
        "benchmark": "fleet_scale",
        # file names only: where a run wrote its files is of no use to a reader
        "args": {k: v.name if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "model": model,
        "points": [asdict(p) for p in points],
        "median_lag_note": "lag includes events.apply_delay_s (2 ms by default)",
    }
    (args.out / "fleet_scale.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "fleet_scale.md").write_text(table(points) + "\n")
    print(table(points))
    if not args.template:
        template.unlink(missing_ok=True)
    return 0 if all(p.status != "error" for p in points) else 1


if __name__ == "__main__":
    raise SystemExit(main())
