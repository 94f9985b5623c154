"""DP endpoints, /kv_event_sources discovery, the stream's resume ring, and the CLI."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from bridge_testkit import FakeEngine, Recorder, be, eventually, store

from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.cli import DEFAULT_NICE
from kvroute.bridge.discovery import offset_port, parse_sources, ranked_endpoints, substitute_host
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.state import EngineState
from kvroute.bridge.stream import RankStream, StreamLimits
from kvroute.proto.events_pb2 import KvEventBatch, SubscribeRequest, SubscribeResponse

ROOT = Path(__file__).resolve().parents[2]


def test_offset_port_follows_vllm() -> None:
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://host:5557", 3) == "tcp://host:5560"
    assert offset_port("tcp://*:0", 2) == "tcp://*:0"
    eps = ranked_endpoints("tcp://h:5557", "tcp://h:5558", "kv", 2)
    assert [(e.dp_rank, e.events, e.replay, e.topic) for e in eps] == [
        (0, "tcp://h:5557", "tcp://h:5558", "kv"),
        (1, "tcp://h:5558", "tcp://h:5559", "kv"),
    ]


def test_substitute_host_and_parse_sources() -> None:
    assert substitute_host("tcp://*:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert substitute_host("tcp://0.0.0.0:1", "h") == "tcp://h:1"
    assert substitute_host("tcp://[::]:1", "::1") == "tcp://[::1]:1"
    assert substitute_host("tcp://10.1.1.1:5", "h") == "tcp://10.1.1.1:5"
    body = {
        "1": {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:5559", "topic": "kv"},
        "0": {"endpoint": "tcp://10.0.0.9:40000", "replay_endpoint": None},
    }
    eps = parse_sources(body, "engine")
    assert [(e.dp_rank, e.events, e.replay, e.topic) for e in eps] == [
        (0, "tcp://10.0.0.9:40000", None, ""),
        (1, "tcp://engine:5558", "tcp://engine:5559", "kv"),
    ]
    for bad in ([], {"x": {}}, {"0": {"endpoint": 3}}):
        with pytest.raises(ValueError):
            parse_sources(bad, "h")


def test_bridge_discovers_ranks_from_engine() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        engines = [FakeEngine(ctx, dp_rank=r) for r in (0, 1)]
        sources = {
            str(e.dp_rank): {
                "endpoint": f"tcp://*:{e.pub_port}",
                "replay_endpoint": f"tcp://*:{e.replay_port}",
                "topic": "kv",
            }
            for e in engines
        }
        calls = 0

        async def kv_event_sources(_: web.Request) -> web.Response:
            nonlocal calls
            calls += 1  # the first answer comes from an engine that is not ready yet
            return web.json_response(sources if calls > 1 else {})

        app = web.Application()
        app.router.add_get("/kv_event_sources", kv_event_sources)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        bridge = Bridge(BridgeConfig(discover_url=f"http://127.0.0.1:{port}", listen="127.0.0.1:0"))
        await bridge.start()
        await eventually(lambda: len(bridge.streams) == 2 and bridge.ready)
        assert bridge.followers[1].endpoints.events == f"tcp://127.0.0.1:{engines[1].pub_port}"
        rec = Recorder(f"127.0.0.1:{bridge.grpc_port}", dp_rank=1)
        await asyncio.sleep(0.3)
        await engines[1].publish([store([5], None, list(range(16)))])
        await rec.wait_for(lambda: (0, be(5)) in rec.view.counts)
        await rec.close()
        await bridge.stop()
        await runner.cleanup()
        for e in engines:
            await e.close()
        ctx.destroy(linger=0)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_resume_needs_the_ring_and_the_same_stream() -> None:
    async def main() -> None:
        stream = RankStream(
            0, "b", EngineState(), BridgeMetrics(), StreamLimits(queue_size=8, ring_batches=2)
        )
        for seq in range(5):
            stream.apply(KvEventBatch(sequence=seq))

        def first(request: SubscribeRequest) -> SubscribeResponse:
            queue = stream.subscribe(request).queue
            return SubscribeResponse.FromString(queue.get_nowait())

        sid = stream.stream_id
        ok = first(SubscribeRequest(resume=True, stream_id=sid, after_sequence=2))
        assert ok.batch.sequence == 3
        too_old = first(SubscribeRequest(resume=True, stream_id=sid, after_sequence=1))
        assert too_old.snapshot.reason == "resume_unavailable"
        other = first(SubscribeRequest(resume=True, stream_id="x", after_sequence=3))
        assert other.snapshot.reason == "resume_unavailable"
        ahead = first(SubscribeRequest(resume=True, stream_id=sid, after_sequence=9))
        assert ahead.snapshot.reason == "resume_unavailable"
        current = stream.subscribe(SubscribeRequest(resume=True, stream_id=sid, after_sequence=4))
        assert current.queue.empty()  # nothing missed: live from here
        stream.reset("gap", 4)
        assert stream.stream_id != sid
        reset = SubscribeResponse.FromString(current.queue.get_nowait())
        assert reset.snapshot.reason == "gap" and reset.snapshot.sequence == 4

    asyncio.run(main())


def test_cli_runs_and_stops_on_sigterm() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute",
            "bridge",
            "--engine",
            f"tcp://127.0.0.1:{port}",
            "--topic",
            "kv",
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the bridge did not start within 30 s"
        line = proc.stdout.readline()
        assert "gRPC on port" in line, line
        # it runs below the engine's CPU priority (its default niceness increment)
        expected_nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + DEFAULT_NICE)
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == expected_nice
        http_port = int(line.rsplit("HTTP on port ", 1)[1])
        deadline = time.monotonic() + 10
        while True:
            health = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).json()
            if health["ready"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert health["ready"] and health["ranks"]["0"]["engine"].endswith(str(port))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close(linger=0)
        ctx.term()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_cli_sched_idle_puts_every_thread_in_the_idle_class() -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "kvroute", "bridge", "--engine", f"tcp://127.0.0.1:{port}",
            "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--sched-idle"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and "gRPC on port" in proc.stdout.readline()
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) > 1  # gRPC's and ZMQ's threads are running by now
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_IDLE}
    finally:
        proc.kill()
        proc.wait(timeout=10)
        pub.close(linger=0)
        ctx.term()


def test_cli_rejects_bad_arguments() -> None:
    from kvroute.bridge.cli import main

    assert main(["--engine", "tcp://127.0.0.1:1", "--dp-ranks", "0"]) == 2
    assert main(["--engine", "tcp://127.0.0.1:1", "--nice", "20"]) == 2
    assert main(["--engine", "tcp://127.0.0.1:1", "--nice", "-1"]) == 2  # raising priority: no
    with pytest.raises(SystemExit):
        main(["--listen", "127.0.0.1:0"])  # no engine and no discovery
