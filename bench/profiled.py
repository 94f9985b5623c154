"""Run a module under cProfile (its main thread); SIGUSR1 writes the profile so far.

    python -m bench.profiled --out router.prof kvroute serve --config c.yaml

The fleet-scale benchmark uses it (`--profile`) to show where a router's time goes while it
ingests events: kill -USR1 <pid>, then `python -m pstats router.prof`.
"""

from __future__ import annotations

import argparse
import cProfile
import runpy
import signal
import sys
from types import FrameType


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where SIGUSR1 writes the profile")
    ap.add_argument("module")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    profile = cProfile.Profile()

    def dump(_signum: int, _frame: FrameType | None) -> None:
        profile.disable()
        profile.dump_stats(args.out)
        profile.enable()

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = [args.module, *args.args]
    profile.enable()
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
