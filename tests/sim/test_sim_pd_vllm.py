"""The simulated engines' P/D fields are the ones vLLM 0.33's NIXL connector produces and
accepts: vLLM's own scheduler-side code runs on them in vLLM's environment (pd_vllm_runner.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_env import vllm_python

from kvroute.sim.engine.core import EngineConfig
from kvroute.sim.engine.kv_transfer import TransferConfig
from kvroute.sim.server import SimEngineThread

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PROMPT = "A prefill engine answers with the blocks that hold the prompt. " * 6
CHAT = [{"role": "user", "content": PROMPT}]


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(url + path, json=body, timeout=20)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


@pytest.mark.vllm
def test_sim_pd_fields_match_vllm_nixl_connector() -> None:
    python = vllm_python()
    cfg = EngineConfig(
        speed=50, num_blocks=256, max_model_len=2048, kv_transfer=TransferConfig("kv_both")
    )
    with SimEngineThread(cfg) as engine:
        prefill = {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        answer = _post(engine.url, "/v1/completions", {"prompt": PROMPT, **prefill})
        chat_answer = _post(engine.url, "/v1/chat/completions", {"messages": CHAT, **prefill})
        n = answer["usage"]["prompt_tokens"]
        sim_params = answer["kv_transfer_params"]
        case = {
            "producer_answer": answer,
            "producer_chat_answer": chat_answer,
            "prompt_len": n,
            "consumer_local_hit": 32,
            "decode_request": {"prompt": PROMPT, "kv_transfer_params": sim_params},
            "decode_chat_request": {
                "messages": CHAT,
                "kv_transfer_params": chat_answer["kv_transfer_params"],
            },
        }
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{HERE}"}
    proc = subprocess.run(
        [python, str(HERE / "pd_vllm_runner.py")],
        input=json.dumps(case),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1])
    vllm_params = got["producer_params"]
    # every field vLLM's producer sends, with the same JSON types, and nothing else
    assert set(sim_params) == set(vllm_params)
    assert {k: type(v).__name__ for k, v in sim_params.items()} == {
        k: type(v).__name__ for k, v in vllm_params.items()
    }
    # the values that do not name the engine or request are vLLM's for the same prefill
    for key in ("do_remote_prefill", "do_remote_decode", "remote_num_tokens", "tp_size",
                "dcp_size", "pp_size", "transfer_mode", "remote_blocks_expiry_time",
                "remote_block_ids", "remote_prefill_cached_tokens"):  # fmt: skip
        assert sim_params[key] == vllm_params[key], key
    assert got["delay_free"] is True  # vLLM keeps these blocks for the decode peer too
    # vLLM's consumer takes the sim's params: pulls the tokens beyond its own hit, async
    assert got["matched"] == [n - 32, True]
    assert got["accepted"] is True
    assert got["models"] is True
