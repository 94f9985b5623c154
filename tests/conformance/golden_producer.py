"""Record one vLLM release's own KV-event frames (started by record_frames.py, never by pytest).

Runs with the python of a throwaway venv that holds exactly one vLLM release (installed with
`--no-deps`), msgspec and pyzmq. vLLM's package `__init__` needs torch and most of vLLM's
dependency tree, so it is never executed: `vllm/distributed/kv_events.py` is loaded from the
installed release by file, with light stand-ins for the only vLLM modules it imports:

- `vllm.logger.init_logger` -> `logging.getLogger`;
- `vllm.config.KVEventsConfig` / `vllm.config.kv_events.KVEventsConfig` -> a dataclass with
  the same fields (only the publisher factory and `get_publisher_config` use it);
- `vllm.v1.core.kv_cache_utils.ExternalBlockHash` -> the type alias evaluated from that
  release's own `kv_cache_utils.py` source (it types the hash fields, so it must be exact);
- `vllm.utils.network_utils` -> the four helpers the publisher calls only for `tcp://*:0`,
  which is not used here.

The event structs, `KVEventBatch`, the msgpack encoding and `ZmqEventPublisher` (its thread,
PUB socket and replay ROUTER) are the release's own code. Frames are captured from a real SUB
socket on loopback TCP (vLLM connects to it, as in a fleet) and from a real DEALER asking the
replay socket. Each payload is also decoded with the release's own `KVEventBatch` type, and
those structs are saved next to the bytes.

    python golden_producer.py --out DIR/recording.json --command "..."
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import ipaddress
import json
import logging
import platform
import socket
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import zmq

STUBBED = (
    "vllm.logger",
    "vllm.config",
    "vllm.config.kv_events",
    "vllm.v1.core.kv_cache_utils",
    "vllm.utils.network_utils",
)
TOPIC = "kv@worker-1"
END_SEQ = b"\xff" * 8


@dataclasses.dataclass
class KVEventsConfig:
    """Stand-in for vLLM's config record (same field names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _module(name: str, root: Path | None = None, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    if root is not None:
        module.__path__ = [str(root)]  # a package whose __init__ never runs
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _external_block_hash(root: Path) -> Any:
    """The release's `ExternalBlockHash` alias, evaluated from its own source."""
    source = root / "v1" / "core" / "kv_cache_utils.py"
    if not source.exists():
        return int
    for node in ast.walk(ast.parse(source.read_text())):
        target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
        if isinstance(target, ast.Name) and target.id == "ExternalBlockHash":
            value = node.value  # type: ignore[attr-defined]
            return eval(compile(ast.Expression(value), str(source), "eval"), vars(typing))
    return int


def _split_zmq_path(path: str) -> tuple[str, str, str]:
    scheme, _, rest = path.partition("://")
    host, _, port = rest.rpartition(":")
    return scheme, host.strip("[]"), port


def _is_ipv6(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address)
    except ValueError:
        return False


def load_kv_events() -> types.ModuleType:
    """vLLM's `vllm.distributed.kv_events`, loaded with stand-ins (module docstring)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this environment")
    root = Path(next(iter(spec.submodule_search_locations)))
    _module("vllm", root)
    for package in ("config", "distributed", "utils", "v1", "v1/core"):
        _module("vllm." + package.replace("/", "."), root / package)
    _module("vllm.logger", init_logger=logging.getLogger)
    sys.modules["vllm.config"].KVEventsConfig = KVEventsConfig  # type: ignore[attr-defined]
    _module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=_external_block_hash(root))
    _module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: (
            f"tcp://[{ip}]:{port}" if _is_ipv6(ip) else f"tcp://{ip}:{port}"
        ),
        is_valid_ipv6_address=_is_ipv6,
        split_zmq_path=_split_zmq_path,
    )
    path = root / "distributed" / "kv_events.py"
    module_spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    module.SOURCE_SHA256 = hashlib.sha256(path.read_bytes()).hexdigest()  # type: ignore[attr-defined]
    return module


# ---------------------------------------------------------------------------------------------
# The batches: what vLLM's cache manager and offloading connectors publish, in every field the
# release has. Fields a release does not have are left out (its structs would refuse them).
# ---------------------------------------------------------------------------------------------

TOKENS = list(range(1000, 1064))
H32 = [hashlib.sha256(bytes([i])).digest() for i in range(8)]


class Builder:
    """Builds the release's own event structs from the fields it has."""

    def __init__(self, kv: types.ModuleType) -> None:
        self.kv = kv
        self.stored_fields = kv.BlockStored.__struct_fields__
        self.removed_fields = kv.BlockRemoved.__struct_fields__
        hash_type = typing.get_type_hints(kv.BlockStored)["parent_block_hash"]
        self.bytes_hashes = bytes in typing.get_args(hash_type)

    def has(self, *fields: str) -> bool:
        return all(f in self.stored_fields for f in fields)

    def stored(
        self, hashes: list[Any], parent: Any, tokens: list[int], size: int, **more: Any
    ) -> Any:
        fields = dict(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        fields.update(more)
        return self.kv.BlockStored(**{k: v for k, v in fields.items() if k in self.stored_fields})

    def removed(self, hashes: list[Any], **more: Any) -> Any:
        fields = {"block_hashes": hashes, "medium": "GPU", **more}
        return self.kv.BlockRemoved(**{k: v for k, v in fields.items() if k in self.removed_fields})

    def full(self, group: int = 0) -> dict[str, Any]:
        return {"group_idx": group, "kv_cache_spec_kind": "full_attention"}


def scenarios(b: Builder) -> list[tuple[str, list[Any], int | None]]:
    """(name, events, data_parallel_rank set by the caller or None), in publishing order."""
    h = H32 if b.bytes_hashes else [(1 << 64) - 1 - i * 7919 for i in range(8)]
    out: list[tuple[str, list[Any], int | None]] = [
        ("store_from_token_0", [b.stored([h[0], h[1]], None, TOKENS[:32], 16, **b.full())], None),
        ("store_chained", [b.stored([h[2]], h[1], TOKENS[32:48], 16, **b.full())], None),
        (
            "store_int_hashes_edge_values",
            [b.stored([0, (1 << 64) - 1, -3], None, TOKENS[:48], 16, **b.full())],
            None,
        ),
        (
            "remove_one_hash_each",
            [b.removed([h[2]], group_idx=0), b.removed([h[1]], group_idx=0)],
            None,
        ),
        ("clear", [b.kv.AllBlocksCleared()], None),
        ("dp_rank_set_by_engine", [b.stored([h[3]], None, TOKENS[:16], 16, **b.full())], 3),
        (
            "lora",
            [
                b.stored(
                    [h[4], h[5]],
                    None,
                    TOKENS[:32],
                    16,
                    lora_id=7,
                    lora_name="adapter-a",
                    extra_keys=[("adapter-a",), ("adapter-a",)],
                    **b.full(),
                )
            ],
            None,
        ),
        ("lora_id_only", [b.stored([h[6]], None, TOKENS[:16], 16, lora_id=7)], None),
    ]
    if b.has("extra_keys"):
        out += [
            (
                "cache_salt",
                [
                    b.stored(
                        [h[0], h[1]],
                        None,
                        TOKENS[:32],
                        16,
                        extra_keys=[("salt-xyz",), None],
                        **b.full(),
                    )
                ],
                None,
            ),
            (
                "lora_and_salt",
                [
                    b.stored(
                        [h[2], h[3]],
                        None,
                        TOKENS[:32],
                        16,
                        lora_id=7,
                        lora_name="adapter-a",
                        extra_keys=[("adapter-a", "salt-xyz"), ("adapter-a",)],
                        **b.full(),
                    )
                ],
                None,
            ),
            (
                "multimodal_key_on_second_block",
                [
                    b.stored(
                        [h[4], h[5]],
                        None,
                        TOKENS[:32],
                        16,
                        extra_keys=[None, (("img-0", 0),)],
                        **b.full(),
                    )
                ],
                None,
            ),
        ]
    if b.has("group_idx"):
        out.append(
            (
                "multi_group",
                [
                    b.removed([h[7]], group_idx=2),
                    b.stored([h[0], h[1], h[2], h[3]], None, TOKENS, 16, **b.full(0)),
                    b.stored(
                        [h[4], h[5]],
                        h[6],
                        TOKENS[32:],
                        16,
                        group_idx=1,
                        kv_cache_spec_kind="sliding_window",
                        kv_cache_spec_sliding_window=32,
                    ),
                    b.stored([h[7]], None, TOKENS, 64, group_idx=2, kv_cache_spec_kind="mamba"),
                    b.removed([h[3]], group_idx=0),
                    b.removed([h[5]], group_idx=1),
                ],
                None,
            )
        )
    if b.has("medium"):
        offloaded = {"medium": "CPU", "locality": "REMOTE", "ownership": "tier-2"}
        out.append(
            (
                "offloaded",
                [
                    b.stored([h[0]], None, TOKENS[:16], 16, **offloaded, **b.full()),
                    b.removed([h[0]], **offloaded, group_idx=0),
                ],
                None,
            )
        )
    if b.has("locality"):
        out.append(
            ("local", [b.stored([h[1]], None, TOKENS[:16], 16, locality="LOCAL", **b.full())], None)
        )
    if b.has("session_id"):
        out.append(
            (
                "session",
                [b.stored([h[2]], None, TOKENS[:16], 16, session_id="chat-1", **b.full())],
                None,
            )
        )
    if b.has("lookahead_token_ids"):
        out.append(
            (
                "lookahead",
                [
                    b.stored(
                        [h[3], h[4]],
                        None,
                        TOKENS[:32],
                        16,
                        lookahead_token_ids=[[5, 6], [7, 8]],
                        **b.full(),
                    )
                ],
                None,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Capture through the release's ZmqEventPublisher
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def capture(
    kv: types.ModuleType, batches: list[Any]
) -> tuple[list[list[bytes]], dict[int, list[list[bytes]]]]:
    """Publish `batches` through vLLM's publisher; (live messages, replies per replay start)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    replay_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    publisher = kv.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=f"tcp://127.0.0.1:{port}",  # no wildcard: vLLM connects (fleet mode)
        replay_endpoint=replay_endpoint,
        topic=TOPIC,
    )
    try:
        # A bound SUB attaches vLLM's connection (and subscribes on it) only while polled.
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            sub.poll(10)
        live: list[list[bytes]] = []
        for batch in batches:
            publisher.publish(batch)
        deadline = time.monotonic() + 10
        while len(live) < len(batches) and time.monotonic() < deadline:
            if sub.poll(50):
                live.append(sub.recv_multipart())
        if len(live) != len(batches):
            raise SystemExit(f"captured {len(live)} of {len(batches)} live messages")
        replies = {start: _replay(ctx, replay_endpoint, start) for start in (2, len(batches))}
    finally:
        publisher.shutdown()
        sub.close(linger=0)
    return live, replies


def _replay(ctx: zmq.Context[Any], endpoint: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if dealer.poll(100):
                replies.append(dealer.recv_multipart())
                if replies[-1][-2] == END_SEQ:
                    return replies
        raise SystemExit(f"replay from {start} did not end")
    finally:
        dealer.close(linger=0)


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """A decoded vLLM value as JSON: bytes -> {"hex": ...}, tuples -> lists."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def as_vllm_saw_it(kv: types.ModuleType, payload: bytes) -> dict[str, Any]:
    """The payload decoded with the release's own `KVEventBatch`, every field by name."""
    batch = msgspec.msgpack.decode(payload, type=kv.KVEventBatch)
    events = [
        {"type": type(ev).__name__, **{f: plain(getattr(ev, f)) for f in ev.__struct_fields__}}
        for ev in batch.events
    ]
    return {"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events}


def to_json(recording: dict[str, Any]) -> str:
    """JSON with one line per top-level key and per message (readable diffs, small files)."""
    lines = []
    for key, value in recording.items():
        if key in ("live", "replay"):
            items = ",\n  ".join(json.dumps(item) for item in value)
            lines.append(f"{json.dumps(key)}: [\n  {items}\n ]")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", required=True, help="the command that recorded it")
    args = parser.parse_args()
    kv = load_kv_events()
    builder = Builder(kv)
    plan = scenarios(builder)
    batches = []
    for index, (_name, events, rank) in enumerate(plan):
        batches.append(
            kv.KVEventBatch(ts=1_700_000_000.25 + index, events=events, data_parallel_rank=rank)
        )
    live, replies = capture(kv, batches)
    encoder = msgspec.msgpack.Encoder()
    messages = []
    for (name, _events, _rank), batch, frames in zip(plan, batches, live, strict=True):
        # The publisher filled in its rank where the engine left it unset; then encoded.
        if frames[2] != encoder.encode(batch):
            raise SystemExit(f"{name}: live payload differs from the release's own encoding")
        messages.append(
            {
                "name": name,
                "frames": [f.hex() for f in frames],
                "batch": as_vllm_saw_it(kv, frames[2]),
            }
        )
    event_base = kv.BlockStored.__mro__[1]
    recording = {
        "vllm_version": importlib.metadata.version("vllm"),
        "command": args.command,
        "kv_events_sha256": kv.SOURCE_SHA256,
        "loaded_with_stand_ins_for": list(STUBBED),
        "python": platform.python_version(),
        "msgspec": importlib.metadata.version("msgspec"),
        "pyzmq": importlib.metadata.version("pyzmq"),
        "struct_fields": {
            "BlockStored": list(kv.BlockStored.__struct_fields__),
            "BlockRemoved": list(kv.BlockRemoved.__struct_fields__),
            "events_array_like": bool(event_base.__struct_config__.array_like),
            "batch_array_like": bool(kv.KVEventBatch.__struct_config__.array_like),
            "bytes_hashes": builder.bytes_hashes,
        },
        "topic": TOPIC,
        "live": messages,
        "replay": [
            {"start_seq": start, "frames": [[f.hex() for f in reply] for reply in frames]}
            for start, frames in replies.items()
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(to_json(recording))
    print(
        f"vLLM {recording['vllm_version']}: {len(messages)} live messages, "
        f"{sum(len(r) for r in replies.values())} replay replies -> {args.out}"
    )


if __name__ == "__main__":
    main()
