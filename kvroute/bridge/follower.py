"""Follows one engine rank's ZMQ event stream: ordering, replay, resets (spec §1).

- SUB socket on the engine's PUB endpoint (topic prefix filter), connecting and reconnecting
  on its own, so an engine that is not up yet is simply waited for.
- `seq` is tracked per rank. A gap is filled from the engine's ROUTER replay socket through a
  DEALER (both reply layouts); the first replayed seq must be the one asked for, and every seq
  is applied once. A gap the replay cannot cover, `seq` going back (engine restart), a
  reconnect, or a malformed message resets the rank's view: subscribers get an empty
  snapshot with a new stream id instead of a silently wrong view.
- Joining mid-stream (bridge started after the engine): the replay is asked for everything
  from seq 0; what the engine still buffers is applied first. A bridge beside a quiet engine
  joins the same way without waiting for a batch; the live copies of batches that replay
  already delivered may still be in flight, and are told from a restarted engine's batches
  (which reuse the seqs) by their payload's digest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import xxhash
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.bridge.convert import TIER_NAMES, ConvertStats, convert_batch
from kvroute.bridge.metrics import BridgeMetrics
from kvroute.bridge.stream import RankStream
from kvroute.bridge.vllm_schema import (
    BatchDecoder,
    LiveMessage,
    MalformedFrame,
    MalformedPayload,
    parse_live,
    parse_replay_reply,
    replay_request_frames,
)
from kvroute.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT: Final = 5.0
DEFAULT_SUB_HWM: Final = 100_000
_IDLE_POLL_MS: Final = 100
# Digests kept of an idle join's replayed batches: their live copies can only be the ones in
# flight when the replay ran. An older copy beyond this many is taken for a restart (a needless
# reset, never a wrong view).
_REPLAYED_DIGESTS_MAX: Final = 4096


@dataclass(frozen=True)
class EngineEndpoints:
    """Where one engine rank publishes: PUB endpoint, optional replay ROUTER, topic."""

    dp_rank: int
    events: str
    replay: str | None = None
    topic: str = ""


class EngineFollower:
    """Feeds one `RankStream` from one engine rank. Run `run()` as a task; cancel to stop."""

    def __init__(
        self,
        endpoints: EngineEndpoints,
        stream: RankStream,
        metrics: BridgeMetrics,
        ctx: zmq.asyncio.Context,
        *,
        replay_timeout: float = DEFAULT_REPLAY_TIMEOUT,
        sub_hwm: int = DEFAULT_SUB_HWM,
    ) -> None:
        self.endpoints = endpoints
        self.stream = stream
        self._metrics = metrics
        self._ctx = ctx
        self._replay_timeout = replay_timeout
        self._sub_hwm = sub_hwm
        self._label = str(endpoints.dp_rank)
        self._decoder = BatchDecoder()
        self._stats = ConvertStats()
        self._log = RateLimitedLog(log, interval_s=10.0)
        self._dealer: zmq.asyncio.Socket | None = None
        self._last: int | None = None  # last seq applied
        self._live_high: int | None = None  # highest seq seen on the live socket
        # seq -> payload digest of batches an idle join's replay applied, until a live message
        self._replayed: dict[int, int] = {}
        self._joined = False  # False: the next message starts a (re)join
        self._reconnected = False
        self.connected = False  # the PUB socket's handshake succeeded and holds
        self._unknown_seen = 0  # the decoder's unknown_field_batches already counted

    # -- socket lifecycle -----------------------------------------------------------------

    async def run(self) -> None:
        """Subscribe to the engine and apply its messages until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._sub_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode("utf-8"))
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoints.events)
        watcher = asyncio.ensure_future(self._watch(monitor))
        try:
            while True:
                if not await sub.poll(_IDLE_POLL_MS):
                    await self._join_idle()
                    continue
                frames = await sub.recv_multipart()
                await self.on_live(frames)
                # A ready message completes without suspending: let subscribers' writers run.
                await asyncio.sleep(0)
        finally:
            watcher.cancel()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            self._close_dealer()
            self.connected = False
            self._metrics.engine_connected.labels(self._label).set(0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self._metrics.engine_connected.labels(self._label).set(1)
                log.info("rank %s: connected to %s", self._label, self.endpoints.events)
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self._reconnected = True
                self._metrics.engine_connected.labels(self._label).set(0)
                log.warning("rank %s: engine disconnected; waiting", self._label)
                # The engine may have crashed or restarted, its cache with it; a view kept
                # until it publishes again could only give routers stale hits.
                if self._last is not None:
                    self._reset("disconnect", None)

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    # -- live messages --------------------------------------------------------------------

    async def on_live(self, frames: Sequence[bytes]) -> None:
        """Handle one live multipart message (public for tests that drive it directly)."""
        try:
            message = parse_live(frames)
        except MalformedFrame as exc:
            problem = "seq" if len(frames) == 3 else "frames"
            self._malformed(problem, exc)
            # The batch is lost and its seq unknown: start over from whatever comes next.
            self._reset("malformed", None)
            self._joined = True
            return
        seq = message.seq
        if self._reconnected:
            self._reconnected = False
            self._live_high = None
            if self._last is not None:
                self._reset("reconnect", None)
        if self._last is None:
            await self._join(message)
        elif seq == self._last + 1:
            self._apply(seq, message.payload)
        elif seq <= self._last:
            if self._is_replayed_copy(seq, message.payload):
                pass  # the live copy of a batch the joining replay delivered
            elif self._live_high is None or seq <= self._live_high:
                # The live publisher only counts up: going back means a new engine.
                self._log.warning(
                    "restart",
                    "rank %s: seq went back %s -> %s: engine restarted",
                    self._label,
                    self._last,
                    seq,
                )
                self._reset("restart", None)
                self._live_high = None
                await self._join(message)
            # else: a replay already delivered this one
        else:
            self._metrics.gaps.labels(self._label).inc()
            await self._recover(message)
        self._live_high = seq if self._live_high is None else max(self._live_high, seq)
        # From here on the live seqs are known: anything at or below them going back is a restart,
        # anything above them and at or below `_last` came through the replay.
        self._replayed.clear()

    async def _join_idle(self) -> None:
        """Connected to an engine that is quiet: take what its replay buffer holds now
        instead of waiting for its next batch (a bridge restarted beside an idle engine
        would otherwise show routers an empty cache)."""
        if self.connected and not self._joined and self.endpoints.replay:
            # The replay's answer comes from the engine as it is now: a reconnect before it
            # needs no second reset at the next live message, and the old engine's live seqs
            # say nothing about the new one's.
            self._reconnected = False
            self._live_high = None
            self._replayed.clear()
            await self._replay(0, joining=True, remember=True)
            self._joined = True

    async def _join(self, message: LiveMessage) -> None:
        """First message of a (re)started view: replay from 0 if the engine can."""
        if not self._joined and message.seq > 0 and self.endpoints.replay:
            await self._replay(0, joining=True)
        self._joined = True
        self._apply_held(message)

    async def _recover(self, held: LiveMessage) -> None:
        assert self._last is not None
        if self.endpoints.replay:
            await self._replay(self._last + 1, joining=False)
        else:
            self._metrics.replays.labels(self._label, "unavailable").inc()
        self._apply_held(held)

    def _apply_held(self, held: LiveMessage) -> None:
        last = self._last
        if last is not None and held.seq <= last:
            return
        if last is not None and held.seq != last + 1:
            self._log.warning(
                "gap",
                "rank %s: cannot recover seqs %s..%s: view reset",
                self._label,
                last + 1,
                held.seq - 1,
            )
            self._reset("gap", held.seq - 1)
        self._apply(held.seq, held.payload)

    # -- replay ---------------------------------------------------------------------------

    async def _replay(self, start: int, *, joining: bool, remember: bool = False) -> None:
        """Ask the engine for seqs >= start and apply them in order; with `remember`, keep
        the applied batches' digests for telling their live copies from a restart."""
        assert self.endpoints.replay is not None
        if self._dealer is None:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.endpoints.replay)
        dealer = self._dealer
        await dealer.send_multipart(replay_request_frames(start))
        first = True
        outcome = "recovered"
        timeout_ms = int(self._replay_timeout * 1000)
        while True:
            if not await dealer.poll(timeout_ms):
                outcome = "timeout"
                self._log.warning(
                    "replay-timeout", "rank %s: replay from %s timed out", self._label, start
                )
                self._close_dealer()  # late replies must not be mistaken for the next ones
                break
            frames = await dealer.recv_multipart()
            try:
                item = parse_replay_reply(frames)
            except MalformedFrame as exc:
                self._malformed("replay", exc)
                continue
            if item is None:
                break
            self._metrics.replayed_batches.labels(self._label).inc()
            if first:
                first = False
                if item.seq != start:
                    outcome = "partial" if joining else "unrecoverable"
                    if not joining:
                        self._log.warning(
                            "replay-short",
                            "rank %s: replay starts at %s, needed %s: view reset",
                            self._label,
                            item.seq,
                            start,
                        )
                        self._reset("gap", item.seq - 1)
            if self._last is not None and item.seq <= self._last:
                continue
            if self._last is not None and item.seq != self._last + 1:
                self._reset("gap", item.seq - 1)
            self._apply(item.seq, item.payload)
            if remember:
                self._remember(item.seq, item.payload)
        if first and outcome == "recovered" and not joining:
            outcome = "unrecoverable"  # nothing buffered: the engine lost or never had them
        self._metrics.replays.labels(self._label, outcome).inc()

    def _is_replayed_copy(self, seq: int, payload: bytes) -> bool:
        replayed = self._replayed
        return bool(replayed) and replayed.get(seq) == xxhash.xxh3_64_intdigest(payload)

    def _remember(self, seq: int, payload: bytes) -> None:
        replayed = self._replayed
        replayed[seq] = xxhash.xxh3_64_intdigest(payload)
        if len(replayed) > _REPLAYED_DIGESTS_MAX:
            del replayed[next(iter(replayed))]  # the oldest: seqs arrive in order

    # -- applying -------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        """Decode, convert and apply one batch; a batch that cannot be used resets the view
        (which then reflects `seq`)."""
        try:
            decoded = self._decoder.decode(payload)
        except MalformedPayload as exc:
            self._malformed("payload", exc)
            self._reset("malformed", seq)
            return
        self._note_unknown_fields()
        stats = self._stats
        filtered, invalid, blocks = stats.filtered, stats.invalid, stats.stored_blocks
        placeholders = dict(stats.placeholders)
        try:
            batch = convert_batch(decoded, seq, dp_rank=self.endpoints.dp_rank, stats=stats)
        except Exception as exc:  # a converter bug must not stop the stream: reset instead
            self._malformed("convert", exc)
            self._reset("malformed", seq)
            return
        m, label = self._metrics, self._label
        if stats.filtered != filtered:
            m.events.labels(label, "filtered").inc(stats.filtered - filtered)
        if stats.invalid != invalid:
            self._log.warning(
                "invalid", "rank %s: events with invalid values in seq %s", label, seq
            )
        m.stored_blocks.labels(label).inc(stats.stored_blocks - blocks)
        for tier, count in stats.placeholders.items():
            if count != placeholders.get(tier, 0):
                name = TIER_NAMES[tier]
                m.tier_events.labels(label, name, "placeholder").inc(
                    count - placeholders.get(tier, 0)
                )
        m.lag.labels(label).observe(max(0.0, time.time() - decoded.ts))
        self.stream.apply(batch)
        self._last = seq

    def _note_unknown_fields(self) -> None:
        """Count (and log, rate-limited) a batch the decoder found fields in that it does not
        know."""
        seen = self._decoder.unknown_field_batches
        if seen == self._unknown_seen:
            return
        self._unknown_seen = seen
        self._metrics.unknown_fields.labels(self._label).inc()
        self._log.warning(
            "unknown-fields",
            "rank %s: ignoring unknown fields %s",
            self._label,
            sorted(self._decoder.unknown_field_names),
        )

    def forget(self, reason: str) -> None:
        """Drop the rank's view and rejoin from the next message (after a failed run: what
        the stream holds can no longer be trusted)."""
        self._reset(reason, None)
        self._live_high = None
        self._replayed.clear()
        self._reconnected = False

    def _reset(self, reason: str, sequence: int | None) -> None:
        """Reset the rank's view to `sequence` (None: unknown, the next message rejoins)."""
        self.stream.reset(reason, sequence)
        self._last = sequence
        if sequence is None:
            self._joined = False

    def _malformed(self, problem: str, exc: Exception) -> None:
        self._metrics.malformed.labels(self._label, problem).inc()
        self._log.warning(
            f"malformed-{problem}", "rank %s: malformed message (%s): %s", self._label, problem, exc
        )
