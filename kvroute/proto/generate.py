"""Generate (or check) the Python code for `kvroute/proto/events.proto`.

`python -m kvroute.proto.generate` rewrites `events_pb2.py`, `events_pb2.pyi` and
`events_pb2_grpc.py`;
`python -m kvroute.proto.generate --check` exits 1 when the committed files differ from what the
pinned grpcio-tools would generate, so stale generated code fails `make test`.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = (
    Path(__file__).resolve().parents[2]
)  # the repository: the .proto is imported as kvroute/proto/
GENERATED = ("events_pb2.py", "events_pb2.pyi", "events_pb2_grpc.py")


def _generate(out_dir: Path) -> None:
    import grpc_tools

    # protoc finds the mypy plugin on PATH; it lives beside this interpreter in a venv.
    bin_dir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(ROOT / "kvroute" / "proto" / "events.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _generate(Path(tmp))
        stale = []
        for name in GENERATED:
            fresh = Path(tmp) / "kvroute" / "proto" / name
            committed = ROOT / "kvroute" / "proto" / name
            if args.check:
                if not committed.exists() or not filecmp.cmp(fresh, committed, shallow=False):
                    stale.append(name)
            else:
                shutil.copyfile(fresh, committed)
    if stale:
        print(f"stale generated code: {', '.join(stale)}; run `python -m kvroute.proto.generate`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
