"""The fleet-scale harness: the feed sends the bridge's own frames (only an engine's token 0,
sequence, timestamp and rank differ), and a tiny run of the whole harness with real processes
measures a point that holds and stops one that cannot."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

from bench.fleet_feed import QUEUE_SIZE, Fleet, Template, engine_token
from bench.fleet_model import (
    Conversations,
    EngineShape,
    bridge_frames,
    bridge_snapshots,
    rates,
    record,
)
from kvroute.proto.events_pb2 import KvEventBatch, KvGroupEvent, SubscribeRequest, SubscribeResponse

SMALL = EngineShape(num_blocks=1024, max_model_len=4096, max_num_batched_tokens=2048)
CHATS = Conversations(active=6, first_context=(256, 1024), user_tokens=(32, 256), turns=(2, 4))


def _key(event: KvGroupEvent) -> bytes:
    """An event with token 0 of a STORE from token 0 set to 0 (what the feed patches)."""
    copy = KvGroupEvent()
    copy.CopyFrom(event)
    if copy.operation == KvGroupEvent.STORE and not copy.parent_block_hash and copy.token_ids:
        copy.token_ids[0] = 0
    return copy.SerializeToString()


def test_recorded_engine_fills_then_stores_and_removes_at_matching_rates() -> None:
    rec = record(40.0, SMALL, CHATS)
    assert rec.full_at is not None and 0 < rec.full_at < 40.0
    r = rates(rec, bridge_frames(rec))
    assert r.batches_per_s > 0 and r.stored_blocks_per_s > 0
    # a full cache evicts what it stores: in steady state the two rates agree
    assert abs(r.stored_blocks_per_s - r.removed_blocks_per_s) < 0.2 * r.stored_blocks_per_s
    assert r.bridge_bytes_per_s > 0 and r.decode_tokens_per_s > 0


def test_feed_sends_the_bridge_frames_with_each_engine_own_content(tmp_path: Path) -> None:
    rec = record(30.0, SMALL, CHATS)
    frames = bridge_frames(rec)
    assert rec.full_at is not None and frames[-800][0] > rec.full_at
    # a start late enough that the rest of the recording fits in one subscriber's queue
    snaps = asyncio.run(bridge_snapshots(frames, [frames[-800][0] - 1e-6]))
    path = tmp_path / "t.pkl"
    path.write_bytes(pickle.dumps({"frames": frames, "snapshots": snaps, "prompts": []}))

    async def go() -> list[bytes]:
        template = Template.load(path)
        fleet = Fleet(template, engines=3, rate_scale=1.0, restart_interval_s=1e12)
        engine = fleet.engines[2]
        sub = fleet.stream(2).subscribe(SubscribeRequest(dp_rank=2))  # type: ignore[union-attr]
        left = len(template.pieces) - template.starts[0].next_piece
        assert left + 2 < QUEUE_SIZE
        engine.send_due(time.time() + (frames[-1][0] - frames[0][0]) + 1.0)
        return [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]

    sent = [SubscribeResponse.FromString(m) for m in asyncio.run(go())]
    first, batches, last = sent[0], sent[1:-1], sent[-1]
    next_piece, raw_snap = snaps[0]
    bridge_snap = SubscribeResponse.FromString(raw_snap).snapshot
    assert first.snapshot.reason == "initial" and first.snapshot.dp_rank == 2
    assert sorted(_key(e) for e in first.snapshot.events) == sorted(
        _key(e) for e in bridge_snap.events
    )
    roots = [e for e in first.snapshot.events if not e.parent_block_hash and e.token_ids]
    assert roots and all(e.token_ids[0] == engine_token(2) for e in roots)
    # then every later batch, in order: the bridge's events, this engine's header
    expected = [SubscribeResponse.FromString(raw).batch for _, raw in frames[next_piece:]]
    assert len(batches) == len(expected)
    seqs = [m.batch.sequence for m in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    for got, want in zip(batches, expected, strict=True):
        assert got.batch.dp_rank == 2 and got.batch.timestamp > 0
        assert sorted(_key(e) for e in got.batch.events) == sorted(_key(e) for e in want.events)
    # the recording ran out: the engine restarts from an empty cache
    assert last.snapshot.reason == "restart" and len(last.snapshot.events) == 0
    assert last.snapshot.stream_id != first.snapshot.stream_id
    assert isinstance(batches[0].batch, KvEventBatch)


def test_harness_measures_a_small_fleet_and_stops_an_overfed_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.fleet_scale_bench", "--engines", "4@0.2", "4@2000",
         "--window-s", "2", "--settle-s", "0.5", "--template-s", "60",
         "--request-rate", "5", "--warmup-timeout-s", "60", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "fleet_scale.json").read_text())
    assert result["model"]["rates"]["stored_blocks_per_s"] > 0
    held, overfed = result["points"]
    assert held["status"] == "ok", held
    ingest = held["ingest"]
    assert ingest["blocks_per_s"] > 0 and ingest["router_cpu_per_s"] > 0
    assert 0 < ingest["lag_p50_ms"] <= ingest["lag_p99_ms"]
    for size in ("8192", "32768"):
        r = held["requests"][size]
        assert r["requests"] > 0 and r["errors"] == 0
        assert r["decision_p50_ms"] > 0 and r["direct_p50_ms"] > 0 and r["routed_p50_ms"] > 0
    assert held["index_entries"] > 0 and held["rss_mib"] > 0
    assert held["feed"]["subscribed"] == 4 and held["feed"]["overflows"] == 0
    # 4 engines at 2,000x the busy rate: more than one router process (or the feed) can keep up with
    assert overfed["status"] == "no" and overfed["reason"], overfed
    assert overfed["requests"] == {}
    assert "| 4 | 0.2 | ok |" in (tmp_path / "fleet_scale.md").read_text()
