"""The Helm chart, rendered and installed by real Helm, validated against Kubernetes schemas.

What runs: Helm v4 (the Go library from the PyPI package helm-sdkpy, unpacked by
`make helm-lib`, see helm_runner.py) lints the chart and installs it into a loopback
stand-in of the Kubernetes API (no cluster runs on this machine). Every object Helm sends
is validated with kubernetes-validate (the Kubernetes OpenAPI JSON schemas shipped in that
PyPI package, strict mode: unknown fields fail) for the oldest and newest Kubernetes the
chart supports. The ServiceMonitor is a CRD with no schema there; it is checked by hand
against the Service it must select. Then the parts are checked to fit each other: selectors,
RBAC, ports, the engine's KV-events flags and the bridge's, and the worker pod run through
the real discovery code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvroute.router.fleet.discovery import PodDefaults, parse_discovery_config, worker_from_pod

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvroute"
RUNNER = Path(__file__).with_name("helm_runner.py")
DEFAULT_LIB = ROOT / ".tools/helm-sdkpy/helm_sdkpy/_lib/linux-amd64/libhelm_sdkpy.so"
HELM_LIB = Path(os.environ.get("KVROUTE_HELM_LIB", DEFAULT_LIB))
KUBE_VERSIONS = ("1.25.0", "1.37.0")  # Chart.yaml kubeVersion >=1.25; newest schemas

if not HELM_LIB.exists():
    if os.environ.get("KVROUTE_REQUIRE_HELM") == "1":
        raise RuntimeError(f"Helm library missing at {HELM_LIB}: run `make helm-lib`")
    pytest.skip(
        f"Helm library not unpacked ({HELM_LIB}); `make helm-lib` installs it "
        "(`make test` does, and then this skip is an error)",
        allow_module_level=True,
    )


def run_helm(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(HELM_LIB), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@cache
def install(values: str = "{}", namespace: str = "ml") -> dict[str, Any]:
    return run_helm("install", str(CHART), namespace, values)


def objects(values: str = "{}") -> dict[tuple[str, str], dict[str, Any]]:
    result = install(values)
    assert result["ok"], result.get("error")
    return {(o["kind"], o["metadata"]["name"]): o for o in result["objects"]}


def by_kind(objs: dict[tuple[str, str], dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for (k, _), o in objs.items() if k == kind]


def strip_server_fields(obj: dict[str, Any]) -> dict[str, Any]:
    # The stand-in adds what an API server adds; validate what Helm sent.
    obj = json.loads(json.dumps(obj))
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        obj["metadata"].pop(key, None)
    return obj


ALL_ON = json.dumps({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}})
MINIMAL = json.dumps(
    {
        "autoscaling": {"enabled": False},
        "podDisruptionBudget": {"enabled": False},
        "worker": {"enabled": False},
        "discovery": {"enabled": False},
        "serviceAccount": {"create": False},
    }
)


def test_helm_lint_passes() -> None:
    result = run_helm("lint", str(CHART))
    assert result["ok"], result
    assert result["helm"].startswith("helm-sdkpy-v")
    # Only INFO-level messages (severity 1: e.g. "icon is recommended").
    assert all(m["Severity"] <= 1 for m in result["Messages"]), result["Messages"]


def test_helm_lint_catches_a_broken_template(tmp_path: Path) -> None:
    """Negative control: the lint really renders the templates."""
    broken = tmp_path / "kvroute"
    subprocess.run(["cp", "-r", str(CHART), str(broken)], check=True)
    (broken / "templates" / "broken.yaml").write_text("kind: ConfigMap\nmetadata: [\n")
    result = run_helm("lint", str(broken))
    assert not result["ok"]
    assert any(
        m["Path"] == "templates/broken.yaml" and m["Severity"] == 3 for m in result["Messages"]
    )


@pytest.mark.parametrize("values", ["{}", ALL_ON, MINIMAL], ids=["default", "all-on", "minimal"])
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_every_object_validates_against_kubernetes_schemas(values: str, kube: str) -> None:
    objs = objects(values)
    assert objs
    for (kind, name), obj in objs.items():
        if kind == "ServiceMonitor":
            continue  # CRD: no schema in kubernetes-validate; see test_service_monitor
        try:
            kubernetes_validate.validate(strip_server_fields(obj), kube, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind}/{name} invalid for Kubernetes {kube}: {err.message}")


def test_schema_validation_is_not_vacuous() -> None:
    """Negative control: a wrong field type and an unknown field are rejected."""
    deploy = strip_server_fields(objects()[("Deployment", "kv-kvroute-router")])
    deploy["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, KUBE_VERSIONS[-1], strict=True)
    svc = strip_server_fields(objects()[("Service", "kv-kvroute")])
    svc["spec"]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, KUBE_VERSIONS[-1], strict=True)


def test_default_install_has_the_production_pieces() -> None:
    kinds = sorted(k for k, _ in objects())
    assert kinds == sorted(
        [
            "ConfigMap",
            "Deployment",
            "Deployment",
            "HorizontalPodAutoscaler",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
        ]
    )
    minimal = sorted(k for k, _ in objects(MINIMAL))
    assert minimal == ["ConfigMap", "Deployment", "Service"]
    assert objects(MINIMAL)[("Deployment", "kv-kvroute-router")]["spec"]["replicas"] == 3


def test_values_schema_rejects_bad_values() -> None:
    for bad in (
        {"router": {"replicas": "three"}},
        {"routr": {}},
        {"worker": {"kvEvents": {"endpoint": "ipc:///x"}}},
        {"router": {"config": {"port": 9}}},  # the chart owns host/port/discovery
    ):
        result = install(json.dumps(bad))
        assert not result["ok"] and "schema" in result["error"], (bad, result)


def test_router_pieces_fit_together() -> None:
    objs = objects(ALL_ON)
    deploy = objs[("Deployment", "kv-kvroute-router")]
    pod = deploy["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "replicas" not in deploy["spec"]  # the HPA owns it
    svc = objs[("Service", "kv-kvroute")]
    assert svc["spec"]["selector"].items() <= labels.items()
    for kind in ("PodDisruptionBudget",):
        sel = objs[(kind, "kv-kvroute-router")]["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items()
    hpa = objs[("HorizontalPodAutoscaler", "kv-kvroute-router")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "kv-kvroute-router",
    }
    assert hpa["minReplicas"] >= 2

    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["ports"][0]["containerPort"] == 8000

    # Config: mounted where the args point, and its discovery section is one the
    # discovery code accepts, selecting exactly the worker pods.
    cm = objs[("ConfigMap", "kv-kvroute-router")]
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert container["args"] == ["--config", "/etc/kvroute/config.yaml"]
    assert {"name": "config", "mountPath": "/etc/kvroute", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert (config["host"], config["port"]) == ("0.0.0.0", 8000)
    kube = parse_discovery_config(config["discovery"]).kubernetes
    assert kube is not None and kube.namespace == "ml"
    worker_labels = objs[("Deployment", "kv-kvroute-worker")]["spec"]["template"]["metadata"][
        "labels"
    ]
    selector = dict(term.split("=") for term in kube.selector.split(","))
    assert selector.items() <= worker_labels.items()
    router_pod_labels = labels
    assert not selector.items() <= router_pod_labels.items()

    # RBAC: the router's service account may list and watch pods there, nothing more.
    sa = spec["serviceAccountName"]
    assert ("ServiceAccount", sa) in objs
    binding = objs[("RoleBinding", "kv-kvroute-discovery")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "ml"}]
    role = objs[("Role", binding["roleRef"]["name"])]
    assert role["metadata"]["namespace"] == kube.namespace
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_service_monitor() -> None:
    """CRD, so no published schema here: check the fields the Prometheus Operator needs."""
    objs = objects(ALL_ON)
    sm = objs[("ServiceMonitor", "kv-kvroute-router")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prom"
    svc = objs[("Service", "kv-kvroute")]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    port_names = {p["name"] for p in svc["spec"]["ports"]}
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    assert sm["spec"]["endpoints"][0]["port"] in port_names
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert ("ServiceMonitor", "kv-kvroute-router") not in objects()


def test_worker_engine_flags_bridge_sidecar_and_discovery_agree() -> None:
    objs = objects()
    worker = objs[("Deployment", "kv-kvroute-worker")]
    template = worker["spec"]["template"]
    vllm, bridge = template["spec"]["containers"]
    assert (vllm["name"], bridge["name"]) == ("vllm", "kv-bridge")

    args = vllm["args"]
    assert vllm["command"] == ["vllm", "serve"] and args[0] == "Qwen/Qwen3-8B"
    assert "--enable-prefix-caching" in args
    kv = json.loads(args[args.index("--kv-events-config") + 1])
    assert kv == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "topic": "kv",
        "buffer_steps": 10000,
    }
    b = bridge["args"]
    assert b[b.index("--engine") + 1] == "tcp://127.0.0.1:5557"
    assert b[b.index("--replay") + 1] == "tcp://127.0.0.1:5558"
    assert b[b.index("--topic") + 1] == kv["topic"]
    assert b[b.index("--listen") + 1] == "0.0.0.0:50051"
    assert b[b.index("--http") + 1] == "0.0.0.0:9090"
    assert bridge["image"] == "kvroute:0.1.0-bridge"
    assert bridge["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "bridge-http"}
    assert bridge["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "bridge-http"}
    assert bridge["securityContext"]["runAsNonRoot"] is True

    # The worker pod, once running and ready, is what discovery turns into a worker:
    # run the real discovery code on the rendered pod.
    pod = {
        "metadata": {
            **template["metadata"],
            "name": "kv-kvroute-worker-abc",
            "namespace": "ml",
            "uid": "u1",
        },
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": "10.4.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    spec = worker_from_pod(pod, PodDefaults())
    assert spec is not None
    assert spec.url == f"http://10.4.0.7:{vllm['ports'][0]['containerPort']}"
    assert spec.bridge == f"10.4.0.7:{bridge['ports'][0]['containerPort']}"
    assert spec.model == args[args.index("--served-model-name") + 1]


def test_worker_values_flow_through() -> None:
    values = json.dumps(
        {
            "worker": {
                "model": "meta/llama",
                "servedModelName": "llama",
                "port": 8100,
                "kvEvents": {
                    "endpoint": "tcp://*:6000",
                    "replayEndpoint": "tcp://*:6001",
                    "topic": "t",
                },
                "bridge": {"grpcPort": 7000},
            }
        }
    )
    template = objects(values)[("Deployment", "kv-kvroute-worker")]["spec"]["template"]
    vllm, bridge = template["spec"]["containers"]
    kv = json.loads(vllm["args"][vllm["args"].index("--kv-events-config") + 1])
    assert (kv["endpoint"], kv["replay_endpoint"], kv["topic"]) == (
        "tcp://*:6000",
        "tcp://*:6001",
        "t",
    )
    assert bridge["args"][:4] == [
        "--engine",
        "tcp://127.0.0.1:6000",
        "--replay",
        "tcp://127.0.0.1:6001",
    ]
    ann = template["metadata"]["annotations"]
    assert ann == {
        "kvroute.io/engine-port": "8100",
        "kvroute.io/bridge-port": "7000",
        "kvroute.io/model": "llama",
    }
