"""The decode choice's default charge per running sequence (`pd.running_s`) against the step
model it stands for (docs/decisions/pd-decode-choice.md).

A conversation's next turn should return to the decode worker that holds its earlier turns'
blocks unless that worker is really much busier: a running sequence costs a decode step what
reading its KV costs (tens of microseconds per thousand tokens of context), not the 2 ms the
charge was, which outweighed the transfer of dozens of blocks. The tests use the default
`PdConfig()`: the first four fail under the old 2 ms default; `a much busier holder still
loses` guards the other side, and the last pins the testbed's variant with the old charge.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvroute.router.config import PdConfig, PolicyConfig
from kvroute.router.fleet.load import LoadTicket
from kvroute.router.fleet.workers import Worker
from kvroute.router.routing.decode_choice import DecodeChoice, choose_decode
from kvroute.router.routing.policy import LoadModel
from kvroute.sim.timing import DEFAULT_GPU
from tests.router.decode_workers import decoders

BLOCK = 16
# the mean context of a decoding sequence on the generator's default trace (dev seeds 0-2 of
# bench/results/2026-12-06-pd-routing: prompt plus the output so far, per decode step)
MEAN_DECODE_CONTEXT = 2064


def running(worker: Worker, n: int) -> None:
    for _ in range(n):
        LoadTicket(worker.load, 0)


def load_model() -> LoadModel:
    return LoadModel(PolicyConfig(), lambda: 1000.0, stale_after_s=5.0)


def marginal_step_s(batch: int, context: int) -> float:
    """What one more decoding sequence of `context` tokens adds to a step of `batch` others,
    in the simulator's step model (Llama-3.1-8B BF16 on one H100)."""
    before = DEFAULT_GPU.step_seconds(0, 0, batch, batch * context)
    return DEFAULT_GPU.step_seconds(0, 0, batch + 1, (batch + 1) * context) - before


def block_transfer_s(cfg: PdConfig) -> float:
    return BLOCK * cfg.kv_bytes_per_token / (cfg.link_gbps * 1e9 / 8)


def choose_between(running_d0: int, running_d1: int, held: dict[str, int]) -> DecodeChoice:
    """The decode choice for a 2,200-token prompt between d0 and d1, running that many
    sequences and holding `held` prompt tokens."""
    ws = decoders(2)
    running(ws[0], running_d0)
    running(ws[1], running_d1)
    return choose_decode(ws, held, 2200, load_model(), PdConfig(), 0.0)


def test_the_charge_is_what_one_more_sequence_costs_a_decode_step() -> None:
    cfg = PdConfig()
    assert cfg.kv_bytes_per_token == DEFAULT_GPU.kv_bytes_per_token
    # decode steps are memory bound at every batch a worker runs (vLLM's 256 at most), so the
    # cost of one more sequence does not depend on how many run already
    for batch in (1, 8, 64, 255):
        assert cfg.running_s == pytest.approx(marginal_step_s(batch, MEAN_DECODE_CONTEXT), rel=0.05)


def test_one_running_sequence_weighs_a_few_blocks_of_transfer_not_dozens() -> None:
    cfg = PdConfig()
    # at 400 Gb/s a 16-token block (2 MiB) takes 42 us; a running sequence of the trace's mean
    # context is worth about three of them (the old 2 ms was worth 48)
    assert block_transfer_s(cfg) == pytest.approx(41.9e-6, rel=0.01)
    assert 2 <= cfg.running_s / block_transfer_s(cfg) <= 4


def test_a_conversation_returns_to_the_decode_worker_holding_its_blocks() -> None:
    # the median trade the old charge lost (bench/results/2026-12-06-pd-routing, "Where
    # kvroute loses"): the holder has 480 more prompt tokens (30 blocks) and runs 2 more
    choice = choose_between(6, 4, {"d0": 1800, "d1": 1320})
    assert choice.chosen is not None and choice.chosen.name == "d0"
    by = {c.name: c for c in choice.candidates}
    saving = by["d1"].terms["transfer"] - by["d0"].terms["transfer"]
    extra_load = by["d0"].terms["decode_load"] - by["d1"].terms["decode_load"]
    assert saving == pytest.approx(480 * 131072 / 5e10)
    assert extra_load < saving / 4  # the pull it saves is worth several times the load


def test_a_later_turn_returns_to_its_decode_worker_while_that_one_is_somewhat_busier() -> None:
    # a third turn: 1,500 of its 2,200 tokens on d0 from the earlier turns, only the shared
    # system prompt on d1; d0 runs 8 more sequences (twice d1's): still worth the 94 blocks
    choice = choose_between(16, 8, {"d0": 1800, "d1": 300})
    assert choice.chosen is not None and choice.chosen.name == "d0"


def test_a_much_busier_holder_still_loses() -> None:
    # 30 blocks saved are not worth 20 more sequences in every step of this one's decode
    choice = choose_between(24, 4, {"d0": 1800, "d1": 1320})
    assert choice.chosen is not None and choice.chosen.name == "d1"


def test_the_testbed_keeps_the_old_charge_as_a_variant(tmp_path: Path) -> None:
    """`kvroute-pd-running-2ms` (the A/B of bench/results/2026-12-06-pd-decode-choice) is the
    bench's kvroute with the earlier 2 ms charge and nothing else changed."""
    from tests.bench.test_bench_tools import _variant_configs

    loaded = _variant_configs(tmp_path, "kvroute", "kvroute-pd-running-2ms")
    new, old = loaded["kvroute"], loaded["kvroute-pd-running-2ms"]
    assert new.pd.running_s == PdConfig().running_s and old.pd.running_s == 0.002
    assert dataclasses.replace(old.pd, running_s=new.pd.running_s) == new.pd
    assert old.policy == new.policy
