"""The recorded scenarios and fleets: cache layouts, workloads, reference examples, limits.

Runs only in the vLLM environment (imported by vllm_driver.py). Tests in the main environment
list the names in vllm_recording.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from vllm_workloads import Recorder, Workload

from kvroute.sim.vllm_backend import BackendConfig, GroupConfig, Namespace

FA, SW, MB, CB = "full_attention", "sliding_window", "mamba", "circular_buffer"


@dataclass
class Scenario:
    """One worker: a cache layout plus a scripted sequence or a random workload."""

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
    # For known-limit scenarios: which limit they demonstrate (see docs/indexer.md, "Known limits").
    limit: str = ""


@dataclass
class Fleet:
    """Several workers recorded together; each request goes to `replicas` of them."""

    name: str
    about: str
    workers: dict[str, BackendConfig]
    workload: Workload
    replicas: int = 2
    seed: int = 0


# ---- reference §7.6 examples and known limits, scripted ----


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
    dense = rec.loop.backend.spec.retention_interval is None
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


# ---- the lists ----


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


def scenarios(extra_seeds: int = 0) -> list[Scenario]:
    """The scenarios, then `extra_seeds` reseeded copies of every random-workload one that is
    not a limit (named `NAME~sK`), for longer bug hunts."""
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
        Scenario(
            "mamba_swa_dense",
            "Mamba64 + SWA16 (window 64), no full attention (Samba-like), dense retention: "
            "window tails and Mamba states outlive their evicted prefixes",
            BackendConfig((G(SW, 16, 64), G(MB, 64)), num_blocks=72, retention_interval=None),
            Workload(requests=40, namespaces=NS_MIX),
            seed=16,
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
    extra = [
        dataclasses.replace(sc, name=f"{sc.name}~s{k}", seed=sc.seed * 1000 + k)
        for k in range(1, extra_seeds + 1)
        for sc in s
        if sc.workload is not None and not sc.limit
    ]
    return s + extra


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
