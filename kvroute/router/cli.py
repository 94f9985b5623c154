"""`kvroute serve`: run the router (uvicorn with uvloop and httptools).

Flags override the config file, which overrides the defaults; KVROUTE_* environment variables
sit between the file and the flags. `--workers N` runs N router processes on one port (each
with its own index, fed by every bridge; with `index.processes` K > 0 they share the host's K
index shard processes, started here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from kvroute.router.config import POLICY_NAMES
from kvroute.router.config_docs import render_markdown
from kvroute.router.config_load import (
    LOG_LEVELS,
    ConfigError,
    config_from_dict,
    describe_defaults,
    load_config,
)
from kvroute.router.gc_tuning import tune_gc

RESOLVED_ENV = "KVROUTE_RESOLVED_CONFIG"  # the parent's resolved config, for worker processes


def build_parser() -> argparse.ArgumentParser:
    """The `kvroute serve` flags (also listed in docs/configuration.md)."""
    p = argparse.ArgumentParser(
        prog="kvroute serve", description="Run the cache-aware OpenAI router in front of a fleet."
    )
    p.add_argument("--config", help="YAML config file (default: $KVROUTE_CONFIG)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--policy", choices=POLICY_NAMES, help="routing policy (default ttft)")
    p.add_argument("--admin-token", help="bearer token for /admin/* (default: admin disabled)")
    p.add_argument("--workers", type=int, help="router processes on the port (default 1)")
    p.add_argument("--log-level", choices=LOG_LEVELS, help="log level (default info)")
    p.add_argument(
        "--print-defaults", action="store_true", help="print the config reference as YAML"
    )
    p.add_argument(
        "--print-config-docs",
        action="store_true",
        help="print the config reference as Markdown (docs/configuration.md)",
    )
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    pairs = {
        "host": args.host,
        "port": args.port,
        "policy.name": args.policy,
        "admin.token": args.admin_token,
        "processes": args.workers,
        "log_level": args.log_level,
    }
    return {k: v for k, v in pairs.items() if v is not None}


def app_from_env() -> Any:
    """uvicorn factory for worker processes: rebuild the app from the parent's config."""
    from kvroute.router.app import create_app

    config = config_from_dict(json.loads(os.environ[RESOLVED_ENV]))
    _setup_logging(config.log_level)
    app = create_app(config)
    tune_gc()
    return app


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.print_defaults:
        print(describe_defaults(), end="")
        return 0
    if args.print_config_docs:
        print(render_markdown(build_parser()), end="")
        return 0
    try:
        config = load_config(args.config, overrides=flag_overrides(args))
    except ConfigError as exc:
        print(f"kvroute serve: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"config OK: {len(config.workers)} workers, policy {config.policy.name}")
        return 0
    _setup_logging(config.log_level)
    from kvroute.router import listen

    common: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "on",
        "access_log": False,
        "proxy_headers": False,  # the router never reads the client address
        "server_header": False,
        "log_level": config.log_level,
        "timeout_graceful_shutdown": int(config.timeouts.shutdown_s),
        "timeout_keep_alive": int(config.timeouts.keep_alive_s),
        "backlog": 4096,
        "limit_concurrency": config.edge.limit_concurrency,
    }
    send_buffer = config.edge.client_send_buffer_bytes
    if config.processes > 1:
        shards = None
        if config.index.processes > 0:  # one set of shards for all router processes
            from kvroute.router.index_shards.setup import supervisor_for
            from kvroute.router.index_shards.supervisor import DIR_ENV

            shards = supervisor_for(config)
            shards.start()
            os.environ[DIR_ENV] = shards.directory
        os.environ[RESOLVED_ENV] = json.dumps(dataclasses.asdict(config))
        factory = "kvroute.router.cli:app_from_env"
        try:
            return listen.run(factory, common, config.processes, send_buffer)
        finally:
            if shards is not None:
                shards.stop()
    from kvroute.router.app import create_app

    app = create_app(config)
    tune_gc()
    return listen.run(app, common, 1, send_buffer)
