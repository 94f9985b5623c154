"""Record golden KV-event frames from real vLLM releases (by hand; needs PyPI; not in CI).

    python -m tests.conformance.record_frames                      # every listed release
    python -m tests.conformance.record_frames --versions 0.26.0 0.33.0

For each release it creates a throwaway venv, installs that vLLM with `--no-deps` (no torch,
no CUDA stack) plus msgspec and pyzmq at the versions the project pins, runs
golden_producer.py there (it loads vLLM's own kv_events module with light stand-ins for the
few vLLM modules it imports, see its docstring) and deletes the venv. The result is
tests/conformance/golden/<version>/recording.json: the live and replay frames as vLLM's
ZmqEventPublisher sent them, the structs vLLM decodes from them, the exact version and this
command. The releases and their layouts are listed in vllm_releases.py; test_golden_frames.py
checks kvroute's decoder and converter against every recording.

About 15 s per release (a ~400 MB wheel each; nothing is cached).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_releases import RELEASES, support_table  # noqa: E402

GOLDEN = HERE / "golden"
PRODUCER = HERE / "golden_producer.py"
# The same versions as the project's own environment (pyproject.toml), so that a difference
# in the recordings comes from vLLM, not from the encoder library.
SUPPORT_PACKAGES = ("msgspec==0.22.0", "pyzmq==27.3.0")


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(argv)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )


def record(version: str, python: str, out_dir: Path, keep: bool) -> Path:
    """Install `version` into a throwaway venv and record its frames; the recording's path."""
    venv = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-"))
    try:
        _run([python, "-m", "venv", str(venv)])
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-cache-dir"]
        # pip warns about the dependencies --no-deps leaves out; that is the point.
        _run([*pip, "--no-deps", "--no-compile", "--only-binary=:all:", f"vllm=={version}"])
        _run([*pip, *SUPPORT_PACKAGES])
        out = out_dir / version / "recording.json"
        command = f"python -m tests.conformance.record_frames --versions {version}"
        _run([str(venv / "bin" / "python"), str(PRODUCER), "--out", str(out), "--command", command])
        return out
    finally:
        if keep:
            print(f"kept {venv}", file=sys.stderr)
        else:
            shutil.rmtree(venv, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="Record golden frames from real vLLM releases.")
    parser.add_argument(
        "--versions", nargs="+", default=list(RELEASES), help="releases (default: all listed)"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="interpreter for the venvs (3.11, as vLLM needs)"
    )
    parser.add_argument("--out", type=Path, default=GOLDEN, help="golden directory")
    parser.add_argument("--keep", action="store_true", help="keep the venvs (for debugging)")
    parser.add_argument(
        "--print-table", action="store_true", help="print docs/vllm-support.md's table and exit"
    )
    args = parser.parse_args()
    if args.print_table:
        print(support_table({p.parent.name for p in args.out.glob("*/recording.json")}), end="")
        return 0
    unknown = [v for v in args.versions if v not in RELEASES]
    if unknown:
        parser.error(f"not in vllm_releases.RELEASES: {unknown}")
    failed: dict[str, str] = {}
    for version in args.versions:
        started = time.monotonic()
        try:
            path = record(version, args.python, args.out, args.keep)
        except RuntimeError as exc:
            failed[version] = str(exc)
            print(f"{version}: FAILED\n{exc}", file=sys.stderr)
            continue
        print(f"{version}: {path} ({time.monotonic() - started:.0f} s)")
    for version, reason in failed.items():
        print(f"not recorded: {version}: {reason.splitlines()[-1]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
