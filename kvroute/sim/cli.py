"""`kvroute sim`: run one simulated vLLM engine; `kvroute sim fleet`: run several, with bridges.

`kvroute sim` prints one JSON line once it serves: {"ready": true, "url", "events", "replay",
"model", "pid"} and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from kvroute.sim.engine_args import add_engine_args, cache_factory, engine_config
from kvroute.sim.publisher import PublisherConfig


def build_parser() -> argparse.ArgumentParser:
    """The `kvroute sim` options."""
    p = argparse.ArgumentParser(
        prog="kvroute sim",
        description="Run a simulated vLLM engine (OpenAI HTTP API + KV events on ZMQ). "
        "`kvroute sim fleet --help` runs several.",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 = any free port)")
    p.add_argument("--events-endpoint", default="tcp://127.0.0.1:0", help="ZMQ PUB bind address")
    p.add_argument("--replay-endpoint", default="tcp://127.0.0.1:0", help="ZMQ ROUTER bind")
    p.add_argument(
        "--name",
        help="engine name, answered as `system_fingerprint` (lets a benchmark see which engine "
        "served a request behind any router); default none, as vLLM",
    )
    return p


async def _serve(args: argparse.Namespace) -> int:
    from kvroute.sim.server import start_engine

    publisher = None
    if not args.no_events:
        publisher = PublisherConfig(
            endpoint=args.events_endpoint,
            replay_endpoint=None if args.no_replay else args.replay_endpoint,
            topic=args.topic,
            wire_version=args.wire_version,
        )
    running = await start_engine(
        engine_config(args),
        publisher,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        cache_factory=cache_factory(args.cache_backend),
        name=args.name,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    info: dict[str, Any] = {
        "ready": True,
        "url": running.url,
        "events": running.events,
        "replay": running.replay,
        "topic": args.topic,
        "model": args.model,
        "pid": os.getpid(),
    }
    print(json.dumps(info), flush=True)
    try:
        await stop.wait()
    finally:
        await running.aclose()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`kvroute sim [fleet]`: run until SIGINT/SIGTERM; 2 for bad options."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fleet":
        from kvroute.sim.fleet_cli import main as fleet_main

        return fleet_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    try:
        engine_config(args).cache_spec()
        cache_factory(args.cache_backend)
    except ImportError as exc:
        print(
            f"kvroute sim: --cache-backend {args.cache_backend} unavailable: {exc}", file=sys.stderr
        )
        return 2
    except ValueError as exc:
        print(f"kvroute sim: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args))
