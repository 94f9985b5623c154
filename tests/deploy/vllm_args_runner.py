"""Parse engine command lines with vLLM 0.33's own `vllm serve` argument parser.

Usage (inside .venv-vllm): python tests/deploy/vllm_args_runner.py < cases.json
`cases.json` is a list of argument lists (`vllm serve` without its own name, model first).
Prints one JSON line: for each case either {"error": ...} or the KV-transfer settings vLLM
took from it (connector, role, producer/consumer, the connector's extra config), whether the
connector is one vLLM registers, and the flags the chart sets beside them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import types
from typing import Any

# The CPU-only environment: vLLM infers the KV buffer device from the platform.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# vLLM's import chain reaches a vision module that imports einops at load time; nothing here
# calls it, and the CPU test environment does not install it.
sys.modules.setdefault("einops", types.ModuleType("einops"))

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.common.cli_args import make_arg_parser  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


def parse(argv: list[str]) -> dict[str, Any]:
    parser = make_arg_parser(FlexibleArgumentParser())
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            ns = parser.parse_args(argv[1:])
        ns.model = argv[0]
        args = AsyncEngineArgs.from_cli_args(ns)
    except (Exception, SystemExit) as exc:  # argparse prints why and exits on a bad value
        return {"error": f"{type(exc).__name__}: {exc} {said.getvalue()[-500:]}"}
    kt = args.kv_transfer_config
    events = args.kv_events_config
    return {
        "connector": kt.kv_connector if kt else None,
        "role": kt.kv_role if kt else None,
        "producer": kt.is_kv_producer if kt else False,
        "consumer": kt.is_kv_consumer if kt else False,
        "extra": kt.kv_connector_extra_config if kt else None,
        "registered": bool(kt) and kt.kv_connector in KVConnectorFactory._registry,
        "prefix_caching": args.enable_prefix_caching,
        "events_endpoint": events.endpoint if events else None,
        "served_model_name": ns.served_model_name,
    }


def main() -> int:
    cases = json.load(sys.stdin)
    print(json.dumps([parse(argv) for argv in cases]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
