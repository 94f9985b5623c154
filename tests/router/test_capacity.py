"""A worker's KV capacity: read from `vllm:cache_config_info` as vLLM and the simulated
engine export it, and the most blocks the events showed per group."""

from __future__ import annotations

import json
import subprocess

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from kvroute.router.fleet.capacity import EngineCache, KvCapacity, parse_cache_config
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.metrics import EngineMetrics, kv_cache_size_tokens
from tests.sim.vllm_env import vllm_python


def vllm_page(engines: dict[str, dict[str, str]]) -> str:
    """A page shaped like vLLM's: every CacheConfig field a label (str() of its value, so
    unset ones read "None"), the same gauge for each DP engine, beside other series."""
    r = CollectorRegistry()
    fields = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
              "kv_cache_size_tokens", "num_cpu_blocks", "num_gpu_blocks", "sliding_window",
              "engine")  # fmt: skip
    info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", fields,
                 registry=r)  # fmt: skip
    running = Gauge("vllm:num_requests_running", "running", ("model_name", "engine"), registry=r)
    for engine, values in engines.items():
        base = {"cache_dtype": "auto", "enable_prefix_caching": "True", "num_cpu_blocks": "None",
                "gpu_memory_utilization": "0.92", "sliding_window": "None"}  # fmt: skip
        info.labels(**{**base, **values, "engine": engine}).set(1)
        running.labels("m", engine).set(2)
    return generate_latest(r).decode()


def test_the_group_aware_tokens_win_over_blocks_times_block_size() -> None:
    page = vllm_page(
        {"0": {"block_size": "16", "num_gpu_blocks": "2048", "kv_cache_size_tokens": "24576"}}
    )
    got = parse_cache_config(page, 0)
    assert got == EngineCache(2048, 16, 24576)
    assert got.tokens == 24576  # a hybrid model: less than 2048 x 16
    older = vllm_page({"0": {"block_size": "16", "num_gpu_blocks": "2048",
                             "kv_cache_size_tokens": "None"}})  # fmt: skip
    got = parse_cache_config(older, 0)
    assert got is not None and got.kv_cache_size_tokens is None and got.tokens == 2048 * 16


def test_data_parallel_engines_share_the_summed_block_count() -> None:
    # vLLM sums num_gpu_blocks over the DP engines one API server fronts and repeats the sum
    # on each engine's line; kv_cache_size_tokens is already per engine
    values = {"block_size": "16", "num_gpu_blocks": "4096", "kv_cache_size_tokens": "None"}
    page = vllm_page({"0": values, "1": values})
    for rank in (0, 1):
        got = parse_cache_config(page, rank)
        assert got is not None and got.num_gpu_blocks == 2048 and got.tokens == 2048 * 16
    assert parse_cache_config(vllm_page({"1": values}), 0) is None  # another rank's line only


def test_pages_without_the_metric_or_with_junk_values_read_as_unknown() -> None:
    assert parse_cache_config("vllm:num_requests_running 1\n", 0) is None
    assert parse_cache_config('# HELP vllm:cache_config_info{block_size="16"} x\n', 0) is None
    got = parse_cache_config('vllm:cache_config_info{block_size="x",num_gpu_blocks="-3"} 1\n', 0)
    assert got == EngineCache(None, None, None) and got.tokens is None


def test_the_simulated_engine_exports_its_pool_the_way_vllm_does() -> None:
    dense = EngineConfig(num_blocks=160, max_model_len=1024)
    m = EngineMetrics(dense.model)
    m.cache_config(dense.cache_spec())
    got = parse_cache_config(generate_latest(m.registry).decode(), 0)
    assert got is not None and got.num_gpu_blocks == 160 and got.block_size == 16
    assert got.tokens == 160 * 16  # dense: every block holds block_size tokens
    # a sliding-window model: a max_model_len request takes its window's blocks from the
    # sliding group and every block from the full group, all from one pool
    swa = EngineConfig(profile="swa", num_blocks=600, max_model_len=4096)
    spec = swa.cache_spec()
    tokens = kv_cache_size_tokens(spec)
    full = sum(1 for g in spec.groups if g.kind != "sliding_window")
    assert full >= 1 and tokens < 600 * spec.scheduler_block_size // full
    assert tokens > 600 * spec.scheduler_block_size // len(spec.groups)


def test_peaks_only_rise() -> None:
    cap = KvCapacity()
    cap.observe_blocks({0: 10, 1: 4})
    cap.observe_blocks({0: 7, 1: 9, 2: 1})
    assert cap.peak_blocks == {0: 10, 1: 9, 2: 1}
    assert cap.tokens() is None  # the events' peak is shown, never priced
    cap.engine = EngineCache(100, 16, None)
    assert cap.tokens() == 1600


VLLM_CAPACITY = """
import json, sys, torch
from types import SimpleNamespace as NS
from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
)
blocks, length, in_flight, window = (int(a) for a in sys.argv[1:])
config = NS(max_in_flight_tokens=in_flight, model_config=NS(max_model_len=length),
            parallel_config=NS(decode_context_parallel_size=1),
            cache_config=NS(mamba_cache_mode="none"))
heads = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
layouts = {"dense": [FullAttentionSpec(16, **heads)],
           "swa": [FullAttentionSpec(16, **heads),
                   SlidingWindowSpec(16, sliding_window=window, **heads)]}
out = {}
for name, specs in layouts.items():
    groups = [KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)]
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    out[name] = int(get_max_concurrency_for_kv_cache_config(config, kv) * length)
print(json.dumps(out))
"""


def test_the_simulated_capacity_is_what_vllm_computes() -> None:
    """vLLM 0.33's own capacity function on the same layouts gives the same tokens."""
    python = vllm_python()
    swa = EngineConfig(profile="swa", num_blocks=600, max_model_len=4096).cache_spec()
    (window,) = {g.sliding_window for g in swa.groups if g.kind == "sliding_window"}
    args = [str(600), str(4096), str(swa.max_in_flight_tokens), str(window)]
    done = subprocess.run(
        [python, "-c", VLLM_CAPACITY, *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    dense = EngineConfig(profile="dense", num_blocks=600, max_model_len=4096).cache_spec()
    assert vllm == {"dense": kv_cache_size_tokens(dense), "swa": kv_cache_size_tokens(swa)}
