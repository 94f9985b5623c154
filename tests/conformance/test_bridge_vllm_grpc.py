"""A real bridge fed by vLLM's real publisher, checked at its gRPC subscribers.

The vLLM driver (in the vLLM environment) publishes recorded scenarios again through vLLM's
`ZmqEventPublisher`, bound on ipc endpoints (vLLM binds only wildcard, ipc and inproc
endpoints; ipc keeps the test off the network). The bridge joins after the first batches, so
it must fetch them from vLLM's replay socket. A router-side subscriber that is connected from
the start must receive exactly the converted recording, and `indexer.GroupCache` fed from the
gRPC stream must answer every probe as vLLM did; a subscriber joining at the end gets a
snapshot that answers the final probes as vLLM did.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from vllm_recording import DRIVER, REPO, at_each_probe, converted, probe_namespace, vllm_python

from kvroute.bridge.app import Bridge, BridgeConfig
from kvroute.bridge.client import subscribe
from kvroute.bridge.follower import EngineEndpoints
from kvroute.indexer import GroupCache
from kvroute.proto.events_pb2 import SubscribeResponse

pytestmark = pytest.mark.vllm

SERVED = ["mamba64_partial_r0", "hybrid16_r64_w48"]
PAUSE_AT = 12
TIMEOUT = 30.0


class Driver:
    """The vLLM driver in --serve mode, spoken to line by line."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def expect(self, keyword: str) -> list[str]:
        assert self.process.stdout is not None
        while True:
            raw = await asyncio.wait_for(self.process.stdout.readline(), TIMEOUT)
            if not raw:
                raise AssertionError(f"the vLLM driver exited while waiting for {keyword}")
            words = raw.decode().split()
            if words and words[0] == keyword:  # vLLM's own log lines are skipped
                return words

    async def say(self, word: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{word}\n".encode())
        await self.process.stdin.drain()


async def _collect(target: str, into: list[SubscribeResponse]) -> None:
    async for message in subscribe(target):
        into.append(message)


async def _wait_for(condition: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + TIMEOUT
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _running(task: Any) -> AsyncIterator[asyncio.Task[None]]:
    running = asyncio.ensure_future(task)
    try:
        yield running
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def _follow_one(
    driver: Driver, sc: dict[str, Any]
) -> tuple[list[SubscribeResponse], SubscribeResponse]:
    """One served scenario: what an early subscriber and a late one received."""
    _, name, paused, endpoint, replay = await driver.expect("PAUSED")
    assert name == sc["name"] and int(paused) == PAUSE_AT
    config = BridgeConfig(
        engines=(EngineEndpoints(0, endpoint, replay, sc["topic"]),), listen="127.0.0.1:0"
    )
    bridge = Bridge(config)
    await bridge.start()
    try:
        target = f"127.0.0.1:{bridge.grpc_port}"
        early: list[SubscribeResponse] = []
        async with _running(_collect(target, early)):
            await _wait_for(lambda: bridge.ready and early, "the bridge and its first snapshot")
            await driver.say("GO")
            _, name, count = await driver.expect("DONE")
            total = int(count)
            assert total == len(sc["frames"]), "the served run differs from the recording"

            def complete() -> bool:
                return any(m.HasField("batch") and m.batch.sequence == total - 1 for m in early)

            await _wait_for(complete, f"batch {total - 1} at the subscriber")
        late: list[SubscribeResponse] = []
        async with _running(_collect(target, late)):
            await _wait_for(lambda: late, "the late subscriber's snapshot")
        await driver.say("NEXT")
        return early, late[0]
    finally:
        await bridge.stop()


async def _serve_and_follow(
    scenarios: list[dict[str, Any]],
) -> list[tuple[list[SubscribeResponse], SubscribeResponse]]:
    directory = tempfile.mkdtemp(prefix="kvconf-")  # short: ipc paths are length-limited
    process = await asyncio.create_subprocess_exec(
        str(vllm_python()),
        str(DRIVER),
        "--serve",
        directory,
        "--pause-at",
        str(PAUSE_AT),
        "--only",
        *[sc["name"] for sc in scenarios],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        cwd=REPO,
    )
    driver = Driver(process)
    try:
        return [await _follow_one(driver, sc) for sc in scenarios]
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        for leftover in Path(directory).iterdir():
            leftover.unlink()
        os.rmdir(directory)


@pytest.fixture(scope="module")
def followed(
    scenarios_by_name: dict[str, dict[str, Any]],
) -> dict[str, tuple[list[SubscribeResponse], SubscribeResponse]]:
    scenarios = [scenarios_by_name[name] for name in SERVED]
    results = asyncio.run(_serve_and_follow(scenarios))
    return dict(zip(SERVED, results, strict=True))


@pytest.mark.parametrize("name", SERVED)
def test_subscriber_receives_the_converted_vllm_stream(
    scenarios_by_name: dict[str, dict[str, Any]],
    followed: dict[str, tuple[list[SubscribeResponse], SubscribeResponse]],
    name: str,
) -> None:
    sc = scenarios_by_name[name]
    early, _ = followed[name]
    first, rest = early[0], early[1:]
    assert first.HasField("snapshot") and not first.snapshot.events
    assert all(m.HasField("batch") for m in rest), "a reset reached the subscriber"
    expected = list(converted(sc))
    received = [m.batch for m in rest]
    assert [b.sequence for b in received] == list(range(len(expected)))
    for got, want in zip(received, expected, strict=True):
        assert got == want, f"batch {want.sequence} differs"


@pytest.mark.parametrize("name", SERVED)
def test_index_fed_over_grpc_matches_vllm(
    scenarios_by_name: dict[str, dict[str, Any]],
    followed: dict[str, tuple[list[SubscribeResponse], SubscribeResponse]],
    name: str,
) -> None:
    sc = scenarios_by_name[name]
    early, late = followed[name]
    cache = GroupCache(hash_unit=16)
    cache.apply_snapshot(early[0].snapshot)
    batches = [m.batch for m in early[1:]]
    answers = at_each_probe(
        sc["probes"],
        batches,
        cache.apply,
        lambda probe: cache.reusable_tokens(probe["tokens"], probe_namespace(probe)),
    )
    for probe, got in zip(sc["probes"], answers, strict=True):
        assert got == (probe["hit"] if probe["after"] else None), probe["label"]

    # A subscriber that joins at the end is warm at once: the snapshot answers as vLLM does.
    assert late.HasField("snapshot") and late.snapshot.sequence == len(batches) - 1
    warm = GroupCache(hash_unit=16)
    warm.apply_snapshot(late.snapshot)
    final = [p for p in sc["probes"] if p["after"] == len(batches)]
    assert final
    for probe in final:
        got = warm.reusable_tokens(probe["tokens"], probe_namespace(probe))
        assert got == probe["hit"], probe["label"]
