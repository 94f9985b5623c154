"""The options that describe one simulated engine, shared by `kvroute sim` and `kvroute sim
fleet`."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import cast

from kvroute.sim.cache_api import CacheBackend, CacheSpec, missing_methods
from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import (
    DEFAULT_LEASE_S,
    DEFAULT_LINK_BYTES_PER_S,
    KV_ROLES,
    TransferConfig,
)
from kvroute.sim.offload import OffloadConfig
from kvroute.sim.offload.connector import DEFAULT_CPU_LINK_BITS_PER_S, GIB
from kvroute.sim.profiles import PROFILES


def _retention(value: str) -> int | None:
    if value.lower() in ("none", "dense"):
        return None
    return int(value)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by `kvroute sim` and `kvroute sim fleet` (passed on to each engine)."""
    p.add_argument("--model", default="kvroute-sim", help="served model name")
    p.add_argument(
        "--lora", action="append", default=[], metavar="NAME", help="a LoRA adapter name"
    )
    p.add_argument(
        "--model-profile",
        "--profile",
        dest="profile",
        default="dense",
        choices=sorted(PROFILES),
        help="KV cache layout (see kvroute/sim/profiles.py)",
    )
    p.add_argument("--sliding-window", type=int, help="override the profile's window")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV cache blocks (pool size)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256, help="batch limit")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget/step")
    p.add_argument(
        "--retention",
        type=_retention,
        default=0,
        help="prefix-cache retention interval: 0 (vLLM default), none (dense), N",
    )
    p.add_argument("--speed", type=float, default=1.0, help="run F times faster than an H100")
    p.add_argument("--seed", type=int, default=0, help="generation seed")
    p.add_argument(
        "--wire-version", default="0.33", help="vLLM event wire version (0.23/0.26/0.33)"
    )
    p.add_argument("--topic", default="", help="ZMQ topic")
    p.add_argument("--no-events", action="store_true", help="do not publish KV events")
    p.add_argument("--no-replay", action="store_true", help="no replay ROUTER socket")
    p.add_argument(
        "--cache-backend",
        choices=("sim", "vllm"),
        default="sim",
        help="sim: kvroute's reimplementation; vllm: vLLM's real KVCacheManager "
        "(kvroute.sim.vllm_backend, only where vLLM is installed)",
    )
    p.add_argument(
        "--kv-role",
        choices=KV_ROLES,
        help="prefill/decode disaggregation as vLLM's NixlConnector: kv_producer keeps a "
        "prefill's blocks for a peer, kv_consumer pulls them, kv_both does either; unset = off",
    )
    p.add_argument(
        "--kv-link-gbps",
        type=float,
        default=DEFAULT_LINK_BYTES_PER_S * 8 / 1e9,
        help="bandwidth a consumer pulls blocks at, Gbit/s (> 0; default one 400G RDMA NIC)",
    )
    p.add_argument(
        "--kv-lease-s",
        type=float,
        default=DEFAULT_LEASE_S,
        help="seconds a producer keeps unpulled blocks (vLLM's kv_lease_duration; > 0)",
    )
    p.add_argument(
        "--cpu-offload-gib",
        type=float,
        default=0.0,
        help="CPU tier size, GiB (vLLM's --kv-offloading-size with the native backend; "
        "0 = off; full-attention profiles only)",
    )
    p.add_argument(
        "--cpu-offload-gbps",
        type=float,
        default=DEFAULT_CPU_LINK_BITS_PER_S / 1e9,
        help="host-to-GPU copy rate of CPU-tier loads, Gbit/s (> 0; default ~PCIe 4.0 x16)",
    )
    p.add_argument(
        "--cpu-offload-chunk-blocks",
        type=int,
        default=1,
        help="GPU blocks per offloaded chunk (vLLM's blocks_per_chunk; >= 1)",
    )
    p.add_argument(
        "--runner",
        choices=("generate", "pooling"),
        default="generate",
        help="generate: completions, chat, responses; pooling: an embedding model "
        "(/v1/embeddings only), as vLLM's --runner",
    )
    p.add_argument("--log-level", default="warning")


def cache_factory(name: str) -> Callable[[CacheSpec], CacheBackend]:
    """The cache backend class for --cache-backend (ImportError if vLLM is missing)."""
    if name == "vllm":
        cls = importlib.import_module("kvroute.sim.vllm_backend").VllmCacheBackend
        missing = missing_methods(cls)
        if missing:
            raise ImportError(
                f"kvroute.sim.vllm_backend.VllmCacheBackend lacks {', '.join(missing)} "
                "(see kvroute/sim/cache_api.py)"
            )
        return cast(Callable[[CacheSpec], CacheBackend], cls)
    from kvroute.sim.cache import SimCache

    return SimCache


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the options describe (ValueError for options that do not go
    together)."""
    if args.cpu_offload_gib > 0:
        if args.cache_backend != "sim":
            raise ValueError("--cpu-offload-gib runs on --cache-backend sim only")
        if args.wire_version != "0.33":
            raise ValueError(
                "--cpu-offload-gib publishes vLLM 0.33's CPU events: --wire-version 0.33"
            )
    return EngineConfig(
        model=args.model,
        lora_adapters=tuple(args.lora),
        profile=args.profile,
        sliding_window=args.sliding_window,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        retention_interval=args.retention,
        speed=args.speed,
        seed=args.seed,
        runner=args.runner,
        kv_transfer=None
        if args.kv_role is None
        else TransferConfig(args.kv_role, args.kv_link_gbps * 1e9 / 8, args.kv_lease_s),
        cpu_offload=None
        if args.cpu_offload_gib <= 0
        else OffloadConfig(
            int(args.cpu_offload_gib * GIB),
            args.cpu_offload_gbps * 1e9 / 8,
            args.cpu_offload_chunk_blocks,
        ),
    )


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The `kvroute sim` options that reproduce these engine settings (for the fleet)."""
    out = [
        "--model", args.model, "--model-profile", args.profile,
        "--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--retention", "none" if args.retention is None else str(args.retention),
        "--speed", str(args.speed), "--seed", str(args.seed),
        "--wire-version", args.wire_version, "--topic", args.topic, "--log-level", args.log_level,
        "--cache-backend", args.cache_backend, "--runner", args.runner,
    ]  # fmt: skip
    for name in args.lora:
        out += ["--lora", name]
    if args.sliding_window is not None:
        out += ["--sliding-window", str(args.sliding_window)]
    if args.no_events:
        out.append("--no-events")
    if args.no_replay:
        out.append("--no-replay")
    if args.cpu_offload_gib > 0:
        out += ["--cpu-offload-gib", str(args.cpu_offload_gib),
                "--cpu-offload-gbps", str(args.cpu_offload_gbps),
                "--cpu-offload-chunk-blocks", str(args.cpu_offload_chunk_blocks)]  # fmt: skip
    if args.kv_role is not None:
        out += ["--kv-role", args.kv_role, "--kv-link-gbps", str(args.kv_link_gbps),
                "--kv-lease-s", str(args.kv_lease_s)]  # fmt: skip
    return out
