"""How long a GPU spends on one engine step: a roofline model of Llama-3.1-8B on one H100.

THESE ARE APPROXIMATIONS, good enough for routing experiments (queues form, prefix hits save
prefill time, bigger batches decode slower), not a performance predictor.

Model: meta-llama/Llama-3.1-8B-Instruct, BF16, on one NVIDIA H100 SXM 80GB, vLLM V1.
  - Weights: 8.03e9 parameters x 2 bytes = 16.06 GB, read once per step.
  - KV cache per token: 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes = 131,072 B.
  - Compute per token: ~2 x 8.03e9 FLOPs for the dense layers, plus attention
    4 x 32 layers x 4096 (query dims) FLOPs per token of context.
Hardware (NVIDIA H100 SXM datasheet): 3.35 TB/s HBM3; 989 TFLOPS dense BF16.
Efficiencies (calibration):
  - Memory: 77% of peak bandwidth, as measured for Llama-3.1-8B decode at batch 1 with vLLM
    (johnmusgrave.com, "vLLM throughput-latency sweep on NVIDIA A100": 75 tok/s at C=1 on
    an A100-40GB = 77% of its bandwidth roofline). On an H100 that gives ~6.2 ms per decode
    step at batch 1 (~160 tok/s), in line with published single-stream H100 figures.
  - Compute: 50% MFU for prefill, which makes a 1,024-token prompt take ~35 ms alone (TTFT
    tens of milliseconds, as vLLM H100 benchmarks report for short prompts on 8B models).
  - Saturated decode (256 sequences of ~1k context) comes out at ~10.7k output tok/s (24 ms
    steps), the order of what third-party vLLM benchmarks report for Llama 3.1 8B on one
    H100 (morphllm.com/vllm-benchmarks: "~12,500 tok/s, Llama 3.1 8B, 1xH100").
  - A fixed per-step overhead (scheduling, sampling, launch) of 0.6 ms plus 15 us per sequence.
A step's time is overhead + max(memory time, compute time) (a roofline: small batches are
bandwidth bound, prefill chunks compute bound). Everything is divided by `speed` so tests and
demos run faster than real time (speed=10 means ten times faster than the modelled GPU).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Step-time model; defaults are Llama-3.1-8B BF16 on one H100 SXM (see module doc)."""

    weight_bytes: float = 8.03e9 * 2
    kv_bytes_per_token: float = 32 * 8 * 128 * 2 * 2
    flops_per_token: float = 2 * 8.03e9
    attn_flops_per_token_per_ctx: float = 4 * 32 * 4096
    mem_bandwidth: float = 3.35e12 * 0.77
    compute: float = 989e12 * 0.50
    step_overhead: float = 0.6e-3
    per_seq_overhead: float = 15e-6

    def step_seconds(
        self,
        prefill_tokens: int,
        prefill_context: int,
        decode_seqs: int,
        decode_context: int,
    ) -> float:
        """Modelled GPU time of one step.

        prefill_tokens: new (uncached) tokens computed this step, over all prefill chunks;
        prefill_context: sum over those tokens of the context each attends to (approximate
        it as tokens x (start + tokens / 2) per chunk);
        decode_seqs: requests decoding one token; decode_context: their total context length.
        """
        seqs = decode_seqs + (1 if prefill_tokens else 0)
        if seqs == 0:
            return 0.0
        tokens = prefill_tokens + decode_seqs
        memory = (self.weight_bytes + decode_context * self.kv_bytes_per_token) / self.mem_bandwidth
        flops = tokens * self.flops_per_token + self.attn_flops_per_token_per_ctx * (
            prefill_context + decode_context
        )
        return self.step_overhead + seqs * self.per_seq_overhead + max(memory, flops / self.compute)


def chunk_context(start: int, num_tokens: int) -> int:
    """Total attention context of a prefill chunk [start, start + num_tokens)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


DEFAULT_GPU = GpuModel()
