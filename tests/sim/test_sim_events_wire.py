"""KV events on real ZMQ sockets: live PUB messages and replay, in each wire version."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from sim_wire import Subscriber, replay

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.publisher import PublisherConfig
from kvroute.sim.server import SimEngineThread

PROMPT = "events reach the bridge over ZMQ with sequence numbers " * 8


@pytest.mark.parametrize("wire", ["0.23", "0.26", "0.33"])
def test_live_events_and_replay_per_wire_version(wire: str) -> None:
    config = EngineConfig(
        speed=200, num_blocks=512, max_model_len=1024, profile="swa", sliding_window=64
    )
    with SimEngineThread(config, PublisherConfig(topic="kv@sim", wire_version=wire)) as sim:
        assert sim.events and sim.replay
        with Subscriber(sim.events, b"kv@") as sub:
            with httpx.Client(base_url=sim.url, timeout=20) as c:
                for i in range(3):
                    body = {"prompt": f"{i} {PROMPT}", "max_tokens": 20, "ignore_eos": True}
                    assert c.post("/v1/completions", json=body).status_code == 200
            msgs = sub.messages()
            assert [m.seq for m in msgs] == list(range(len(msgs))) and len(msgs) >= 3
            assert all(m.topic == b"kv@sim" for m in msgs)
            raw = msgspec.msgpack.decode(msgs[0].payload)
            assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, rank]
            first_event = raw[1][0]
            if wire == "0.23":
                assert isinstance(first_event, list) and first_event[0] == "BlockStored"
                assert len(first_event) == 12  # tag + 11 fields of 0.22/0.23
            else:
                assert isinstance(first_event, dict) and first_event["type"] == "BlockStored"
                assert ("locality" in first_event) is False  # None optionals are omitted
            stores = [e for m in msgs for e in sub.decode(m).events]
            kinds = {(e.group_idx, e.kv_cache_spec_kind) for e in stores if e.block_hashes}
            assert kinds == {(0, "full_attention"), (1, "sliding_window")}
            replayed = replay(sim.replay, 1)
            assert replayed is not None
            assert [s for s, _, _ in replayed] == [m.seq for m in msgs[1:]]
            assert [p for _, p, _ in replayed] == [m.payload for m in msgs[1:]]
            expect_topic = None if wire == "0.23" else b"kv@sim"
            assert all(t == expect_topic for _, _, t in replayed)


def test_events_match_the_engine_cache_and_reported_hits() -> None:
    config = EngineConfig(speed=200, num_blocks=256, max_model_len=1024)
    with SimEngineThread(config) as sim:
        assert sim.events
        with Subscriber(sim.events) as sub:
            with httpx.Client(base_url=sim.url, timeout=20) as c:
                r1 = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
                r2 = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()
            n = r1["usage"]["prompt_tokens"]
            hit = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert hit == (n - 1) // 16 * 16
            events = [e for m in sub.messages() for e in sub.decode(m).events]
            stored = [h for e in events for h in e.block_hashes]
            assert len(stored) == n // 16  # the first request's full blocks, once
            assert len(set(stored)) == len(stored)
            cached = sim.engine.cache.coord.pool.cached_keys()
            assert len(cached) == len(stored)
