"""Run vLLM 0.33's own P/D code on the simulated engines' kv_transfer_params.

Usage (inside .venv-vllm): python tests/sim/pd_vllm_runner.py < case.json
The case holds the sim producer's answers (completion and chat), the decode request the sim
consumer took, the prompt length and the consumer's local hit. Prints one JSON line:
  producer_params: what vLLM's NixlPullConnectorScheduler.request_finished answers for a
    finished prefill (as JSON), with the key vLLM's scheduler adds to it;
  matched: vLLM's consumer-side get_num_new_matched_tokens on the sim's params;
  accepted: whether vLLM's update_state_after_alloc takes the sim's params as a valid pull;
  models: the sim's answers and the decode request parsed by vLLM's OpenAI models.
Only the scheduler-side methods run; their connector object is a stand-in with the attributes
they read (no NIXL agent, no GPU).
"""

from __future__ import annotations

import inspect
import json
import sys
import types
from types import SimpleNamespace
from typing import Any

# vLLM's import chain reaches a vision module that imports einops at load time; nothing here
# calls it, and the CPU test environment does not install it.
sys.modules.setdefault("einops", types.ModuleType("einops"))

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (  # noqa: E402
    NixlPullConnectorScheduler,
)
from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from vllm.entrypoints.openai.completion.protocol import (  # noqa: E402
    CompletionRequest,
    CompletionResponse,
)
from vllm.v1.core.sched import scheduler as vllm_scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402


def _connector(engine_id: str, host: str, port: int) -> Any:
    parallel = SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1)
    return SimpleNamespace(
        _stop_heartbeat=lambda _rid: None,
        is_bidirectional_kv_xfer_enabled=False,
        use_host_buffer=False,
        kv_recompute_threshold=0,
        _reqs_not_processed=set(),
        _reqs_need_save={},
        _reqs_need_send={},
        _reqs_need_recv={},
        _reqs_in_batch=set(),
        _kv_lease_duration=30,
        decoder_kv_blocks_ttl=480,
        get_exchange_clipped_blocks=lambda blocks: blocks,
        _get_remote_prefill_token_count=lambda n: n,
        engine_id=engine_id,
        side_channel_host=host,
        side_channel_port=port,
        transfer_tp_size=1,
        vllm_config=SimpleNamespace(parallel_config=parallel),
        _registration_generation=0,
        _TRANSFER_MODE="pull",
    )


def main() -> int:
    case = json.load(sys.stdin)
    sim = case["producer_answer"]["kv_transfer_params"]
    n = case["prompt_len"]
    # the producer side: vLLM's answer for a finished prefill of the same prompt
    conn = _connector(sim["remote_engine_id"], sim["remote_host"], sim["remote_port"])
    request = SimpleNamespace(
        request_id=sim["remote_request_id"],
        kv_transfer_params={"do_remote_decode": True},
        status=RequestStatus.FINISHED_LENGTH_CAPPED,
        num_computed_tokens=n,
    )
    block_ids = tuple(list(group) for group in sim["remote_block_ids"])
    delay, params = NixlPullConnectorScheduler.request_finished(conn, request, block_ids)
    produced: dict[str, Any] = json.loads(json.dumps(params))
    # vLLM's scheduler adds the prefill's own cache hit when it frees such a request
    source = inspect.getsource(vllm_scheduler)
    if 'kv_transfer_params["remote_prefill_cached_tokens"]' in source:
        produced["remote_prefill_cached_tokens"] = sim["remote_prefill_cached_tokens"]

    # the consumer side, on the sim's params
    decode_params = dict(sim)
    consumer = _connector("consumer", "127.0.0.1", 1)
    d_request = SimpleNamespace(
        request_id="decode-1",
        kv_transfer_params=decode_params,
        prompt_token_ids=list(range(n)),
        num_prompt_tokens=n,
    )
    hit = case["consumer_local_hit"]
    matched = NixlPullConnectorScheduler.get_num_new_matched_tokens(consumer, d_request, hit)
    blocks = SimpleNamespace(
        get_unhashed_block_ids_all_groups=lambda: ([1, 2, 3],),
        blocks=([],),
    )
    NixlPullConnectorScheduler.update_state_after_alloc(consumer, d_request, blocks, matched[0])
    accepted = "decode-1" in consumer._reqs_need_recv

    CompletionResponse.model_validate(case["producer_answer"])
    ChatCompletionResponse.model_validate(case["producer_chat_answer"])
    parsed = CompletionRequest.model_validate(case["decode_request"])
    chat = ChatCompletionRequest.model_validate(case["decode_chat_request"])
    models = (
        parsed.kv_transfer_params == case["decode_request"]["kv_transfer_params"]
        and chat.kv_transfer_params == case["decode_chat_request"]["kv_transfer_params"]
    )
    out = {
        "delay_free": delay,
        "producer_params": produced,
        "matched": list(matched),
        "accepted": accepted,
        "models": models,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
