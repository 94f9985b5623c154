"""`kvroute demo`: cache-aware routing against round robin on a simulated hybrid-model fleet.

Runs the built-in workload (:mod:`kvroute.demo.workload`) twice, each time on a fresh fleet of
simulated engines with kvroute bridges (cold caches, so both start equal) and the router in
front: once with round robin, once with kvroute's default cache-aware policy. Prints a
progress line while it runs, then a table, and writes the numbers (JSON) and a picture (PNG).
`--keep` leaves the cache-aware fleet and router running for the dashboard until Ctrl-C;
`--short` is the CI-sized run. `--pd` runs it on a prefill/decode fleet (two engines of each),
where round robin takes both halves of a request in turn, and reports each pool's work
(:mod:`kvroute.demo.pd_report`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from kvroute.demo import pd_report, report
from kvroute.demo.report import write_json
from kvroute.demo.run import LABELS, LiveRun, RunResult, replay, start_live
from kvroute.demo.workload import SETUPS, DemoSetup, demo_trace
from kvroute.sim.profiles import PROFILES
from kvroute.testbed.sim_fleet import FleetError
from kvroute.testbed.stats import RequestRecord
from kvroute.testbed.workload import describe

MODEL = "kvroute-sim"
# Baseline first, so that with --keep the cache-aware run is the one left running.
ORDER = ("round_robin", "kvroute")
_LAYOUTS = {
    "dense": "full attention only",
    "swa": "full attention + sliding window 512",
    "mamba": "full attention + Mamba state",
}


class Progress:
    """One status line per run: rewritten in place on a terminal, every 25% otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO) -> None:
        self.label = label
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.done = self.errors = self.prompt = self.cached = 0
        self.started = time.monotonic()
        self._shown = -1.0
        self._step = 0

    def line(self) -> str:
        width = 24
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        share = self.cached / self.prompt if self.prompt else 0.0
        return (
            f"  {self.label:<22} [{bar}] {self.done:>4}/{self.total} requests  "
            f"cached {share:5.1%}  errors {self.errors}  {time.monotonic() - self.started:5.1f} s"
        )

    def __call__(self, rec: RequestRecord) -> None:
        self.done += 1
        self.errors += 0 if rec.ok else 1
        if rec.ok:
            self.prompt += rec.prompt_tokens or 0
            self.cached += rec.cached_tokens or 0
        if self.tty:
            now = time.monotonic()
            if now - self._shown >= 0.1 or self.done == self.total:
                self._shown = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        else:
            step = 4 * self.done // max(1, self.total)
            if step > self._step:
                self._step = step
                print(self.line(), file=self.stream, flush=True)

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute demo",
        description="Cache-aware routing against round robin on a simulated hybrid-model "
        "fleet: a table, demo.json and demo.png.",
    )
    p.add_argument(
        "--short", action="store_true", help="CI-sized run (seconds; 2 engines, 2 + 2 with --pd)"
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="leave the cache-aware fleet and router running afterwards (dashboard); Ctrl-C "
        "stops them",
    )
    p.add_argument("--out", type=Path, default=Path("demo-results"), help="output directory")
    p.add_argument("--profile", choices=sorted(PROFILES), help="sim model profile")
    p.add_argument("--workers", type=int, help="number of simulated engines (not with --pd)")
    p.add_argument(
        "--pd",
        action="store_true",
        help="a prefill/decode fleet: 2 prefill and 2 decode engines, both halves compared",
    )
    p.add_argument(
        "--policies",
        default=",".join(ORDER),
        help="comma list of runs, in order (kvroute, round_robin)",
    )
    return p


def parse_policies(text: str) -> list[str]:
    """The runs to make, in order; ValueError for an unknown or empty list."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in LABELS]
    if unknown or not policies:
        raise ValueError(f"unknown policies {unknown or text!r}; known: {', '.join(LABELS)}")
    return policies


def _setup(args: argparse.Namespace) -> DemoSetup:
    setup = SETUPS[("pd-" if args.pd else "") + ("short" if args.short else "full")]
    if args.profile:
        setup = replace(setup, profile=args.profile)
    if args.workers:
        setup = replace(setup, workers=args.workers)
    return setup


def _keep_running(live: LiveRun, out: TextIO) -> None:
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    url, token = live.url, live.token
    print(
        f"\nThe fleet and the router ({live.policy}) keep running (Ctrl-C stops them):\n"
        f"  router     {url}   (OpenAI API: {url}/v1/chat/completions)\n"
        f"  dashboard  {url}/dashboard#token={token}\n"
        f"  admin      Authorization: Bearer {token}\n"
        f"  try        curl -s {url}/v1/chat/completions -H 'content-type: application/json' "
        f"""-d '{{"model": "{MODEL}", "max_tokens": 16, "messages": """
        f"""[{{"role": "user", "content": "hello"}}]}}'\n"""
        f"  inspect    kvroute inspect --router {url} --token {token} --prompt 'hello'",
        file=out,
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            for child in live.pg.children:
                if child.popen.poll() is not None:
                    print(f"{child.name} exited; stopping", file=out, flush=True)
                    stop.set()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        print("stopping fleet and router...", file=out, flush=True)
        live.stop()


@dataclass(frozen=True)
class Outputs:
    """How one kind of demo reports: its files' stem, table, summary lines, picture, note."""

    stem: str
    table: Callable[[Sequence[RunResult]], str]
    headline: Callable[[RunResult, RunResult], list[str]]
    write_png: Callable[[Path, str, Sequence[RunResult]], None]
    note: str


OUTPUTS = {
    "mixed": Outputs(
        "demo",
        report.table,
        report.headline,
        report.write_png,
        "prediction error = |router's predicted reuse - engine-reported cached_tokens|, "
        "summed, as a share of the reported cached tokens.",
    ),
    "pd": Outputs(
        "demo-pd",
        pd_report.table,
        pd_report.headline,
        pd_report.write_png,
        "prefill tokens computed = prompt tokens the prefill engines did not find in their "
        "prefix cache; tokens pulled = KV blocks the decode engines read from the prefill "
        "engines, in tokens (both from the engines' own counters).",
    ),
}


def _kind(setup: DemoSetup) -> str:
    return "pd" if setup.pd else "mixed"


def _fleet(setup: DemoSetup) -> str:
    if setup.pd:
        return f"{setup.prefill} prefill and {setup.decode} decode simulated vLLM engines"
    return f"{setup.workers} simulated vLLM engines"


@dataclass
class DemoOutcome:
    runs: list[RunResult]
    json_path: Path
    png_path: Path
    live: LiveRun | None  # the last run's fleet and router, still running (--keep)


def run_demo(
    args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> DemoOutcome:
    """Run every policy and write the outputs (with --keep the last run stays up)."""
    setup = _setup(args)
    policies = parse_policies(args.policies)
    trace = demo_trace(setup, MODEL)
    info = describe(trace)
    print(
        f"kvroute demo: {_fleet(setup)} of a hybrid model "
        f"({_LAYOUTS.get(setup.profile, setup.profile)}), each with a kvroute bridge, "
        f"the router in front.\nWorkload: {info['requests']} requests in "
        + ", ".join(f"{v['sessions']} {k} sessions" for k, v in info["kinds"].items())
        + f". Engines timed at {setup.speed:g}x a modelled H100.",
        file=out,
        flush=True,
    )
    runs: list[RunResult] = []
    live: LiveRun | None = None
    t0 = time.monotonic()
    for i, policy in enumerate(policies, 1):
        print(f"[{i}/{len(policies)}] {LABELS[policy]}: starting a fresh fleet...", file=err)
        live = start_live(setup, policy, args.out / "logs" / policy)
        try:
            progress = Progress(LABELS[policy], len(trace), err)
            runs.append(replay(live, policy, trace, progress))
            progress.finish()
        finally:
            if not (args.keep and i == len(policies)):
                live.stop()
                live = None
    json_path, png_path = _after_runs(runs, setup, args.out, t0, out)
    if not args.keep:
        print(
            "\nTo keep the fleet and router running and watch routing on the dashboard: "
            f"kvroute demo {'--pd ' if setup.pd else ''}--keep",
            file=out,
        )
    return DemoOutcome(runs, json_path, png_path, live)


def _after_runs(
    runs: list[RunResult], setup: DemoSetup, out_dir: Path, t0: float, out: TextIO
) -> tuple[Path, Path]:
    outputs = OUTPUTS[_kind(setup)]
    json_path, png_path = out_dir / f"{outputs.stem}.json", out_dir / f"{outputs.stem}.png"
    setup_doc = {
        "setup": setup.name,
        "profile": setup.profile,
        "workers": setup.workers,
        "prefill": setup.prefill,
        "decode": setup.decode,
        "speed": setup.speed,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    write_json(json_path, setup_doc, runs)
    title = (
        f"kvroute demo: {_fleet(setup).replace(' vLLM', '')}, hybrid model "
        f"({_LAYOUTS.get(setup.profile, setup.profile)})"
    )
    outputs.write_png(png_path, title, runs)
    print("\n" + outputs.table(runs), file=out)
    by = {r.policy: r for r in runs}
    if "kvroute" in by and "round_robin" in by:
        print("\n" + "\n".join(outputs.headline(by["kvroute"], by["round_robin"])), file=out)
    print("\n" + outputs.note, file=out)
    print(f"\nWrote {png_path} and {json_path}.", file=out, flush=True)
    return json_path, png_path


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        parse_policies(args.policies)
    except ValueError as exc:
        parser.error(str(exc))
    if args.pd and args.workers:
        parser.error("--workers sizes a mixed fleet; --pd runs 2 prefill and 2 decode engines")
    t0 = time.monotonic()
    try:
        outcome = run_demo(args)
    except (FleetError, RuntimeError, TimeoutError) as exc:
        print(f"kvroute demo: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvroute demo: interrupted", file=sys.stderr)
        return 130
    errors = sum(r.summary["errors"] for r in outcome.runs)
    print(f"Demo took {time.monotonic() - t0:.0f} s.", file=sys.stderr, flush=True)
    if outcome.live is not None:
        _keep_running(outcome.live, sys.stdout)
    return 1 if errors else 0
