"""`kvroute sim --cache-backend vllm` against `kvroute sim` (SimCache), end to end over HTTP.

Two engine processes with the same settings run side by side on loopback: one on kvroute's
own cache (main environment), one on vLLM's real KVCacheManager (the vLLM environment's
python, KVROUTE_VLLM_PYTHON). The same request sequence goes to both over HTTP, one request
at a time (so both schedule identical steps): shared prefixes, exact repeats, a LoRA adapter,
a cache salt, a prefix-cache reset, a pool small enough to evict. Then:
- every request's `usage.prompt_tokens_details.cached_tokens` is the same on both;
- /sim/probe gives the same hit and per-group hits for every prompt afterwards;
- the event streams, fetched whole from each engine's replay socket and decoded with
  kvroute.bridge.vllm_schema, are the same batch for batch (sequence numbers, event types, groups,
  kinds, windows, token spans, parents, LoRA and extra keys, removals, clears).

Hashes: the vLLM backend keeps vLLM's own hash function (sha256 over pickle), the one a real
engine publishes, and SimCache has its own, so hash values differ by design (kvroute never
recomputes an engine's hashes). Each stream's hashes are therefore replaced by the prefix
they stand for (namespace + token prefix), learned from the stream's own dense stores; a
hash that no dense store positions fails the test instead of being skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from sim_wire import replay
from vllm_env import vllm_python

from kvroute.bridge.vllm_schema import BatchDecoder, DecodedCleared, DecodedRemoved, DecodedStored

ROOT = Path(__file__).resolve().parents[2]
KINDS = (DecodedStored, DecodedRemoved, DecodedCleared)
LORA = "ad1"
ENGINE_ARGS = [
    "--max-model-len", "512", "--max-num-batched-tokens", "256", "--max-num-seqs", "8",
    "--speed", "1000", "--lora", LORA, "--host", "127.0.0.1",
]  # fmt: skip
# Per profile: the pool is a little above one max-length request, so later prompts evict.
PROFILES = {
    "swa": ["--model-profile", "swa", "--sliding-window", "64", "--num-blocks", "80"],
    "mamba": ["--model-profile", "mamba", "--num-blocks", "60"],
}


@dataclass
class Engine:
    url: str
    replay: str
    proc: subprocess.Popen[str]
    log: Path


@contextmanager
def _engine(python: str, args: list[str], log_dir: Path, name: str) -> Iterator[Engine]:
    log = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as err:
        proc = subprocess.Popen(
            [python, "-m", "kvroute", "sim", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env=env,
        )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        line = ""
        while not line:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{name} did not start:\n{log.read_text()[-3000:]}")
            if select.select([proc.stdout], [], [], 0.2)[0]:
                line = proc.stdout.readline().strip()
        info = json.loads(line)
        yield Engine(info["url"], info["replay"], proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _requests(seed: int) -> list[dict[str, Any]]:
    """A seeded sequence of completion bodies (token-id prompts) and one reset marker.

    Some bodies carry several prompts: the engine queues them together, in order, within one
    HTTP handler, so both engines batch them identically (chunked prefill side by side, the
    admission gate, preemption) although requests arrive over the network.
    """
    rng = random.Random(seed)
    bases = [[rng.randrange(10, 4000) for _ in range(rng.randint(70, 300))] for _ in range(3)]

    def prompt() -> list[int]:
        base = rng.choice(bases)
        keep = rng.choice([len(base), rng.randint(1, len(base))])
        return base[:keep] + [rng.randrange(10, 4000) for _ in range(rng.randint(0, 120))]

    out: list[dict[str, Any]] = []
    for i in range(24):
        if i == 12:
            out.append({"reset": True})
        if out and rng.random() < 0.2:
            body = dict(rng.choice([b for b in out if "prompt" in b]))
        else:
            many = rng.random() < 0.3
            body = {"prompt": [prompt() for _ in range(rng.randint(3, 8))] if many else prompt()}
            if rng.random() < 0.15:
                body["model"] = LORA
            if rng.random() < 0.15:
                body["cache_salt"] = "s1"
        body["max_tokens"] = rng.randint(1, 24)
        body["ignore_eos"] = True
        out.append(body)
    return out


def _prompts(body: dict[str, Any]) -> list[list[int]]:
    prompt = body.get("prompt", [])
    return prompt if prompt and isinstance(prompt[0], list) else [prompt] if prompt else []


def _post(client: httpx.Client, engine: Engine, path: str, body: dict[str, Any]) -> Any:
    response = client.post(f"{engine.url}{path}", json=body)
    assert response.status_code == 200, (path, response.text)
    return response.json()


def _stream(engine: Engine) -> list[tuple[int, list[Any]]]:
    """The engine's whole event stream, from its replay socket, once it stops growing."""
    previous: list[Any] | None = None
    for _ in range(20):
        got = replay(engine.replay, 0, timeout=5.0) or []
        if previous is not None and len(got) == len(previous):
            break
        previous = got
        time.sleep(0.3)
    decoder = BatchDecoder()
    out = []
    for seq, payload, _topic in got:
        batch = decoder.decode(payload)
        out.append((seq, list(batch.events)))
    assert decoder.unknown_field_batches == 0
    return out


class PrefixNames:
    """Names every hash of one stream by the prefix it ends: namespace + token prefix.

    Learned from dense stores (a hash per block_size tokens, chained from the parent), as
    reference §8 prescribes; sparse stores' hashes get their names from those.
    """

    def __init__(self) -> None:
        self.prefix: dict[Any, tuple[Any, tuple[int, ...]]] = {}

    def learn(self, ev: DecodedStored) -> None:
        if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            return
        if ev.parent_block_hash is None:
            first = ev.extra_keys[0] if ev.extra_keys else None
            namespace: Any = (ev.lora_name, None if first is None else tuple(first))
            prefix: tuple[int, ...] = ()
        else:
            namespace, prefix = self.prefix[ev.parent_block_hash]
        for i, h in enumerate(ev.block_hashes):
            known = (namespace, prefix + tuple(ev.token_ids[: (i + 1) * ev.block_size]))
            assert self.prefix.setdefault(h, known) == known, f"hash {h} names two prefixes"

    def name(self, h: Any) -> str:
        assert h in self.prefix, f"hash {h} is positioned by no dense store"
        namespace, prefix = self.prefix[h]
        digest = hashlib.sha256(repr(prefix).encode()).hexdigest()[:12]
        return f"{namespace}@{len(prefix)}:{digest}"


def normalize(stream: list[tuple[int, list[Any]]]) -> list[Any]:
    names = PrefixNames()
    out = []
    for seq, events in stream:
        for ev in events:
            if isinstance(ev, DecodedStored):
                names.learn(ev)
        batch = []
        for ev in events:
            d = msgspec.structs.asdict(ev)
            d["type"] = next(c.__name__ for c in KINDS if isinstance(ev, c))
            if isinstance(ev, (DecodedStored, DecodedRemoved)):
                d["block_hashes"] = [names.name(h) for h in ev.block_hashes]
            if isinstance(ev, DecodedStored) and ev.parent_block_hash is not None:
                d["parent_block_hash"] = names.name(ev.parent_block_hash)
            batch.append(json.loads(json.dumps(d)))  # tuples and lists compare alike
        out.append((seq, batch))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_vllm_backend_engine_matches_sim_engine_over_http(profile: str) -> None:
    python = vllm_python()
    args = [*ENGINE_ARGS, *PROFILES[profile]]
    with (
        tempfile.TemporaryDirectory() as tmp,
        _engine(sys.executable, args, Path(tmp), "sim") as sim,
        _engine(python, [*args, "--cache-backend", "vllm"], Path(tmp), "vllm") as vllm,
        httpx.Client(timeout=60) as client,
    ):
        cached: dict[str, list[int]] = {"sim": [], "vllm": []}
        for body in _requests(seed=len(profile)):
            for name, engine in (("sim", sim), ("vllm", vllm)):
                if body.get("reset"):
                    assert client.post(f"{engine.url}/reset_prefix_cache").status_code == 200
                    continue
                usage = _post(client, engine, "/v1/completions", body)["usage"]
                cached[name].append(usage["prompt_tokens_details"]["cached_tokens"])
        assert cached["sim"] == cached["vllm"]
        assert sum(x > 0 for x in cached["vllm"]) >= 5, cached  # the sequence does reuse

        for body in _requests(seed=len(profile)):
            for prompt in _prompts(body):
                probe = {k: body[k] for k in ("model", "cache_salt") if k in body}
                probe["prompt_token_ids"] = prompt
                assert _post(client, sim, "/sim/probe", probe) == _post(
                    client, vllm, "/sim/probe", probe
                )

        streams = {"sim": _stream(sim), "vllm": _stream(vllm)}
        events = [ev for _, batch in streams["vllm"] for ev in batch]
        assert any(isinstance(ev, DecodedRemoved) for ev in events)  # the small pool evicted
        assert any(isinstance(ev, DecodedCleared) for ev in events)
        assert any(
            isinstance(ev, DecodedStored) and ev.kv_cache_spec_kind != "full_attention"
            for ev in events
        )
        assert normalize(streams["sim"]) == normalize(streams["vllm"])
