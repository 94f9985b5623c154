"""`kvroute SUBCOMMAND ...`: one console command; each subcommand lives in its component.

Subcommand modules are imported only when chosen, so `kvroute bridge` never loads the HTTP
stack and `kvroute --help` is instant. Each module exposes `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

from kvroute import lifeline

# name -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bridge": ("kvroute.bridge.cli", "follow a vLLM engine's KV events and serve them over gRPC"),
    "serve": ("kvroute.router.cli", "run the cache-aware OpenAI router"),
    "inspect": (
        "kvroute.router.ops.inspect_cli",
        "show each worker's predicted reuse for a prompt",
    ),
    "sim": ("kvroute.sim.cli", "run a simulated vLLM engine, or a fleet of them (`sim fleet`)"),
    "demo": ("kvroute.demo.cli", "run the built-in demo: cache-aware routing against round robin"),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: kvroute SUBCOMMAND [options]", "", "subcommands:"]
    for name, (_, text) in SUBCOMMANDS.items():
        lines.append(f"  {name:<{width}}  {text}")
    lines.append("")
    lines.append("`kvroute SUBCOMMAND --help` shows a subcommand's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    lifeline.arm()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvroute: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    result: int = module.main(rest)
    return result
