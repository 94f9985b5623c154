"""The vLLM recording shared by the conformance tests, and helpers to read it.

`tests/conformance/vllm_driver.py` runs in the vLLM environment (KVROUTE_VLLM_PYTHON, default
.venv-vllm/bin/python) and records, per scenario, vLLM's published frames and its native hits
for probe prompts. The recording is cached under .cache/conformance/, keyed by the driver's
and backend's source and the vLLM version, so only the first run pays for it.

Without the vLLM environment these tests skip, unless KVROUTE_REQUIRE_VLLM is set (as
`make test` does), in which case they fail.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from kvroute.bridge.convert import ConvertStats, convert_batch
from kvroute.bridge.vllm_schema import BatchDecoder
from kvroute.indexer import Namespace
from kvroute.proto.events_pb2 import KvEventBatch
from kvroute.proto.namespace import salt_namespace

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "conformance" / "vllm_driver.py"
BACKEND = REPO / "kvroute" / "sim" / "vllm_backend.py"
# Everything the recording depends on besides vLLM itself (its cache key).
DRIVER_SOURCES = (
    DRIVER,
    *(DRIVER.parent / f"vllm_{part}.py" for part in ("wire", "workloads", "scenarios")),
    BACKEND,
)
CACHE_DIR = REPO / ".cache" / "conformance"


def vllm_python() -> Path:
    configured = os.environ.get("KVROUTE_VLLM_PYTHON")
    return Path(configured) if configured else REPO / ".venv-vllm" / "bin" / "python"


def _unavailable(reason: str) -> None:
    if os.environ.get("KVROUTE_REQUIRE_VLLM"):
        pytest.fail(f"KVROUTE_REQUIRE_VLLM is set but {reason}", pytrace=False)
    pytest.skip(f"{reason} (run `make vllm-env`; KVROUTE_REQUIRE_VLLM=1 makes this an error)")


def _vllm_version(python: Path) -> str:
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        _unavailable(f"vLLM is not installed for {python}: {probe.stderr.strip()[-500:]}")
    return probe.stdout.strip()


def extra_seeds() -> int:
    """Reseeded copies of every random-workload scenario to record and test as well (0 by
    default; set KVROUTE_CONFORMANCE_EXTRA_SEEDS=N for a longer bug hunt)."""
    return int(os.environ.get("KVROUTE_CONFORMANCE_EXTRA_SEEDS", "0"))


def recording_path(version: str) -> Path:
    digest = hashlib.sha256(version.encode())
    for source in DRIVER_SOURCES:
        digest.update(source.read_bytes())
    suffix = f"-x{extra_seeds()}" if extra_seeds() else ""
    return CACHE_DIR / f"vllm-{version}-{digest.hexdigest()[:16]}{suffix}.msgpack"


def load_recording() -> dict[str, Any]:
    """The decoded recording: {"vllm_version", "scenarios": [...]} (see vllm_driver.py).

    Runs the driver when the cache has no recording for this driver and vLLM version.
    """
    python = vllm_python()
    if not python.exists():
        _unavailable(f"the vLLM python {python} does not exist")
    path = recording_path(_vllm_version(python))
    if not path.exists():
        run = subprocess.run(
            [str(python), str(DRIVER), "--out", str(path), "--extra-seeds", str(extra_seeds())],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=REPO,
        )
        if run.returncode != 0 or not path.exists():
            pytest.fail(
                f"the vLLM driver failed ({run.returncode}):\n{run.stderr[-4000:]}",
                pytrace=False,
            )
        sys.stderr.write(run.stderr[-3000:])
    data: dict[str, Any] = msgspec.msgpack.decode(path.read_bytes())
    return data


# The driver's scenarios, in its order (test_recording_covers_every_scenario checks it).
SCENARIOS = [
    "example_A",
    "example_B",
    "example_C",
    "example_D_r0",
    "example_D_dense",
    "dense_fa16",
    "hybrid16_r0",
    "hybrid16_dense",
    "hybrid16_r64_w48",
    "mamba64_partial_r0",
    "mamba64_partial_dense",
    "mixed32_mamba64",
    "two_windows_r0",
    "swa32blk_mixed",
    "equal64",
    "bytes_cbor_dp1_r32",
    "preempt_hybrid16",
    "long_hybrid_w512",
    "swa_only_dense",
    "mamba_swa_dense",
    "limit_nonprefix_lcm",
    "limit_pmu16_fa64",
    "limit_swa_only_r0",
    "limit_mamba_only",
    "limit_lora_path",
    "limit_prompt_logprobs",
    "limit_report_mode_full",
]


def at_each_probe(
    probes: list[dict[str, Any]],
    batches: Sequence[KvEventBatch],
    apply: Callable[[KvEventBatch], None],
    ask: Callable[[dict[str, Any]], T],
) -> list[T]:
    """`ask(probe)` for each probe once the batches before it (its "after") are applied."""
    applied = 0
    answers = []
    for probe in probes:
        while applied < probe["after"]:
            apply(batches[applied])
            applied += 1
        answers.append(ask(probe))
    return answers


def probe_namespace(probe: dict[str, Any]) -> Namespace:
    """The namespace a probe was sent in."""
    return Namespace(probe["lora_name"], salt_namespace(probe["cache_salt"] or ""))


def converted(sc: dict[str, Any], stats: ConvertStats | None = None) -> Iterator[KvEventBatch]:
    """The scenario's live frames through the bridge's decoder and converter, in order."""
    decoder = BatchDecoder()
    for _topic, seq_frame, payload in sc["frames"]:
        yield convert_batch(decoder.decode(payload), int.from_bytes(seq_frame, "big"), stats=stats)
    assert decoder.unknown_field_batches == 0, decoder.unknown_field_names


# The random-workload scenarios (not scripted examples) that are not limits: the driver
# reseeds them with --extra-seeds, in this order.
RESEEDED = [name for name in SCENARIOS if not name.startswith(("example_", "limit_"))]
SCENARIOS += [f"{name}~s{k}" for k in range(1, extra_seeds() + 1) for name in RESEEDED]

# The driver's fleets (several workers recorded together), in its order.
FLEETS = ["fleet_rolling_upgrade", "fleet_same_model"]
