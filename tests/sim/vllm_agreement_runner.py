"""Run the same request sequences through SimCache and vLLM's real KVCacheManager.

Usage (inside .venv-vllm, with the repository on PYTHONPATH):
    python tests/sim/vllm_agreement_runner.py --seeds 0-19
Prints one JSON line per scenario with the first divergence (or none) and exits 1 if any
scenario diverged. Both backends are driven by the same scheduler (kvroute.sim.engine.scheduler),
so a
divergence in admission, chunking, preemption, hits or events shows up as a different trace.
Hashes differ between the backends by design; events are compared after mapping every hash
to the token prefix (and namespace) it stands for.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from kvroute.sim.cache import SimCache
from kvroute.sim.cache.hashing import external
from kvroute.sim.cache_api import CacheRequest, CacheSpec, GroupSpec
from kvroute.sim.engine.scheduler import Scheduler
from kvroute.sim.events import BlockRemoved, BlockStored, KvEvent

PROFILES: dict[str, tuple[GroupSpec, ...]] = {
    "dense": (GroupSpec("full_attention", 16),),
    "swa": (GroupSpec("full_attention", 16), GroupSpec("sliding_window", 16, 32)),
    "hybrid3": (
        GroupSpec("full_attention", 16),
        GroupSpec("sliding_window", 16, 32),
        GroupSpec("mamba", 16),
    ),
    "mamba64": (GroupSpec("full_attention", 16), GroupSpec("mamba", 64)),
    "hybrid3_m64": (
        GroupSpec("full_attention", 16),
        GroupSpec("sliding_window", 16, 32),
        GroupSpec("mamba", 64),
    ),
    "fa32_swa": (GroupSpec("full_attention", 32), GroupSpec("sliding_window", 16, 48)),
}


class PrefixNames:
    """Maps each backend's hash ints to a backend-independent name of the prefix."""

    def __init__(self) -> None:
        self.names: dict[int | bytes, str] = {}

    def learn(
        self, hashes: list[Any], tokens: list[int], unit: int, ns: str, conv: Callable[[Any], int]
    ) -> None:
        for i, h in enumerate(hashes):
            prefix = tokens[: (i + 1) * unit]
            self.names.setdefault(
                conv(h), f"{ns}|{(i + 1) * unit}|{hash(tuple(prefix)) & 0xFFFFFF:06x}"
            )

    def name(self, h: Any) -> str:
        return self.names.get(h, f"?{h}")


def normalize(events: list[KvEvent], names: PrefixNames) -> list[dict[str, Any]]:
    out = []
    for ev in events:
        d = msgspec.structs.asdict(ev)
        d["type"] = type(ev).__name__
        if isinstance(ev, (BlockStored, BlockRemoved)):
            d["block_hashes"] = [names.name(h) for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            d["parent_block_hash"] = (
                None if ev.parent_block_hash is None else names.name(ev.parent_block_hash)
            )
            if d["extra_keys"] is not None:
                d["extra_keys"] = [None if k is None else list(k) for k in d["extra_keys"]]
        out.append(d)
    return out


def make_scenario(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    profile = rng.choice(sorted(PROFILES))
    groups = PROFILES[profile]
    retention = rng.choice([0, 0, None, "seg"])
    spec_probe = CacheSpec(groups=groups, num_blocks=1000)
    if retention == "seg" and not any(g.kind != "full_attention" for g in groups):
        retention = 0
    if retention == "seg":
        retention = spec_probe.scheduler_block_size * rng.choice([2, 4])
    prefixes = [[rng.randrange(5, 4000) for _ in range(rng.randint(20, 150))] for _ in range(4)]
    reqs = []
    for i in range(rng.randint(6, 24)):
        if reqs and rng.random() < 0.3:
            tokens = list(rng.choice(reqs)["tokens"])  # an exact repeat
        else:
            base = rng.choice(prefixes)
            keep = rng.choice([len(base), len(base), rng.randint(0, len(base))])
            tail = [rng.randrange(5, 4000) for _ in range(rng.randint(0, 90))]
            tokens = (base[:keep] + tail) or [7]
        reqs.append(
            {
                "id": f"r{i}",
                "tokens": tokens,
                "max_tokens": rng.randint(1, 40),
                "arrive": rng.randint(0, 120),
                "salt": rng.choice([None, None, None, "s1"]),
                "lora": rng.choice([None, None, None, "ad1"]),
            }
        )
    return {
        "seed": seed,
        "profile": profile,
        "retention": retention,
        "num_blocks": rng.choice([rng.randint(24, 60), rng.randint(60, 240)]),
        "budget": rng.choice([32, 64, 128, 2048]),
        "max_num_seqs": rng.choice([1, 2, 4, 8]),
        "requests": reqs,
        "reset_at": rng.choice([None, None, rng.randint(5, 60)]),
    }


def run(backend_factory: Callable[[CacheSpec], Any], sc: dict[str, Any]) -> list[Any]:
    groups = PROFILES[sc["profile"]]
    spec = CacheSpec(
        groups=groups,
        num_blocks=sc["num_blocks"],
        max_model_len=4096,
        retention_interval=sc["retention"],
        max_num_scheduled_tokens=sc["budget"],
        max_in_flight_tokens=sc["budget"],
    )
    cache = backend_factory(spec)
    sched = Scheduler(cache, max_num_seqs=sc["max_num_seqs"], max_num_scheduled_tokens=sc["budget"])
    names = PrefixNames()
    unit = spec.hash_block_size
    is_sim = isinstance(cache, SimCache)

    def learn(rid: str) -> None:
        if is_sim:
            seq = cache.seqs.get(rid)
            if seq is not None:
                ns = f"{seq.req.lora_name}/{seq.req.cache_salt}"
                names.learn(seq.block_hashes, seq.all_token_ids, unit, ns, external)
        else:
            r = cache.requests.get(rid)
            if r is not None:
                ns = f"{r.lora_request.lora_name if r.lora_request else None}/{r.cache_salt}"
                names.learn(
                    list(r.block_hashes),
                    list(r.all_token_ids),
                    unit,
                    ns,
                    lambda h: int.from_bytes(h, "big") & (2**64 - 1),
                )

    trace: list[Any] = []
    pending = sorted(sc["requests"], key=lambda r: r["arrive"])
    outputs: dict[str, int] = {}
    step = 0
    while (pending or sched.has_work()) and step < 2000:
        while pending and pending[0]["arrive"] <= step:
            r = pending.pop(0)
            sched.add(
                CacheRequest(
                    r["id"],
                    tuple(r["tokens"]),
                    lora_name=r["lora"],
                    lora_id=1 if r["lora"] else None,
                    lora_path="/p" if r["lora"] else None,
                    cache_salt=r["salt"],
                    max_tokens=r["max_tokens"],
                )
            )
            learn(r["id"])
        if sc["reset_at"] == step:
            trace.append(["reset", step, cache.reset(), normalize(cache.end_step(), names)])
        plan = sched.schedule()

        def sample(rid: str) -> int:
            outputs[rid] = outputs.get(rid, 0) + 1
            return 10 + (outputs[rid] * 7 + len(rid)) % 50

        for s in plan.scheduled:
            learn(s.request_id)
        res = sched.complete(plan, sample, lambda rid, tok: False)
        for rid in res.tokens:
            learn(rid)
        trace.append(
            [
                "step",
                step,
                [(s.request_id, s.num_tokens, s.new, s.cached_tokens) for s in plan.scheduled],
                plan.preempted,
                normalize(res.events, names),
                round(cache.usage(), 6),
            ]
        )
        step += 1
    # Final probes: per-group and joint hits for every request's prompt (and an extension).
    for r in sc["requests"]:
        for variant, toks in (("same", r["tokens"]), ("ext", r["tokens"] + [9, 9, 9])):
            pid = f"probe-{r['id']}-{variant}"
            sched.cache.add_request(
                CacheRequest(
                    pid,
                    tuple(toks),
                    lora_name=r["lora"],
                    lora_id=1 if r["lora"] else None,
                    lora_path="/p" if r["lora"] else None,
                    cache_salt=r["salt"],
                )
            )
            lk = cache.lookup(pid)
            trace.append(
                ["probe", pid, lk.hit_tokens, lk.shared_prefix_boundary, cache.per_group_hits(pid)]
            )
            cache.free(pid)
    return trace


def first_divergence(a: list[Any], b: list[Any]) -> Any:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if json.dumps(x, sort_keys=True, default=str) != json.dumps(y, sort_keys=True, default=str):
            return {"index": i, "sim": x, "vllm": y}
    if len(a) != len(b):
        return {"index": min(len(a), len(b)), "len_sim": len(a), "len_vllm": len(b)}
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0-9")
    args = parser.parse_args(argv)
    lo, _, hi = args.seeds.partition("-")
    from kvroute.sim.vllm_backend import VllmCacheBackend  # only importable in .venv-vllm

    bad = 0
    for seed in range(int(lo), int(hi or lo) + 1):
        sc = make_scenario(seed)
        diff = first_divergence(run(SimCache, sc), run(VllmCacheBackend, sc))
        bad += diff is not None
        print(
            json.dumps(
                {
                    "seed": seed,
                    "profile": sc["profile"],
                    "retention": sc["retention"],
                    "diverged": diff is not None,
                    "diff": diff,
                },
                default=str,
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
