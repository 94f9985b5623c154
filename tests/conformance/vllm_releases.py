"""Every vLLM release from 0.10.0 to 0.34.0 and its KV-event wire layout.

Read from `vllm/distributed/kv_events.py` in each release's PyPI wheel (the sha256 prefix of
that file is listed per release; releases with the same prefix ship the same file). A layout
changes when the event structs change (fields, array or map encoding, hash type) or when the
publisher's replay frames change; publisher changes that leave the frames alone are noted in
`about`. Used by the recorder (record_frames.py), by the golden-frame test and by
docs/vllm-support.md.

Stdlib only: golden_producer.py runs next to it inside a throwaway vLLM venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_STORED_0_10 = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


@dataclass(frozen=True)
class Layout:
    """One wire layout: how the events of every release in `releases` look on the wire."""

    name: str
    events: Literal["array", "map"]
    stored: tuple[str, ...]  # BlockStored fields in declaration (= wire) order
    removed: tuple[str, ...]  # BlockRemoved fields
    bytes_hashes: bool  # hash fields typed `bytes | int` (ExternalBlockHash), else int only
    replay: Literal["pre-0.26", "0.26"]  # replay reply frames (kvroute.bridge.vllm_schema)
    about: str


def _layouts() -> list[Layout]:
    stored = _STORED_0_10
    removed: tuple[str, ...] = ("block_hashes",)
    steps: list[tuple[str, str, tuple[str, ...], tuple[str, ...], str]] = [
        # (name, events, added to BlockStored, added to BlockRemoved, about)
        ("arrays-0.10", "array", (), (), "tagged arrays; int hashes only"),
        ("arrays-medium", "array", ("medium",), ("medium",), "`medium`; bytes or int hashes"),
        ("arrays-lora-name", "array", ("lora_name",), (), "`lora_name`"),
        ("arrays-extra-keys", "array", ("extra_keys",), (), "`extra_keys`"),
        ("arrays-group", "array", ("group_idx",), ("group_idx",), "`group_idx`"),
        (
            "arrays-spec-kind",
            "array",
            ("kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
            (),
            "`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`; last array layout",
        ),
        ("maps", "map", (), (), "events become maps with a `type` key; the batch stays an array"),
        (
            "maps-locality",
            "map",
            ("locality",),
            ("locality",),
            "`locality`; replay replies gain the topic frame",
        ),
        ("maps-ownership", "map", ("ownership",), ("ownership",), "`ownership`"),
        ("maps-session", "map", ("session_id",), (), "`session_id`"),
        ("maps-lookahead", "map", ("lookahead_token_ids",), (), "`lookahead_token_ids`"),
    ]
    layouts = []
    replay: Literal["pre-0.26", "0.26"] = "pre-0.26"
    for name, events, more_stored, more_removed, about in steps:
        stored += more_stored
        removed += more_removed
        if name == "maps-locality":
            replay = "0.26"  # and every later layout
        layouts.append(
            Layout(
                name=name,
                events=events,  # type: ignore[arg-type]
                stored=stored,
                removed=removed,
                bytes_hashes=name != "arrays-0.10",
                replay=replay,
                about=about,
            )
        )
    return layouts


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in _layouts()}

#: release -> (layout, sha256 prefix of its vllm/distributed/kv_events.py, publisher notes)
RELEASES: dict[str, tuple[str, str, str]] = {
    "0.10.0": ("arrays-0.10", "dc0f92c472de", ""),
    "0.10.1": ("arrays-0.10", "dc0f92c472de", ""),
    "0.10.1.1": ("arrays-0.10", "dc0f92c472de", ""),
    "0.10.2": ("arrays-medium", "232ccb502d7c", ""),
    "0.11.0": ("arrays-medium", "232ccb502d7c", ""),
    "0.11.1": ("arrays-medium", "df3fcd5ec690", "factory: null publisher when events are off"),
    "0.11.2": ("arrays-medium", "df3fcd5ec690", ""),
    "0.12.0": ("arrays-medium", "df3fcd5ec690", ""),
    "0.13.0": ("arrays-medium", "9aae4171360a", "events hashable; KVEventAggregator"),
    "0.14.0": ("arrays-lora-name", "ddb9a501b2d9", ""),
    "0.14.1": ("arrays-lora-name", "ddb9a501b2d9", ""),
    "0.15.0": ("arrays-lora-name", "ddb9a501b2d9", ""),
    "0.15.1": ("arrays-lora-name", "ddb9a501b2d9", ""),
    "0.16.0": ("arrays-lora-name", "ddb9a501b2d9", ""),
    "0.17.0": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.17.1": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.18.0": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.18.1": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.19.0": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.19.1": ("arrays-extra-keys", "7f6d86d9aa36", ""),
    "0.20.0": ("arrays-group", "861f330c3d25", ""),
    "0.20.1": ("arrays-group", "861f330c3d25", ""),
    "0.20.2": ("arrays-group", "861f330c3d25", ""),
    "0.21.0": ("arrays-group", "861f330c3d25", ""),
    "0.22.0": ("arrays-spec-kind", "84dce79a7690", ""),
    "0.22.1": ("arrays-spec-kind", "84dce79a7690", ""),
    "0.23.0": ("arrays-spec-kind", "24841685ad6d", "docstrings only"),
    "0.24.0": ("maps", "f566d4756ab5", ""),
    "0.25.0": ("maps", "f566d4756ab5", ""),
    "0.25.1": ("maps", "f566d4756ab5", ""),
    "0.26.0": ("maps-locality", "ff56f46a266f", ""),
    "0.27.0": ("maps-locality", "1b3d156c647d", "get_publisher_config()"),
    "0.27.1": ("maps-locality", "1b3d156c647d", ""),
    "0.28.0": ("maps-locality", "1b3d156c647d", ""),
    "0.29.0": ("maps-ownership", "b1b0e9929279", ""),
    "0.30.0": ("maps-session", "de08f01e8736", ""),
    "0.31.0": ("maps-session", "fc73fe6a4b52", "tcp://*:0 binds the node IP"),
    "0.32.0": ("maps-session", "fc73fe6a4b52", ""),
    "0.33.0": ("maps-lookahead", "82b362a0a7f8", "replay send HWM 2 x (buffer_steps + 1)"),
    "0.34.0": ("maps-lookahead", "82b362a0a7f8", ""),
}

#: Releases that cannot be recorded here, and why. Their layout is checked only by frames
#: written from the spec (tests/bridge/test_bridge_schema.py), and the support table says so.
UNVERIFIED: dict[str, str] = {}


def layout_of(version: str) -> Layout:
    """The layout of a listed release ("0.26.0"); KeyError for any other."""
    return LAYOUTS[RELEASES[version][0]]


def support_table(recorded: set[str], unverified: dict[str, str] = UNVERIFIED) -> str:
    """The Markdown table of docs/vllm-support.md: per release, its layout and where its
    checked frames come from (recorded from vLLM, or written from the spec and why)."""
    rows = [
        "| vLLM | layout | what changed in kv_events.py | kv_events.py sha256 | frames |",
        "|---|---|---|---|---|",
    ]
    previous_layout, previous_sha, previous_version = "", "", ""
    for version, (layout_name, sha, note) in RELEASES.items():
        layout = LAYOUTS[layout_name]
        if sha == previous_sha:
            changed = f"same file as {previous_version}"
        else:
            previous_version = version
            new_layout = layout.about if layout_name != previous_layout else ""
            changed = "; ".join(p for p in (new_layout, note) if p) or "nothing on the wire"
        previous_layout, previous_sha = layout_name, sha
        if version in recorded:
            frames = f"recorded from vLLM {version}"
        else:
            frames = f"written from the spec: {unverified.get(version, 'not recorded')}"
        rows.append(f"| {version} | {layout_name} | {changed} | `{sha}` | {frames} |")
    return "\n".join(rows) + "\n"
