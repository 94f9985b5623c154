"""The tiered benchmark's parts: its workload, the GPU-only kvroute variant, tokens per tier."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx

from bench.routing_bench import BENCH_PRESETS, TIERED_FLEET_ARGS, build_config, cached_by_source
from bench.routing_bench import parse_args as bench_args
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine_args import engine_config
from kvroute.sim.offload import OffloadConfig
from kvroute.sim.server import SimEngineThread
from kvroute.testbed.sim_fleet import Engine
from kvroute.testbed.workload import describe
from tests.bench.test_bench_tools import _variant_configs


def test_the_gpu_only_variant_prices_cpu_tokens_as_prefill_and_changes_nothing_else(
    tmp_path: Path,
) -> None:
    loaded = _variant_configs(tmp_path, "kvroute", "kvroute-gpu-only")
    base, gpu_only = loaded["kvroute"].policy, loaded["kvroute-gpu-only"].policy
    assert base.cpu_tier_tokens_per_s > 5 * base.prefill_tokens_per_s  # a CPU load is cheap
    assert gpu_only.cpu_tier_tokens_per_s == gpu_only.prefill_tokens_per_s
    assert dataclasses.replace(gpu_only, cpu_tier_tokens_per_s=base.cpu_tier_tokens_per_s) == base


def test_the_tiered_preset_is_late_returning_chats_that_fit_the_tiered_fleet() -> None:
    cfg = build_config(bench_args(["--preset", "tiered", "--seed", "1"]))
    info = describe(cfg.trace)
    assert set(info["kinds"]) == {"chat"}
    chat = BENCH_PRESETS["tiered"].chat
    assert chat.think_time_s >= 10 and chat.turns[0] >= 3
    max_len = int(TIERED_FLEET_ARGS[TIERED_FLEET_ARGS.index("--max-model-len") + 1])
    longest = max(r.prompt_tokens + r.max_tokens for r in cfg.trace)
    assert longest <= max_len
    # a conversation's history is larger than the GPU pool's share of it: it must leave the GPU
    blocks = int(TIERED_FLEET_ARGS[TIERED_FLEET_ARGS.index("--num-blocks") + 1])
    assert info["prompt_tokens"] > 10 * blocks * 16


def test_tokens_per_tier_are_read_from_the_engines_metrics() -> None:
    config = EngineConfig(
        speed=50, num_blocks=80, max_model_len=1024, cpu_offload=OffloadConfig(1 << 30)
    )
    with SimEngineThread(config) as sim:
        engines = [Engine("e", sim.url)]
        before = cached_by_source(engines)
        prompts = [list(range(base, base + 600)) for base in (1000, 2000, 3000, 1000)]
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 1}
            assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30).status_code == 200
        after = cached_by_source(engines)
        tier = httpx.get(f"{sim.url}/sim/state", timeout=10).json()["cpu_tier"]
    assert tier["chunks"] == 3 * (600 // 16) and tier["capacity_chunks"] == 8192 // 16
    assert set(after) == {"device", "host", "p2p", "disk", "external_unspecified"}
    assert after["host"] - before.get("host", 0) > 400  # the first prompt came back from CPU
    assert after["device"] + after["host"] == 592


def test_fleet_args_reach_the_engines_config() -> None:
    from kvroute.sim.cli import build_parser

    args = build_parser().parse_args(list(TIERED_FLEET_ARGS))
    assert engine_config(args).cpu_offload == OffloadConfig(4 << 30)
