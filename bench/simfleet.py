"""A stand-in for ``kvroute sim fleet`` while the sim's own fleet command is not there.

``python -m bench.simfleet --workers N --model-profile P --config-out PATH [--speed S]``
starts N simulated engines (``sim.server.start_engine``), each in its own process, writes
a router config (notes/router-config.md: ``workers`` with ``name``, ``url``, ``model`` and
the engine's ZMQ ``zmq``/``replay`` endpoints) once every engine listens, and stops them
all on SIGTERM/SIGINT. No bridges: routers that need events subscribe to the engines'
ZMQ sockets directly.

Each engine also answers ``POST /sim/probe`` (the oracle's question, notes/sim-oracle.md):
the body is an OpenAI completions or chat request; the answer is how many prompt tokens
the engine would reuse right now, computed by the engine's own cache lookup on the same
token ids it would schedule, with nothing allocated or published.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml


def _add_probe(app: Any, engine: Any) -> None:
    """Mount /sim/probe on a sim app (unless the sim already has one)."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from sim.api.errors import ApiError
    from sim.api.requests import parse_chat, parse_completion
    from sim.cache_api import CacheRequest

    if any(getattr(r, "path", None) == "/sim/probe" for r in app.router.routes):
        return
    ids = itertools.count()

    async def probe(request: Request) -> JSONResponse:
        body = json.loads(await request.body())
        parse = parse_chat if "messages" in body else parse_completion
        try:
            parsed = parse(body, engine.config, engine.tokenizer)
        except ApiError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        tokens = parsed.prompts[0]
        rid = f"bench-probe-{next(ids)}"
        lora = parsed.lora_name
        cache = engine.cache
        cache.add_request(
            CacheRequest(
                rid,
                tuple(tokens),
                lora_name=lora,
                lora_id=engine.config.lora_id(lora) if lora else None,
                lora_path=f"/adapters/{lora}" if lora else None,
                cache_salt=parsed.cache_salt,
            )
        )
        try:
            hit = cache.lookup(rid).hit_tokens
        finally:
            cache.seqs.pop(rid, None)  # never scheduled: nothing allocated to free
        return JSONResponse({"prompt_tokens": len(tokens), "cached_tokens": hit})

    app.router.routes.insert(0, Route("/sim/probe", probe, methods=["POST"]))


async def _serve_one(args: argparse.Namespace) -> None:
    import uvicorn

    from sim.api.app import build_app
    from sim.engine.core import Engine, EngineConfig
    from sim.publisher import EventPublisher, PublisherConfig
    from sim.server import bind_socket

    cfg = EngineConfig(
        model=args.model,
        profile=args.model_profile,
        speed=args.speed,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
    )
    publisher = EventPublisher(PublisherConfig())
    publisher.start()
    engine = Engine(cfg, publisher=publisher)
    app = build_app(engine, publisher)
    _add_probe(app, engine)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.01)
    info = {
        "url": f"http://127.0.0.1:{sock.getsockname()[1]}",
        "zmq": publisher.endpoint,
        "replay": publisher.replay_endpoint,
    }
    Path(args.info_out).write_text(json.dumps(info))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    with contextlib.suppress(asyncio.CancelledError):
        await task
    publisher.close()


def _run_fleet(args: argparse.Namespace) -> int:
    out = Path(args.config_out)
    tmp = out.parent / f".{out.name}.parts"
    tmp.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for i in range(args.workers):
            info = tmp / f"w{i}.json"
            info.unlink(missing_ok=True)
            cmd = [
                sys.executable, "-m", "bench.simfleet", "--one", "--info-out", str(info),
                "--model", args.model, "--model-profile", args.model_profile,
                "--speed", str(args.speed), "--num-blocks", str(args.num_blocks),
                "--max-num-seqs", str(args.max_num_seqs),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd))
        deadline = time.monotonic() + 60
        infos: list[dict[str, str]] = []
        for i, p in enumerate(procs):
            info = tmp / f"w{i}.json"
            while not info.exists():
                if p.poll() is not None or time.monotonic() > deadline or stop["flag"]:
                    print(f"engine w{i} failed to start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            infos.append(json.loads(info.read_text()))
        config = {
            "workers": [
                {"name": f"w{i}", "url": d["url"], "model": args.model, "zmq": d["zmq"],
                 "replay": d["replay"]}
                for i, d in enumerate(infos)
            ],
            "models": {args.model: {"tokenizer": _model_dir()}},
        }  # fmt: skip
        part = out.with_suffix(".tmp")
        part.write_text(yaml.safe_dump(config, sort_keys=False))
        os.replace(part, out)
        print(f"fleet of {len(procs)} engines ready; config in {out}", flush=True)
        while not stop["flag"] and all(p.poll() is None for p in procs):
            time.sleep(0.2)
        return 0
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _model_dir() -> str:
    from sim.model import MODEL_DIR

    return str(MODEL_DIR)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simfleet", description=__doc__)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model-profile", default="dense")
    p.add_argument("--model", default="kvroute-sim")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--config-out", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--info-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        asyncio.run(_serve_one(args))
        return 0
    if not args.config_out:
        p.error("--config-out is required")
    return _run_fleet(args)


if __name__ == "__main__":
    raise SystemExit(main())
