"""Child processes that die with the process that started them, armed in the child.

A launcher (`kvroute sim fleet`, the loopback harness of the tests and benchmarks) puts
`lifeline.env(sig)` into a `kvroute` child's environment; the child's first act (`arm()`, from
`kvroute.cli.main`) asks Linux to send it `sig` when its parent dies (PR_SET_PDEATHSIG).

Why not a `preexec_fn` in the launcher: a pre-exec hook makes `subprocess` fork() instead of
vfork(), and fork() runs gRPC's fork handlers; when the launcher's own gRPC threads are busy
(a test process talking to bridges), the child can crash before it reaches exec (seen as a
simulated engine exiting with SIGABRT/SIGSEGV at start). Arming in the child keeps the
launcher on the vfork path, which runs no handlers.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "KVROUTE_DIE_WITH_PARENT"
_PR_SET_PDEATHSIG = 1


def env(sig: signal.Signals = signal.SIGTERM) -> dict[str, str]:
    """Environment entries that make a `kvroute` child get `sig` when this process dies."""
    return {ENV: f"{os.getpid()}:{int(sig)}"}


def arm() -> None:
    """If the environment asks for it (see `env`), have Linux signal this process when its
    parent dies; exit at once if that parent is already gone. The entry is removed from the
    environment first, so this process's own children are not armed against the wrong parent.
    Does nothing without the entry, on other systems, or with a malformed entry."""
    value = os.environ.pop(ENV, None)
    if value is None or not sys.platform.startswith("linux"):
        return
    try:
        parent, sig = (int(part) for part in value.split(":"))
    except ValueError:
        return
    import ctypes  # only here: most processes never need it

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request above took effect
        raise SystemExit(f"kvroute: the process that started this one ({parent}) has exited")
