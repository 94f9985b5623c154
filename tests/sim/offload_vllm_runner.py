"""The sim's CPU tier against vLLM 0.33's own `CPUOffloadingManager` (lru) on random requests.

Run in the vLLM environment with the repository on PYTHONPATH, never imported by pytest:
`python tests/sim/offload_vllm_runner.py --seeds 0-9` prints one JSON line per seed.

Both sides see the same requests: prompts from a few families sharing prefixes, several live
at once, each admitted with a lookup from a random block-aligned GPU hit (a load if the tier
continues it), computing its prompt over a few steps and then finishing. The sim side is
`kvroute.sim.offload.OffloadConnector`; the vLLM side calls the manager as vLLM's
`OffloadingConnectorScheduler` does (`prepare_load` after a hit, `prepare_store` of the chunks
a step fills from `next_stored_chunk_idx`, `on_request_finished` after the last store,
`complete_store` / `complete_load` when the transfers end a step later). After every step the
chunks each tier holds, the chunks evicted and every admission's hit must agree.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvroute.sim.cache.hashing import Digest, external
from kvroute.sim.cache.request import CacheSeq
from kvroute.sim.cache_api import CacheRequest, CacheSpec, GroupSpec
from kvroute.sim.offload import OffloadConfig, OffloadConnector

BLOCK = 16
BYTES_PER_TOKEN = 1.0


@dataclass
class _VllmReq:
    ctx: ReqContext
    keys: list[bytes]
    next_stored: int = 0
    loading: list[bytes] = field(default_factory=list)


class VllmSide:
    """vLLM's manager, called as its connector scheduler calls it."""

    def __init__(self, chunks: int) -> None:
        self.manager = CPUOffloadingManager(num_chunks=chunks, enable_events=True)
        self.reqs: dict[str, _VllmReq] = {}
        self.stores: list[list[bytes]] = []  # keys of the stores prepared this step, per job
        self.pending: list[tuple[str, list[bytes]]] = []  # prepared a step ago
        self.loads: list[tuple[str, list[bytes]]] = []

    def add(self, rid: str, digests: list[Digest], tokens_per_chunk: int) -> None:
        per = tokens_per_chunk // BLOCK
        keys = [make_offload_key(digests[(i + 1) * per - 1], 0) for i in range(len(digests) // per)]
        ctx = ReqContext(req_id=rid)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * tokens_per_chunk)
        self.manager.on_new_request(ctx)
        self.reqs[rid] = _VllmReq(ctx, keys)

    def lookup(self, rid: str, gpu_hit: int, num_tokens: int, tpc: int) -> int:
        req = self.reqs[rid]
        start = gpu_hit // tpc
        hits = 0
        for key in req.keys[start:]:
            if self.manager.lookup(key, req.ctx) is not LookupResult.HIT:
                break
            hits += 1
        end = min(num_tokens, (start + hits) * tpc)
        if end - gpu_hit < tpc:
            return 0
        keys = req.keys[start : start + hits]
        self.manager.prepare_load(keys, req.ctx)
        self.loads.append((rid, keys))
        req.next_stored = -(-end // tpc)
        return end - gpu_hit

    def offer(self, rid: str, computed: int, tpc: int) -> None:
        req = self.reqs[rid]
        end = min(computed // tpc, len(req.keys))
        if end <= req.next_stored:
            return
        out = self.manager.prepare_store(req.keys[req.next_stored : end], req.ctx)
        if out is None:
            return
        req.next_stored = end
        if out.keys_to_store:
            self.pending.append((rid, list(out.keys_to_store)))

    def finish(self, rid: str, computed: int, tpc: int) -> None:
        self.offer(rid, computed, tpc)
        self.manager.on_request_finished(self.reqs.pop(rid).ctx)

    def end_step(self, contexts: dict[str, ReqContext]) -> tuple[set[bytes], set[bytes]]:
        """Complete the stores prepared a step ago and the loads; (stored, removed) keys."""
        for rid, keys in self.stores:
            self.manager.complete_store(keys, contexts[rid])
        for rid, keys in self.loads:
            self.manager.complete_load(keys, contexts[rid])
        self.stores, self.pending, self.loads = self.pending, [], []
        stored: set[bytes] = set()
        removed: set[bytes] = set()
        for event in self.manager.take_events():
            (removed if event.removed else stored).update(event.keys)
        return stored, removed


class Seqs:
    """The sim connector's view of the requests' hash chains."""

    def __init__(self) -> None:
        self.seqs: dict[str, CacheSeq] = {}

    def seq(self, request_id: str) -> CacheSeq:
        return self.seqs[request_id]


def run(seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    chunk_blocks = rng.choice((1, 2, 4))
    tpc = BLOCK * chunk_blocks
    capacity = rng.randrange(6, 30)
    spec = CacheSpec(groups=(GroupSpec("full_attention", BLOCK),), num_blocks=64)
    seqs = Seqs()
    sim = OffloadConnector(
        OffloadConfig(int(capacity * tpc * BYTES_PER_TOKEN), chunk_blocks=chunk_blocks),
        spec,
        seqs,
        BYTES_PER_TOKEN,
    )
    vllm = VllmSide(capacity)
    families = [
        [rng.randrange(1000, 30000) for _ in range(rng.randrange(16, 200))] for _ in range(5)
    ]
    live: dict[str, tuple[int, int]] = {}  # rid -> (computed, prompt length)
    contexts: dict[str, ReqContext] = {}
    keys_of: dict[bytes, int] = {}  # vLLM key -> the sim's key
    hits = evictions = loads = 0
    sim_loads: list[str] = []
    for step in range(120):
        for _ in range(rng.choice((0, 1, 1, 2))):  # admissions
            rid = f"r{step}-{len(live)}-{rng.randrange(10**6)}"
            base = rng.choice(families)
            prompt = base[: rng.randrange(8, len(base) + 1)] + [
                rng.randrange(1000, 30000) for _ in range(rng.randrange(0, 80))
            ]
            seq = CacheSeq(CacheRequest(rid, tuple(prompt)), BLOCK)
            seqs.seqs[rid] = seq
            vllm.add(rid, seq.block_hashes, tpc)
            contexts[rid] = vllm.reqs[rid].ctx
            for i in range(len(seq.block_hashes) // chunk_blocks):
                key = make_offload_key(seq.block_hashes[(i + 1) * chunk_blocks - 1], 0)
                keys_of[key] = external(seq.block_hashes[(i + 1) * chunk_blocks - 1])
            gpu = BLOCK * rng.randrange(0, len(prompt) // BLOCK + 1)
            gpu = min(gpu, (len(prompt) - 1) // BLOCK * BLOCK)
            got_sim = sim.lookup(rid, gpu, len(prompt))
            got_vllm = vllm.lookup(rid, gpu, len(prompt), tpc)
            if got_sim != got_vllm:
                return {"seed": seed, "diverged": f"step {step}: hit {got_sim} != {got_vllm}"}
            hits += got_sim > 0
            live[rid] = (gpu + got_sim, len(prompt))
            if got_sim:
                sim_loads.append(rid)
                loads += 1
        for rid in list(live):  # a step of every live request (not one still loading)
            if rid in sim_loads:
                continue
            computed, n = live[rid]
            computed = min(n, computed + rng.choice((16, 40, 64, 200)))
            if computed >= n or rng.random() < 0.1:
                sim.finish(rid, computed)
                vllm.finish(rid, computed, tpc)
                del live[rid]
            else:
                sim.offer(rid, computed)
                vllm.offer(rid, computed, tpc)
                live[rid] = (computed, n)
        for rid in sim_loads:  # the loads end with the step, on both sides
            sim.load_done(rid)
        sim_loads.clear()
        sim_events = sim.end_step()
        stored, removed = vllm.end_step(contexts)
        sim_stored = {
            e.block_hashes[-1] for e in sim_events if e.__class__.__name__ == "BlockStored"
        }  # type: ignore[union-attr]
        sim_removed = {
            h
            for e in sim_events
            if e.__class__.__name__ == "BlockRemoved"
            for h in e.block_hashes[chunk_blocks - 1 :: chunk_blocks]  # type: ignore[union-attr]
        }
        if sim_stored != {keys_of[k] for k in stored} or sim_removed != {
            keys_of[k] for k in removed
        }:
            vs, vr = {keys_of[k] for k in stored}, {keys_of[k] for k in removed}
            return {
                "seed": seed,
                "diverged": f"step {step}: events differ",
                "stored": [len(sim_stored - vs), len(vs - sim_stored)],
                "removed": [len(sim_removed - vr), len(vr - sim_removed)],
            }
        evictions += len(removed)
        held_sim = {c.key for c in sim.tier.ready_chunks()}
        held_vllm = {
            keys_of[k]
            for k in keys_of
            if vllm.manager.lookup(k, ReqContext(req_id="probe")) is LookupResult.HIT
        }
        if held_sim != held_vllm:
            return {
                "seed": seed,
                "diverged": f"step {step}: held {len(held_sim)} vs {len(held_vllm)}",
            }
    return {
        "seed": seed,
        "diverged": None,
        "chunk_blocks": chunk_blocks,
        "capacity": capacity,
        "hits": hits,
        "loads": loads,
        "evictions": evictions,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", default="0-9", help="a range a-b")
    a, b = (int(x) for x in p.parse_args().seeds.split("-"))
    for seed in range(a, b + 1):
        print(json.dumps(run(seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
