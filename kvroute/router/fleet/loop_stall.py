"""How long this process's event loop could not run, so timeouts that judge a worker do not
count the router's own stalls against it.

A burst of requests arriving together is handled in one pass of the event loop (parse,
tokenize, score each), during which no timer fires and no finished connect is noticed; on a
loaded machine that pass can last longer than a connect or probe timeout. Without this, the
worker whose TCP handshake had long completed was charged a timeout, its breaker opened, and
every later request got 503 (seen in the load test: two healthy engines, both breakers open).

`LoopStalls` measures stalls with a ticker while such a wait is pending; `wait_own_time` is
`asyncio.wait_for` whose clock stops while the loop is stalled (up to a hard cap, so a loop
that never recovers still times out).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

TICK_S = 0.025  # how often the ticker asks to run; its lateness is the stall
MIN_STALL_S = 0.005  # later than this is recorded (smaller is scheduling noise)
MAX_RECORDED = 4096  # stalls remembered (bounded; at most one per tick, so > 100 s of history)
MAX_STRETCH = 4.0  # a timeout is never stretched beyond this many times its length


class LoopStalls:
    """Stalls of the running event loop, measured by a ticker task that runs only while some
    `wait_own_time` is pending (an always-on 25 ms ticker cost an idle router 1.1% of a core
    here, for measurements only those waits read)."""

    def __init__(self, tick_s: float = TICK_S, max_recorded: int = MAX_RECORDED) -> None:
        self._tick_s = tick_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=max_recorded)  # (end, length)
        self._due = 0.0  # when the ticker should next run; later than this = stalling now
        self._task: asyncio.Task[None] | None = None
        self._watchers = 0  # pending waits
        self.total_s = 0.0  # every stall recorded

    @property
    def ticking(self) -> bool:
        """Whether the ticker runs (some wait is pending)."""
        return self._task is not None

    def watch(self) -> None:
        """A wait begins: measure from now on (the ticker runs while any wait is pending)."""
        self._watchers += 1
        if self._task is None:
            loop = asyncio.get_running_loop()
            self._due = loop.time() + self._tick_s  # a stall before the first tick counts too
            self._task = loop.create_task(self._run(), name="loop-stalls")

    def unwatch(self) -> None:
        """A wait ended; the last one stops the ticker."""
        self._watchers = max(self._watchers - 1, 0)  # `stop` may have reset it
        if self._watchers == 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def stop(self) -> None:
        """Stop the ticker (on shutdown)."""
        self._watchers = 0
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def __aenter__(self) -> LoopStalls:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(self._due - loop.time(), 0.0))
            now = loop.time()
            self.record(now - self._due, now)
            self._due = now + self._tick_s

    def record(self, late_s: float, now: float) -> None:
        """Note that the loop could not run for `late_s` seconds up to `now`."""
        if late_s >= MIN_STALL_S:
            self._stalls.append((now, late_s))
            self.total_s += late_s

    def stalled_since(self, since: float, now: float) -> float:
        """Seconds of [since, now] during which the loop was stalled, including a stall still
        going on (the ticker is overdue)."""
        total = 0.0
        for end, length in reversed(self._stalls):
            if end <= since:
                break
            total += end - max(end - length, since)
        if self.ticking and now - self._due >= MIN_STALL_S:
            total += now - max(self._due, since)
        return total


async def wait_own_time(aw: Awaitable[T], timeout_s: float, stalls: LoopStalls | None) -> T:
    """`await aw`, raising TimeoutError after `timeout_s` seconds of time the loop could run
    (stalls of the loop do not count, up to MAX_STRETCH times `timeout_s` in all). The
    awaitable is cancelled on timeout and when the caller is cancelled."""
    if stalls is None:
        async with asyncio.timeout(timeout_s):
            return await aw
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    start = loop.time()
    hard = start + timeout_s * MAX_STRETCH
    stalls.watch()
    try:
        while True:
            now = loop.time()
            deadline = min(start + timeout_s + stalls.stalled_since(start, now), hard)
            if now >= deadline:
                break
            done, _ = await asyncio.wait((task,), timeout=deadline - now)
            if done:
                return task.result()
        # the stall may have hidden a completion noticed in this same pass
        if task.done():
            return task.result()
    except BaseException:
        task.cancel()
        raise
    finally:
        stalls.unwatch()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise TimeoutError
