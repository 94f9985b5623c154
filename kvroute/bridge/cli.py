"""`kvroute bridge`: follow a vLLM engine's KV events and serve them to routers over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from kvroute.bridge.app import DEFAULT_MAX_SUBSCRIBERS, Bridge, BridgeConfig
from kvroute.bridge.auth import TOKEN_FILE_ENV, ServerTls, read_secret, read_token
from kvroute.bridge.discovery import ranked_endpoints
from kvroute.bridge.follower import DEFAULT_REPLAY_TIMEOUT
from kvroute.bridge.state import DEFAULT_MAX_BLOCKS, DEFAULT_MAX_LINEAGE_BLOCKS
from kvroute.bridge.stream import (
    DEFAULT_MAX_SNAPSHOT_BUILDS,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_RING_BATCHES,
    StreamLimits,
)

# An engine publishes a step's events as it streams that step's tokens, so a bridge beside it
# is busy exactly when the engine's frontend is; its own work can wait a few milliseconds.
DEFAULT_NICE = 10

log = logging.getLogger("kvroute.bridge")


def build_parser() -> argparse.ArgumentParser:
    """The `kvroute bridge` options."""
    parser = argparse.ArgumentParser(
        prog="kvroute bridge",
        description="Follow a vLLM engine's KV-cache events (ZMQ) and serve them over gRPC.",
        # no prefixes: "--token VALUE" must fail, not be read as "--token-file VALUE"
        allow_abbrev=False,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--engine", help="the engine's PUB endpoint, e.g. tcp://HOST:5557")
    source.add_argument(
        "--discover",
        metavar="URL",
        help="the engine's HTTP base URL; endpoints come from GET /kv_event_sources (vLLM 0.28+)",
    )
    parser.add_argument(
        "--replay", help="the engine's replay ROUTER endpoint, e.g. tcp://HOST:5558"
    )
    parser.add_argument("--topic", default="", help="the engine's topic (a prefix filter)")
    parser.add_argument(
        "--dp-ranks",
        type=int,
        default=1,
        help="data-parallel ranks to follow; rank r uses port + r (vLLM's rule)",
    )
    parser.add_argument("--listen", default="127.0.0.1:50051", help="gRPC HOST:PORT")
    parser.add_argument("--http", help="HOST:PORT for /metrics, /health and /ready")
    parser.add_argument(
        "--token-file",
        default=os.environ.get(TOKEN_FILE_ENV),
        help="file holding the token subscribers must send (default: the file named by "
        f"${TOKEN_FILE_ENV}); unset = no token asked",
    )
    parser.add_argument(
        "--max-subscribers",
        type=int,
        default=DEFAULT_MAX_SUBSCRIBERS,
        help="concurrent gRPC subscribers over all ranks (1+); more are refused",
    )
    parser.add_argument(
        "--max-snapshot-builds",
        type=int,
        default=DEFAULT_MAX_SNAPSHOT_BUILDS,
        help="snapshot builds running at once over all ranks (1+); subscribers arriving "
        "meanwhile share a build or wait for one",
    )
    parser.add_argument("--tls-cert-file", help="PEM certificate to serve gRPC over TLS")
    parser.add_argument("--tls-key-file", help="PEM private key of --tls-cert-file")
    parser.add_argument(
        "--tls-client-ca-file",
        help="PEM CA bundle: subscribers must present a certificate it signed (mutual TLS)",
    )
    parser.add_argument(
        "--max-blocks",
        type=int,
        default=DEFAULT_MAX_BLOCKS,
        help="bound on cached blocks kept per rank for snapshots (oldest dropped beyond it)",
    )
    parser.add_argument(
        "--max-lineage-blocks",
        type=int,
        default=DEFAULT_MAX_LINEAGE_BLOCKS,
        help="bound on evicted ancestors kept per rank to place live blocks in snapshots",
    )
    parser.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULT_QUEUE_SIZE,
        help="messages queued per subscriber before it is resynchronised with a snapshot; "
        "also the batches a snapshot build may fall behind by before it is given up",
    )
    parser.add_argument(
        "--ring-batches",
        type=int,
        default=DEFAULT_RING_BATCHES,
        help="recent batches kept so that reconnecting subscribers can resume",
    )
    parser.add_argument("--replay-timeout", type=float, default=DEFAULT_REPLAY_TIMEOUT)
    parser.add_argument(
        "--nice",
        type=int,
        default=DEFAULT_NICE,
        help="raise the bridge's CPU niceness by this much (0-19): on a host it shares with "
        "the engine, the engine's request and token work goes first",
    )
    parser.add_argument(
        "--sched-idle",
        action="store_true",
        help="run in Linux's SCHED_IDLE class: the bridge only takes CPU time no other process "
        "wants (for a bridge beside a latency-sensitive process, such as the router)",
    )
    parser.add_argument("--log-level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> BridgeConfig:
    """The bridge configuration the options describe; ValueError for inconsistent ones."""
    if args.dp_ranks < 1:
        raise ValueError("--dp-ranks must be at least 1")
    if not 0 <= args.nice <= 19:
        raise ValueError("--nice must be between 0 and 19")
    if args.max_subscribers < 1:
        raise ValueError("--max-subscribers must be at least 1")
    if args.max_snapshot_builds < 1:
        raise ValueError("--max-snapshot-builds must be at least 1")
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if args.tls_client_ca_file and not args.tls_cert_file:
        raise ValueError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
    for path in (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file):
        if path:
            read_secret(path, "PEM")  # unreadable or empty: a clear error now, not at start
    tls = (
        ServerTls(args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file)
        if args.tls_cert_file
        else None
    )
    engines = (
        tuple(ranked_endpoints(args.engine, args.replay, args.topic, args.dp_ranks))
        if args.engine
        else ()
    )
    return BridgeConfig(
        engines=engines,
        discover_url=args.discover,
        listen=args.listen,
        http=args.http,
        max_blocks=args.max_blocks,
        max_lineage_blocks=args.max_lineage_blocks,
        limits=StreamLimits(queue_size=args.queue_size, ring_batches=args.ring_batches),
        replay_timeout=args.replay_timeout,
        token=read_token(args.token_file) if args.token_file else None,
        tls=tls,
        max_subscribers=args.max_subscribers,
        max_snapshot_builds=args.max_snapshot_builds,
    )


async def serve(config: BridgeConfig) -> None:
    """Run a bridge until SIGTERM or SIGINT, then shut it down cleanly."""
    bridge = Bridge(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await bridge.start()
    print(
        f"kvroute bridge: gRPC on port {bridge.grpc_port}"
        + (f", HTTP on port {bridge.http_port}" if config.http else ""),
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await bridge.stop()


def main(argv: list[str]) -> int:
    """`kvroute bridge`: run until SIGTERM or SIGINT; 2 for bad options."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvroute bridge: {exc}")
        return 2
    if args.nice:
        try:
            os.nice(args.nice)
        except OSError as exc:  # e.g. a sandbox without setpriority: run at the old priority
            log.warning("cannot lower the bridge's CPU priority: %s", exc)
    if args.sched_idle:
        # set before any thread starts (gRPC's, ZMQ's): new threads inherit the class
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError) as exc:  # not Linux, or not allowed
            log.warning("cannot run the bridge at SCHED_IDLE: %s", exc)
    asyncio.run(serve(config))
    return 0
