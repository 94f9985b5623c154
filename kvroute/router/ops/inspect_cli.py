"""`kvroute inspect`: ask a running router how it would route a prompt, as a table.

    kvroute inspect --router http://127.0.0.1:8000 --prompt "hello" [--model M] [--token T]
    kvroute inspect --router URL --messages conversation.json

`--messages` takes a JSON file holding a list of chat messages or a whole OpenAI request body.
The admin token comes from --token or --token-file, else from the variables the router itself
reads (`token_from_env`): KVROUTE_ADMIN__READ_TOKEN(_FILE), then KVROUTE_ADMIN__TOKEN(_FILE).
Scoring needs only the read-only token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvroute.router.config_load import env_name

# The router's own admin settings, least privilege first (scoring needs only read access).
_TOKEN_KEYS = ("admin.read_token", "admin.token")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="kvroute inspect", description="Show each worker's predicted reuse for a prompt."
    )
    p.add_argument("--router", required=True, help="router base URL, e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a user message (chat) or, with --completion, a prompt")
    src.add_argument("--messages", help="JSON file: a list of messages or an OpenAI body")
    p.add_argument("--completion", action="store_true", help="send --prompt as /v1/completions")
    p.add_argument("--model", help="model name (default: the router's only model)")
    p.add_argument("--user", help="session key (the OpenAI `user` field)")
    p.add_argument("--cache-salt", help="cache_salt of the request")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="admin bearer token (default: from the environment)")
    tok.add_argument("--token-file", help="file holding the admin bearer token")
    p.add_argument("--json", action="store_true", help="print the raw JSON answer")
    p.add_argument("--timeout", type=float, default=10.0)
    return p.parse_args(argv)


class InspectError(Exception):
    pass


def _call(url: str, token: str | None, body: Any | None, timeout: float) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            detail = json.loads(detail)["error"]["message"]
        raise InspectError(f"{url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise InspectError(f"{url}: {exc}") from None


def build_body(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(endpoint, body) for /admin/score."""
    if args.messages:
        try:
            with open(args.messages, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            raise InspectError(f"cannot read {args.messages}: {exc}") from None
        body = loaded if isinstance(loaded, dict) else {"messages": loaded}
        endpoint = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    elif args.completion:
        body, endpoint = {"prompt": args.prompt}, "/v1/completions"
    else:
        body = {"messages": [{"role": "user", "content": args.prompt}]}
        endpoint = "/v1/chat/completions"
    if args.model:
        body["model"] = args.model
    if args.user:
        body["user"] = args.user
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    return endpoint, body


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _groups(entry: dict[str, Any]) -> str:
    parts = []
    for g in entry.get("groups") or []:
        kind = g["kind"] or "?"
        if g.get("sliding_window"):
            kind += f"({g['sliding_window']})"
        parts.append(f"g{g['group_id']} {kind}/{g['block_size']}: {_fmt(g['accepted_tokens'])}")
    return "; ".join(parts)


def _cpu_tier(entry: dict[str, Any]) -> str:
    """The rate the worker's CPU-tier tokens are priced at, tokens/s, and where it comes from."""
    rate = entry.get("cpu_tier_tokens_per_s")
    if rate is None:
        return "-"
    learned = entry.get("cpu_tier_tokens_per_s_learned") is not None
    return f"{rate:.0f} {'learned' if learned else 'configured'}"


def render(answer: dict[str, Any]) -> str:
    """The /admin/score answer as a text table."""
    lines = [
        f"model {answer['model']}"
        + (f" (LoRA {answer['lora_name']})" if answer.get("lora_name") else "")
        + f"   prompt {answer['prompt_tokens']} tokens ({answer['token_source']})"
        + f"   policy {answer['policy']}",
        f"chosen: {answer['chosen'] or '-'}  [{answer['reason']}] {answer['detail']}",
    ]
    if answer.get("decode_chosen"):
        lines.append(f"decode: {answer['decode_chosen']}  (prefill on {answer['chosen']})")
    lines.append("")
    header = [
        "worker", "role", "status", "reuse", "fa_only", "uncached", "running", "queued", "kv",
        "est_ttft_s", "decode_cost_s", "pool", "working_set", "groups",
    ]  # fmt: skip
    # each worker's CPU-tier rate, only when the router learns them (else all are configured)
    cpu_tier = any(w.get("cpu_tier_tokens_per_s") is not None for w in answer["workers"])
    if cpu_tier:
        header.insert(-1, "cpu_tier_rate")
    rows = [header]
    for w in answer["workers"]:
        decode = w.get("decode")
        chosen = w.get("chosen") or (decode is not None and decode.get("chosen"))
        name = w["worker"] + (" *" if chosen else "")
        eligible = w["eligible"] or decode is not None
        rows.append(
            [
                name,
                w.get("role") or "both",
                w["status"] if eligible else f"{w['status']} (skip)",
                _fmt(w.get("predicted_reuse")),
                _fmt(w.get("full_attention_only_reuse")),
                _fmt(w.get("uncached_tokens")),
                _fmt(w.get("running")),
                _fmt(w.get("queued_prefill_tokens")),
                _fmt(w.get("kv_usage")),
                _fmt(w.get("est_ttft_s")),
                _fmt(decode.get("cost_s") if decode is not None else None),
                _fmt(w.get("pool_tokens")),
                _fmt(w.get("working_set_tokens")),
                *([_cpu_tier(w)] if cpu_tier else []),
                _groups(w),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        cells = [c.ljust(widths[i]) for i, c in enumerate(r[:-1])]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines)


def _read_file(path: str) -> str:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InspectError(f"cannot read token file {path}: {exc}") from None
    if not token:
        raise InspectError(f"token file {path} is empty")
    return token


def token_from_env(env: Mapping[str, str]) -> str | None:
    """The admin token from the same variables `kvroute serve` reads (config_load.env_name):
    the read-only token, then the full one, each given as a value or as a file."""
    for key in _TOKEN_KEYS:
        value = env.get(env_name(key))
        if value:
            return value
        path = env.get(env_name(key + "_file"))
        if path:
            return _read_file(path)
    return None


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    base = args.router.rstrip("/")
    try:
        token = args.token or (
            _read_file(args.token_file) if args.token_file else token_from_env(os.environ)
        )
        endpoint, body = build_body(args)
        answer = _call(f"{base}/admin/score?endpoint={endpoint}", token, body, args.timeout)
    except InspectError as exc:
        print(f"kvroute inspect: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2) if args.json else render(answer))
    return 0
