"""Record vLLM's own KV events and prefix hits for the conformance tests.

Run with the vLLM environment's python (.venv-vllm/bin/python), never imported by pytest:

    .venv-vllm/bin/python tests/conformance/vllm_driver.py --out FILE [--only NAME ...]

For each scenario (a cache layout plus a request workload) it builds a real vLLM
`KVCacheManager` through `sim.vllm_backend.VllmCacheBackend`, drives seeded requests like the
scheduler does, publishes every step's batch through vLLM's real `ZmqEventPublisher`, captures
the raw 3-frame messages with a real SUB socket (and one replay through a DEALER), and at many
points asks vLLM for the native hit of probe prompts. The result is one msgpack file:

    {"vllm_version", "scenarios": [{"name", "about", "config", "transport", "topic",
      "dp_rank", "int_hashes", "alignment", "partial_hash_hits", "limit",
      "frames": [[topic, seq, payload], ...], "replay": {"start_seq", "frames"},
      "probes": [{"after", "tokens", "lora_name", "cache_salt", "hit", "per_group",
                  "label", "expect"}], "stats"}]}

`after` is the number of published batches (seq 0 .. after-1) that the probe's answer reflects.
A probe's `expect`, when set, is the value reference/vllm-kv-events.md §7.6 states for it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import vllm  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher  # noqa: E402

from sim.vllm_backend import (  # noqa: E402
    BackendConfig,
    GroupConfig,
    Namespace,
    SchedulerLoop,
    VllmCacheBackend,
    describe,
)

FA, SW, MB, CB = "full_attention", "sliding_window", "mamba", "circular_buffer"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---- capture: vLLM's publisher on one side, a real SUB and DEALER on the other ---------------


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WireCapture:
    """vLLM's ZmqEventPublisher plus a SUB socket recording every message it sends.

    transport "tcp": the SUB binds 127.0.0.1 on an ephemeral port and vLLM connects to it
    (vLLM's connect mode); the replay ROUTER binds a free loopback port.
    transport "inproc": vLLM binds inproc endpoints (offset by DP rank) and the SUB connects.
    """

    def __init__(self, name: str, transport: str, topic: str, dp_rank: int) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.topic = topic
        if transport == "tcp":
            port = self.sub.bind_to_random_port("tcp://127.0.0.1")
            endpoint = f"tcp://127.0.0.1:{port}"
            replay = f"tcp://127.0.0.1:{_free_tcp_port()}"
            if dp_rank:
                raise ValueError("tcp connect mode offsets the port by rank; use inproc")
        elif transport == "inproc":
            endpoint, replay = f"inproc://kv-{name}", f"inproc://kv-{name}-replay"
        else:
            raise ValueError(transport)
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=dp_rank, endpoint=endpoint, replay_endpoint=replay, topic=topic
        )
        resolved = self.publisher.get_publisher_config()
        if transport == "inproc":
            self.sub.connect(resolved.endpoint)
        self.replay_endpoint = resolved.replay_endpoint
        # Let the subscription reach the publisher before the first batch. A SUB attaches a
        # new connection (and sends its subscription on it) only while it processes its own
        # commands, i.e. while it is polled; a bound SUB that is merely waited on never
        # subscribes, and vLLM's PUB then drops everything it sends.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            self.sub.poll(10)
        self.frames: list[list[bytes]] = []
        self.published = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.publisher.publish(batch)
        self.published += 1
        self.drain(0)

    def drain(self, timeout_ms: int) -> None:
        while self.sub.poll(timeout_ms):
            self.frames.append(self.sub.recv_multipart())
            timeout_ms = 0

    def wait_all(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.frames) < self.published and time.monotonic() < deadline:
            self.drain(50)
        seqs = [int.from_bytes(f[1], "big") for f in self.frames]
        if seqs != list(range(self.published)):
            raise RuntimeError(
                f"captured seqs {seqs[:5]}... ({len(seqs)}) != 0..{self.published - 1}"
            )

    def replay(self, start_seq: int, timeout: float = 10.0) -> list[list[bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            replies: list[list[bytes]] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not dealer.poll(100):
                    continue
                message = dealer.recv_multipart()
                replies.append(message)
                if len(message) >= 2 and message[-2] == END_SEQ:
                    return replies
            raise RuntimeError("replay did not finish")
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.publisher.shutdown()
        self.sub.close(linger=0)


class ServedPublisher:
    """vLLM's ZmqEventPublisher bound on ipc endpoints for a bridge in another process.

    Protocol on stdin/stdout (one line each): after `pause_at` batches it prints
    `PAUSED <name> <count> <endpoint> <replay endpoint>` and waits for `GO`; at the end of
    the scenario it prints `DONE <name> <count>` and waits for `NEXT` before shutting down.
    """

    def __init__(self, name: str, directory: Path, topic: str, pause_at: int) -> None:
        self.name = name
        self.endpoint = f"ipc://{directory}/{name}.pub"
        self.replay_endpoint = f"ipc://{directory}/{name}.replay"
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            topic=topic,
        )
        self.pause_at = pause_at
        self.published = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.publisher.publish(batch)
        self.published += 1
        if self.published == self.pause_at:
            self._handshake(
                f"PAUSED {self.name} {self.published} {self.endpoint} {self.replay_endpoint}",
                "GO",
            )

    def finish(self) -> None:
        self._handshake(f"DONE {self.name} {self.published}", "NEXT")
        self.publisher.shutdown()

    @staticmethod
    def _handshake(announce: str, expect: str) -> None:
        print(announce, flush=True)
        answer = sys.stdin.readline().strip()
        if answer != expect:
            raise SystemExit(f"expected {expect!r} on stdin, got {answer!r}")


# ---- scenarios --------------------------------------------------------------------------------


@dataclass
class Workload:
    """Seeded random traffic: shared prefixes, multi-turn growth, namespaces, resets."""

    requests: int = 40
    concurrency: int = 3
    prefixes: int = 4
    prefix_len: tuple[int, int] = (8, 160)
    user_len: tuple[int, int] = (1, 120)
    output_len: tuple[int, int] = (1, 40)
    max_history: int = 480
    namespaces: tuple[Namespace, ...] = (Namespace(),)
    reset_probability: float = 0.0
    probe_every: int = 6
    probes_per_point: int = 10


@dataclass
class Scenario:
    name: str
    about: str
    config: BackendConfig
    workload: Workload | None = None
    script: Callable[[Recorder], None] | None = None
    transport: str = "tcp"
    topic: str = ""
    dp_rank: int = 0
    int_hashes: bool = True
    seed: int = 0
    # For known-limit scenarios: which limit they demonstrate (see the README section).
    limit: str = ""


@dataclass
class Recorder:
    """Runs one scenario: backend + publisher (with capture) + probes."""

    scenario: Scenario
    loop: SchedulerLoop
    capture: WireCapture | ServedPublisher
    rng: random.Random
    probes: list[dict[str, Any]] = field(default_factory=list)

    def probe(
        self,
        tokens: list[int],
        namespace: Namespace | None = None,
        label: str = "",
        expect: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> int:
        ns = namespace or Namespace()
        answer = self.loop.backend.native_hit(tokens, ns, prompt_logprobs=prompt_logprobs)
        self.probes.append(
            {
                "after": self.capture.published,
                "tokens": list(tokens),
                "lora_name": ns.lora_name,
                "cache_salt": ns.cache_salt,
                "hit": answer.hit,
                "per_group": list(answer.per_group),
                "label": label,
                "expect": expect,
                "prompt_logprobs": prompt_logprobs is not None,
            }
        )
        return answer.hit

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 32000) for _ in range(n)]

    def run(
        self,
        tokens: list[int],
        outputs: int = 1,
        namespace: Namespace | None = None,
        report_mode: str | None = None,
    ) -> list[int]:
        """Run one request to completion; returns prompt + generated tokens."""
        out = self.tokens(outputs)
        self.loop.run_request(tokens, out, namespace, report_mode=report_mode)
        return list(tokens) + out


class FleetLoop:
    """Several workers behind one submit/step interface: each request goes to `replicas`
    workers chosen at random (like a router spreading load), and all workers step together."""

    def __init__(self, loops: dict[str, SchedulerLoop], rng: random.Random, replicas: int):
        self.loops = loops
        self.rng = rng
        self.replicas = replicas

    @property
    def idle(self) -> bool:
        return all(loop.idle for loop in self.loops.values())

    def submit(
        self,
        tokens: list[int],
        outputs: list[int],
        namespace: Namespace | None = None,
        *,
        on_finish: Callable[[Any], None] | None = None,
    ) -> None:
        fired: list[bool] = []

        def once(request: Any) -> None:
            if not fired and on_finish is not None:
                fired.append(True)
                on_finish(request)

        for worker in self.rng.sample(sorted(self.loops), self.replicas):
            self.loops[worker].submit(tokens, outputs, namespace, on_finish=once)

    def step(self) -> bool:
        progressed = False
        for name, loop in self.loops.items():
            if not loop.idle:
                if not loop.step():
                    raise RuntimeError(f"worker {name} cannot make progress")
                progressed = True
        return progressed

    def reset_prefix_cache(self) -> None:
        for loop in self.loops.values():
            loop.reset_prefix_cache()


@dataclass
class FleetRecorder:
    """Runs one fleet: a backend and a captured publisher per worker, probes to all of them."""

    name: str
    loop: FleetLoop
    captures: dict[str, WireCapture]
    rng: random.Random
    probes: list[dict[str, Any]] = field(default_factory=list)

    def probe(self, tokens: list[int], namespace: Namespace | None = None, label: str = "") -> None:
        ns = namespace or Namespace()
        answers = {w: loop.backend.native_hit(tokens, ns) for w, loop in self.loop.loops.items()}
        self.probes.append(
            {
                "after": {w: c.published for w, c in self.captures.items()},
                "tokens": list(tokens),
                "lora_name": ns.lora_name,
                "cache_salt": ns.cache_salt,
                "hits": {w: a.hit for w, a in answers.items()},
                "per_group": {w: list(a.per_group) for w, a in answers.items()},
                "label": label,
            }
        )

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 32000) for _ in range(n)]


def run_workload(rec: Recorder | FleetRecorder, w: Workload) -> None:
    rng, loop = rec.rng, rec.loop
    prefixes = [rec.tokens(rng.randint(*w.prefix_len)) for _ in range(w.prefixes)]
    finished: list[tuple[Namespace, list[int], list[int]]] = []  # (ns, prompt, full history)
    in_flight: list[tuple[Namespace, list[int]]] = []
    submitted = 0
    steps = 0

    def new_prompt() -> tuple[Namespace, list[int]]:
        roll = rng.random()
        if finished and roll < 0.45:
            ns, _, history = rng.choice(finished)
            if len(history) < w.max_history:
                return ns, history + rec.tokens(rng.randint(*w.user_len) // 2 + 1)
        if finished and roll < 0.55:
            ns, prompt, _ = rng.choice(finished)
            return ns, list(prompt)  # an exact resend
        ns = rng.choice(w.namespaces)
        head = rng.choice(prefixes) if rng.random() < 0.7 else []
        return ns, head + rec.tokens(rng.randint(*w.user_len))

    def probe_point() -> None:
        candidates: list[tuple[str, Namespace, list[int]]] = []
        for ns, prompt, history in rng.sample(finished, min(len(finished), 3)):
            cut = rng.randint(1, len(history))
            candidates += [
                ("history", ns, history),
                ("next-turn", ns, history + rec.tokens(rng.randint(1, 40))),
                ("resend", ns, prompt),
                ("truncated", ns, history[:cut]),
                ("other-namespace", rng.choice(w.namespaces), history),
            ]
            unit = rng.choice([16, 32, 64])
            edge = max(1, (len(history) // unit) * unit + rng.choice([-1, 0, 1]))
            candidates.append(("boundary", ns, history[:edge]))
        for ns, prompt in in_flight[:2]:
            candidates.append(("in-flight", ns, prompt))
        head = rng.choice(prefixes)
        candidates += [
            ("prefix+new", rng.choice(w.namespaces), head + rec.tokens(rng.randint(1, 80))),
            ("unrelated", Namespace(), rec.tokens(rng.randint(1, 200))),
        ]
        rng.shuffle(candidates)
        for label, ns, tokens in candidates[: w.probes_per_point]:
            if tokens:
                rec.probe(tokens, ns, label)

    draining = False  # stop admitting until idle, then reset the prefix cache
    while submitted < w.requests or not loop.idle:
        active = len(in_flight)
        if draining and loop.idle:
            draining = False
            loop.reset_prefix_cache()
            probe_point()
        while (
            not draining
            and submitted < w.requests
            and active < w.concurrency
            and rng.random() < 0.6
        ):
            ns, prompt = new_prompt()
            outputs = rec.tokens(rng.randint(*w.output_len))
            entry = (ns, prompt)
            in_flight.append(entry)

            def done(
                request: Any,
                ns: Namespace = ns,
                prompt: list[int] = prompt,
                entry: tuple[Namespace, list[int]] = entry,
            ) -> None:
                in_flight.remove(entry)
                history = list(request.prompt_token_ids) + list(request.output_token_ids)
                finished.append((ns, prompt, history))

            loop.submit(prompt, outputs, ns, on_finish=done)
            submitted += 1
            active += 1
        if loop.idle:
            continue
        if not loop.step():
            raise RuntimeError("the workload does not fit the pool")
        steps += 1
        if steps % w.probe_every == 0:
            probe_point()
        if not draining and rng.random() < w.reset_probability / w.probe_every:
            draining = True
    probe_point()


# ---- scripted scenarios: reference §7.6 examples and known limits ----------------------------


def example_a(rec: Recorder) -> None:
    prompt = rec.tokens(96)
    rec.run(prompt)
    rec.probe(prompt, label="A: 96-token resend", expect=80)


def example_b(rec: Recorder) -> None:
    a = rec.tokens(100)
    b = a[:64] + rec.tokens(36)
    rec.probe(a, label="B: nothing cached yet", expect=0)
    rec.run(a)
    rec.probe(b, label="B: arrival of B", expect=0)
    rec.run(b)
    rec.probe(a, label="B: A again", expect=96)
    rec.probe(a + rec.tokens(3), label="B: A + 3 tokens", expect=96)
    rec.probe(a[:64] + rec.tokens(36), label="B: shares 64 with A", expect=64)
    rec.probe(a[:40] + rec.tokens(60), label="B: shares 40 with A", expect=0)
    rec.probe(rec.tokens(100), label="B: unrelated", expect=0)
    rec.run(rec.tokens(200))
    rec.probe(a, label="B: A after C evicted (B's duplicate blocks 0-3 survive)", expect=64)
    rec.probe(b, label="B: B after C")


def example_c(rec: Recorder) -> None:
    a = rec.tokens(100)
    rec.run(a)
    rec.probe(a, label="C: A again (Mamba partial entry at 96)", expect=96)
    rec.probe(a[:80] + rec.tokens(20), label="C: shares 80 with A")


def example_d(rec: Recorder) -> None:
    a = rec.tokens(100)
    history = rec.run(a, outputs=40)
    dense = rec.scenario.config.retention_interval is None
    rec.probe(history, label="D: 140-token continuation", expect=128 if dense else 96)
    rec.probe(history + rec.tokens(20), label="D: next turn")


def limit_nonprefix_lcm(rec: Recorder) -> None:
    """A group that is not prefix-cacheable still enters the LCM: vLLM aligns hits to 64."""
    a = rec.tokens(100)
    rec.run(a)
    rec.probe(a, label="limit: events show block 16 only, vLLM aligns to 64", expect=64)
    rec.probe(a[:90], label="limit: 90-token prefix", expect=64)
    rec.probe(a[:60] + rec.tokens(10), label="limit: shares 60", expect=0)
    longer = rec.run(a + rec.tokens(100), outputs=1)
    rec.probe(longer[:150], label="limit: 150 of a cached 192", expect=128)
    rec.probe(longer[:180] + rec.tokens(9), label="limit: shares 180", expect=128)


def limit_lora_path(rec: Recorder) -> None:
    """vLLM hashes a LoRA adapter's path, which events never carry: re-pointing a name."""
    a = rec.tokens(100)
    rec.run(a, namespace=Namespace(lora_name="sql", lora_path="/adapters/sql-v1"))
    rec.probe(a, Namespace(lora_name="sql", lora_path="/adapters/sql-v1"), label="same path")
    rec.probe(
        a,
        Namespace(lora_name="sql", lora_path="/adapters/sql-v2"),
        label="limit: same adapter name, new path",
        expect=0,
    )


def limit_prompt_logprobs(rec: Recorder) -> None:
    """A request asking for prompt logprobs skips reading the prefix cache altogether."""
    a = rec.tokens(100)
    rec.run(a)
    rec.probe(a, label="plain request", expect=96)
    rec.probe(a, label="limit: prompt_logprobs request", expect=0, prompt_logprobs=1)


def limit_report_mode_full(rec: Recorder) -> None:
    """kv_cache_report_mode=full re-reports a hit, listing blocks sparse groups never held."""
    a = rec.tokens(100)
    rec.run(a)
    rec.probe(a[:64] + rec.tokens(40), label="limit: before the full report")
    rec.run(a + rec.tokens(20), report_mode="full")
    rec.probe(a[:64] + rec.tokens(40), label="limit: after the full report (over-reported)")
    rec.probe(a[:48] + rec.tokens(40), label="limit: 48 after the full report")


# ---- the scenario list ------------------------------------------------------------------------


def G(kind: str, block: int, window: int | None = None) -> GroupConfig:
    return GroupConfig(kind, block, window)


NS_MIX = (
    Namespace(),
    Namespace(),
    Namespace(cache_salt="tenant-a"),
    Namespace(lora_name="sql-lora"),
    Namespace(lora_name="sql-lora", cache_salt="tenant-b"),
)
HYBRID = (G(FA, 16), G(SW, 16, 32), G(MB, 16))


def scenarios() -> list[Scenario]:
    s: list[Scenario] = [
        Scenario(
            "example_A",
            "§7.6 A: full attention only, block 16",
            BackendConfig((G(FA, 16),), num_blocks=32),
            script=example_a,
        ),
        Scenario(
            "example_B",
            "§7.6 B: FA16 + SWA32 + Mamba16, default retention",
            BackendConfig(HYBRID, num_blocks=40),
            script=example_b,
            topic="kv@b",
        ),
        Scenario(
            "example_C",
            "§7.6 C: Mamba block 64 (partial hits, alignment 16)",
            BackendConfig((G(FA, 16), G(SW, 16, 32), G(MB, 64)), num_blocks=64),
            script=example_c,
            transport="inproc",
        ),
        Scenario(
            "example_D_r0",
            "§7.6 D: decode, default retention",
            BackendConfig(HYBRID, num_blocks=64),
            script=example_d,
        ),
        Scenario(
            "example_D_dense",
            "§7.6 D: decode, dense retention",
            BackendConfig(HYBRID, num_blocks=64, retention_interval=None),
            script=example_d,
        ),
        # Random workloads.
        Scenario(
            "dense_fa16",
            "single full-attention group, namespaces, resets",
            BackendConfig((G(FA, 16),), num_blocks=48),
            Workload(requests=45, namespaces=NS_MIX, reset_probability=0.15),
            seed=1,
        ),
        Scenario(
            "hybrid16_r0",
            "FA16 + SWA32 + Mamba16, default retention, small pool",
            BackendConfig(HYBRID, num_blocks=72),
            Workload(requests=45),
            seed=2,
            topic="kv@w1",
        ),
        Scenario(
            "hybrid16_dense",
            "FA16 + SWA32 + Mamba16, dense retention",
            BackendConfig(HYBRID, num_blocks=80, retention_interval=None),
            Workload(requests=40, namespaces=NS_MIX),
            seed=3,
        ),
        Scenario(
            "hybrid16_r64_w48",
            "FA16 + SWA48 + Mamba16, retention 64",
            BackendConfig(
                (G(FA, 16), G(SW, 16, 48), G(MB, 16)), num_blocks=80, retention_interval=64
            ),
            Workload(requests=40, reset_probability=0.1),
            seed=4,
            transport="inproc",
        ),
        Scenario(
            "mamba64_partial_r0",
            "FA16 + SWA32 + Mamba64: partial hits, alignment 16",
            BackendConfig((G(FA, 16), G(SW, 16, 32), G(MB, 64)), num_blocks=96),
            Workload(requests=40, namespaces=NS_MIX),
            seed=5,
        ),
        Scenario(
            "mamba64_partial_dense",
            "FA16 + Mamba64 dense retention (simple hybrid)",
            BackendConfig((G(FA, 16), G(MB, 64)), num_blocks=64, retention_interval=None),
            Workload(requests=35),
            seed=6,
        ),
        Scenario(
            "mixed32_mamba64",
            "FA32 + SWA128/32 + Mamba64: hash 32, alignment 32",
            BackendConfig(
                (G(FA, 32), G(SW, 32, 128), G(MB, 64)), num_blocks=72, max_num_scheduled_tokens=192
            ),
            Workload(requests=35, user_len=(1, 200)),
            seed=7,
        ),
        Scenario(
            "two_windows_r0",
            "FA16 + SWA64 + SWA128, default retention",
            BackendConfig((G(FA, 16), G(SW, 16, 64), G(SW, 16, 128)), num_blocks=96),
            Workload(requests=40),
            seed=8,
        ),
        Scenario(
            "swa32blk_mixed",
            "FA16 + SWA block 32 window 96: alignment 32, no partials",
            BackendConfig((G(FA, 16), G(SW, 32, 96)), num_blocks=72),
            Workload(requests=40, reset_probability=0.1),
            seed=9,
        ),
        Scenario(
            "equal64",
            "FA64 + SWA64/window 256 + Mamba64: hash unit 64",
            BackendConfig(
                (G(FA, 64), G(SW, 64, 256), G(MB, 64)), num_blocks=48, max_num_scheduled_tokens=256
            ),
            Workload(requests=30, user_len=(1, 300), max_history=900),
            seed=10,
        ),
        Scenario(
            "bytes_cbor_dp1_r32",
            "bytes hashes, sha256_cbor, DP rank 1, retention 32",
            BackendConfig(HYBRID, num_blocks=80, retention_interval=32, hash_algo="sha256_cbor"),
            Workload(requests=35, namespaces=NS_MIX),
            seed=11,
            transport="inproc",
            topic="kv@dp",
            dp_rank=1,
            int_hashes=False,
        ),
        Scenario(
            "preempt_hybrid16",
            "FA16 + SWA32 + Mamba16, many concurrent requests in a small pool: preemption",
            BackendConfig(HYBRID, num_blocks=56),
            Workload(
                requests=45,
                concurrency=6,
                prefixes=2,
                prefix_len=(64, 200),
                user_len=(1, 40),
                output_len=(8, 60),
                probe_every=10,
            ),
            seed=13,
        ),
        Scenario(
            "long_hybrid_w512",
            "FA16 + SWA512 + Mamba16, long prompts and chunked prefill",
            BackendConfig(
                (G(FA, 16), G(SW, 16, 512), G(MB, 16)),
                num_blocks=400,
                max_num_scheduled_tokens=512,
            ),
            Workload(
                requests=25,
                prefix_len=(200, 900),
                user_len=(1, 600),
                max_history=2500,
                namespaces=NS_MIX,
            ),
            seed=14,
        ),
        Scenario(
            "swa_only_dense",
            "a single sliding-window group (window 64), dense retention",
            BackendConfig((G(SW, 16, 64),), num_blocks=64, retention_interval=None),
            Workload(requests=40),
            seed=15,
        ),
        # Known limits of event-based prediction.
        Scenario(
            "limit_nonprefix_lcm",
            "FA16 + a non-prefix-cacheable 64-token group",
            BackendConfig((G(FA, 16), G(CB, 64)), num_blocks=32),
            script=limit_nonprefix_lcm,
            limit="nonprefix_lcm",
        ),
        Scenario(
            "limit_pmu16_fa64",
            "FA64 + Mamba64 with prefix_match_unit=16: sub-block entries whose parent is a "
            "hash-unit boundary no group publishes",
            BackendConfig(
                (G(FA, 64), G(MB, 64)),
                num_blocks=48,
                prefix_match_unit=16,
                max_num_scheduled_tokens=256,
            ),
            Workload(requests=30, user_len=(1, 200)),
            seed=12,
            limit="unplaceable_partial_entries",
        ),
        Scenario(
            "limit_swa_only_r0",
            "a single sliding-window group under default retention: only sparse stores",
            BackendConfig((G(SW, 16, 64),), num_blocks=64),
            Workload(requests=30),
            seed=16,
            limit="no_dense_group",
        ),
        Scenario(
            "limit_mamba_only",
            "a single Mamba group: only sparse stores",
            BackendConfig((G(MB, 16),), num_blocks=64),
            Workload(requests=30),
            seed=17,
            limit="no_dense_group",
        ),
        Scenario(
            "limit_lora_path",
            "a LoRA adapter name re-pointed at a new path",
            BackendConfig((G(FA, 16),), num_blocks=32),
            script=limit_lora_path,
            limit="lora_path",
        ),
        Scenario(
            "limit_prompt_logprobs",
            "requests with prompt logprobs do not read the prefix cache",
            BackendConfig(HYBRID, num_blocks=32),
            script=limit_prompt_logprobs,
            limit="prompt_logprobs",
        ),
        Scenario(
            "limit_report_mode_full",
            "kv_cache_report_mode=full on a hybrid",
            BackendConfig(HYBRID, num_blocks=64),
            script=limit_report_mode_full,
            limit="report_mode_full",
        ),
    ]
    return s


# ---- running ----------------------------------------------------------------------------------


@dataclass
class Fleet:
    name: str
    about: str
    workers: dict[str, BackendConfig]
    workload: Workload
    replicas: int = 2
    seed: int = 0


def fleets() -> list[Fleet]:
    return [
        Fleet(
            "fleet_rolling_upgrade",
            "five workers with different layouts (a rolling upgrade, several models), each "
            "request sent to two of them",
            {
                "dense": BackendConfig((G(FA, 16),), num_blocks=64),
                "hybrid": BackendConfig(HYBRID, num_blocks=72),
                "hybrid-dense": BackendConfig(HYBRID, num_blocks=72, retention_interval=None),
                "mamba64": BackendConfig((G(FA, 16), G(SW, 16, 32), G(MB, 64)), num_blocks=96),
                "mixed32": BackendConfig(
                    (G(FA, 32), G(SW, 32, 128), G(MB, 64)),
                    num_blocks=72,
                    max_num_scheduled_tokens=192,
                ),
            },
            Workload(requests=50, concurrency=4, namespaces=NS_MIX, reset_probability=0.05),
            replicas=2,
            seed=21,
        ),
        Fleet(
            "fleet_same_model",
            "four replicas of one hybrid model, each request sent to one of them",
            {f"replica-{i}": BackendConfig(HYBRID, num_blocks=64) for i in range(4)},
            Workload(requests=50, concurrency=4, prefixes=3),
            replicas=1,
            seed=22,
        ),
    ]


def run_fleet(fleet: Fleet) -> dict[str, Any]:
    started = time.monotonic()
    captures = {w: WireCapture(f"{fleet.name}-{w}", "inproc", f"kv@{w}", 0) for w in fleet.workers}
    try:
        tick = iter(range(1 << 40))
        loops = {
            w: SchedulerLoop(
                VllmCacheBackend(config),
                clock=lambda: 1_700_000_000.0 + next(tick) / 1000,
                publish=captures[w].publish,
            )
            for w, config in fleet.workers.items()
        }
        rng = random.Random(fleet.seed)
        rec = FleetRecorder(fleet.name, FleetLoop(loops, rng, fleet.replicas), captures, rng)
        run_workload(rec, fleet.workload)
        for capture in captures.values():
            capture.wait_all()
    finally:
        for capture in captures.values():
            capture.close()
    return {
        "name": fleet.name,
        "about": fleet.about,
        "workers": {
            w: {
                "config": describe(loops[w].backend.spec),
                "alignment": loops[w].backend.alignment,
                "topic": captures[w].topic,
                "frames": captures[w].frames,
                "stats": {"batches": loops[w].stats.batches, "events": loops[w].stats.events},
            }
            for w in fleet.workers
        },
        "probes": rec.probes,
        "seconds": round(time.monotonic() - started, 3),
    }


@contextlib.contextmanager
def _int_hash_mode(enabled: bool) -> Iterator[None]:
    key = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
    old = os.environ.get(key)
    os.environ[key] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old


def _drive(sc: Scenario, sink: WireCapture | ServedPublisher) -> tuple[Recorder, Any]:
    """Run the scenario's script or workload, publishing every batch to `sink`.

    Deterministic: the same scenario publishes the same payloads (seeded tokens, fixed hash
    seed, a counting clock), which lets a served run be compared with the recording.
    """
    tick = iter(range(1 << 40))
    with _int_hash_mode(sc.int_hashes):
        backend = VllmCacheBackend(sc.config)
        loop = SchedulerLoop(
            backend,
            clock=lambda: 1_700_000_000.0 + next(tick) / 1000,
            publish=sink.publish,
        )
        rec = Recorder(sc, loop, sink, random.Random(sc.seed))
        if sc.script is not None:
            sc.script(rec)
        if sc.workload is not None:
            run_workload(rec, sc.workload)
    return rec, backend


def serve(names: list[str], directory: Path, pause_at: int) -> None:
    """Publish the named scenarios, in the order given, for a bridge to follow."""
    known = {sc.name: sc for sc in scenarios()}
    for sc in (known[name] for name in names):
        if sc.dp_rank:
            raise SystemExit("served scenarios use DP rank 0 (ipc endpoints cannot offset)")
        sink = ServedPublisher(sc.name, directory, sc.topic, pause_at)
        _drive(sc, sink)
        sink.finish()


def run_scenario(sc: Scenario) -> dict[str, Any]:
    started = time.monotonic()
    capture = WireCapture(sc.name, sc.transport, sc.topic, sc.dp_rank)
    try:
        rec, backend = _drive(sc, capture)
        loop = rec.loop
        capture.wait_all()
        start_seq = max(0, capture.published - 3)
        replay = capture.replay(start_seq) if capture.published else []
    finally:
        capture.close()
    stats = loop.stats
    return {
        "name": sc.name,
        "about": sc.about,
        "config": describe(sc.config),
        "transport": sc.transport,
        "topic": sc.topic,
        "dp_rank": sc.dp_rank,
        "int_hashes": sc.int_hashes,
        "alignment": backend.alignment,
        "partial_hash_hits": backend.partial_hits,
        "limit": sc.limit,
        "frames": capture.frames,
        "replay": {"start_seq": start_seq, "frames": replay},
        "probes": rec.probes,
        "stats": {
            "steps": stats.steps,
            "batches": stats.batches,
            "finished": stats.finished,
            "preemptions": stats.preemptions,
            "deferred_admissions": stats.deferred_admissions,
            "resets": stats.resets,
            "failed_resets": stats.failed_resets,
            "events": stats.events,
            "seconds": round(time.monotonic() - started, 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where to write the recording")
    parser.add_argument("--only", nargs="*", default=None, help="scenario names")
    parser.add_argument(
        "--serve", type=Path, metavar="DIR", help="publish on ipc endpoints in DIR instead"
    )
    parser.add_argument("--pause-at", type=int, default=12, help="(serve) batches before GO")
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.only or [], args.serve, args.pause_at)
        return 0
    if args.out is None:
        parser.error("--out is required")
    chosen = [s for s in scenarios() if args.only is None or s.name in args.only]
    results = []
    for sc in chosen:
        result = run_scenario(sc)
        st = result["stats"]
        print(
            f"{sc.name}: {st['batches']} batches, {len(result['probes'])} probes, "
            f"{st['events']}, preemptions={st['preemptions']}, resets={st['resets']}, "
            f"{st['seconds']} s",
            file=sys.stderr,
        )
        results.append(result)
    fleet_results = []
    for fleet in fleets():
        if args.only is None or fleet.name in args.only:
            result = run_fleet(fleet)
            print(
                f"{fleet.name}: {len(result['probes'])} probes over {len(fleet.workers)} "
                f"workers, {result['seconds']} s",
                file=sys.stderr,
            )
            fleet_results.append(result)
    data = {"vllm_version": vllm.__version__, "scenarios": results, "fleets": fleet_results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_bytes(msgspec.msgpack.encode(data))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
