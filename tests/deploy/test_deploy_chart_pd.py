"""The chart's prefill/decode workers (worker.pd), with the example values file
deploy/helm/examples/prefill-decode.yaml: installed by real Helm, validated against the
Kubernetes schemas, run through the real discovery code, and the engines' command lines
parsed by vLLM 0.33's own `vllm serve` parser (in vLLM's environment)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvroute.router.config_load import config_from_dict
from kvroute.router.fleet.discovery import PodDefaults, worker_from_pod
from tests.deploy.test_deploy_chart import (
    KUBE_VERSIONS,
    ROOT,
    by_kind,
    install,
    objects,
    strip_server_fields,
)
from tests.sim.vllm_env import run_in_vllm

EXAMPLE = ROOT / "deploy" / "helm" / "examples" / "prefill-decode.yaml"
VALUES = json.dumps(yaml.safe_load(EXAMPLE.read_text()))
GROUPS = {"prefill": "kv_producer", "decode": "kv_consumer"}


def _workers(values: str = VALUES) -> dict[str, dict[str, Any]]:
    """The worker Deployments by name."""
    return {
        d["metadata"]["name"]: d
        for d in by_kind(objects(values), "Deployment")
        if d["metadata"]["name"].startswith("kv-kvroute-worker")
    }


def _vllm_args(deploy: dict[str, Any]) -> list[str]:
    vllm = deploy["spec"]["template"]["spec"]["containers"][0]
    assert vllm["name"] == "vllm" and vllm["command"] == ["vllm", "serve"]
    args: list[str] = vllm["args"]
    return args


def _running(template: dict[str, Any], name: str, ip: str) -> dict[str, Any]:
    """The pod a Deployment's template makes, running and ready."""
    return {
        "metadata": {**template["metadata"], "name": name, "namespace": "ml", "uid": name},
        "spec": template["spec"],
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_the_pd_example_installs_and_validates(kube: str) -> None:
    objs = objects(VALUES)
    for (kind, name), obj in objs.items():
        try:
            kubernetes_validate.validate(strip_server_fields(obj), kube, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{kind}/{name} invalid for Kubernetes {kube}: {err.message}")


def test_one_deployment_per_half_each_with_its_own_pods() -> None:
    workers = _workers()
    assert sorted(workers) == ["kv-kvroute-worker-decode", "kv-kvroute-worker-prefill"]
    selectors = []
    for role in GROUPS:
        deploy = workers[f"kv-kvroute-worker-{role}"]
        assert deploy["spec"]["replicas"] == 2
        sel = deploy["spec"]["selector"]["matchLabels"]
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items() and labels["kvroute.io/pd-role"] == role
        selectors.append(sel)
    # two Deployments must never select each other's pods
    prefill, decode = selectors
    assert not prefill.items() <= decode.items() and not decode.items() <= prefill.items()
    # without worker.pd: one Deployment of mixed workers, no P/D flags
    mixed = _workers("{}")
    assert list(mixed) == ["kv-kvroute-worker"]
    args = _vllm_args(mixed["kv-kvroute-worker"])
    assert "--kv-transfer-config" not in args
    assert "kvroute.io/pd-role" not in mixed["kv-kvroute-worker"]["spec"]["selector"]["matchLabels"]


def test_engines_get_their_kv_role_and_the_side_channel() -> None:
    for role, kv_role in GROUPS.items():
        deploy = _workers()[f"kv-kvroute-worker-{role}"]
        args = _vllm_args(deploy)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"kv_lease_duration": 30},
        }
        assert "--enable-prefix-caching" in args and "--kv-events-config" in args
        vllm = deploy["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in vllm["env"]}
        # the address a decode engine is told to reach the prefill engine at: the pod's IP
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "status.podIP"}
        }
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        assert {"name": "nixl-side", "containerPort": 5600, "protocol": "TCP"} in vllm["ports"]
    # a group's own flags come after the shared ones, on that group only
    prefill = _vllm_args(_workers()["kv-kvroute-worker-prefill"])
    assert prefill[-2:] == ["--max-num-batched-tokens", "16384"]
    assert "--max-num-batched-tokens" not in _vllm_args(_workers()["kv-kvroute-worker-decode"])


def test_discovery_reads_each_pod_as_its_half_of_the_model() -> None:
    objs = objects(VALUES)
    config = yaml.safe_load(objs[("ConfigMap", "kv-kvroute-router")]["data"]["config.yaml"])
    selector = dict(t.split("=") for t in config["discovery"]["kubernetes"]["selector"].split(","))
    for i, role in enumerate(GROUPS):
        template = _workers()[f"kv-kvroute-worker-{role}"]["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items()
        spec = worker_from_pod(_running(template, f"w-{role}", f"10.4.0.{i + 7}"), PodDefaults())
        assert spec is not None
        assert spec.role == role and spec.model == "qwen3-8b"
        assert spec.url == f"http://10.4.0.{i + 7}:8000"
    # the router config the chart renders is one the router accepts, with the P/D settings
    cfg = config_from_dict(config)
    assert (cfg.pd.kv_bytes_per_token, cfg.pd.link_gbps) == (147456, 400.0)


def test_workers_reach_each_other_only_with_pd() -> None:
    def peer_rules(values: str) -> list[dict[str, Any]]:
        """Ingress rules of the workers' NetworkPolicy that let worker pods in."""
        policy = objects(values)[("NetworkPolicy", "kv-kvroute-worker")]
        labels = policy["spec"]["podSelector"]["matchLabels"]
        return [
            rule
            for rule in policy["spec"]["ingress"]
            for peer in rule.get("from", [])
            if peer.get("podSelector", {}).get("matchLabels") == labels
        ]

    rules = peer_rules(VALUES)
    assert len(rules) == 1 and "ports" not in rules[0]  # any port: NIXL's backend picks them
    assert peer_rules("{}") == []  # mixed workers: only the routers reach them


def test_values_schema_rejects_a_wrong_kv_role() -> None:
    for bad in (
        {"worker": {"pd": {"enabled": True, "prefill": {"replicas": 1, "kvRole": "kv_consumer"}}}},
        {"worker": {"pd": {"decode": {"replicas": 1, "kvRole": "kv_producer"}}}},
        {"worker": {"pd": {"prefill": {"replicas": 0, "kvRole": "kv_producer"}}}},
        {"worker": {"pd": {"sideChannel": 5600}}},
    ):
        result = install(json.dumps(bad))
        assert not result["ok"] and "schema" in result["error"], (bad, result)


@pytest.mark.vllm
def test_vllm_takes_the_rendered_engine_command_lines() -> None:
    prefill = _vllm_args(_workers()["kv-kvroute-worker-prefill"])
    decode = _vllm_args(_workers()["kv-kvroute-worker-decode"])
    at = prefill.index("--kv-transfer-config") + 1
    wrong = [*prefill[:at], '{"kv_connector": "NixlConnector", "kv_role": "prefill"}']
    runner = Path(__file__).with_name("vllm_args_runner.py")
    p, d, bad = run_in_vllm([str(runner)], json.dumps([prefill, decode, wrong]))
    assert "error" not in p and "error" not in d, (p, d)
    assert (p["connector"], p["role"], p["producer"], p["consumer"]) == (
        "NixlConnector",
        "kv_producer",
        True,
        False,
    )
    assert (d["role"], d["producer"], d["consumer"]) == ("kv_consumer", False, True)
    for got in (p, d):
        assert got["registered"] and got["extra"] == {"kv_lease_duration": 30}
        assert got["prefix_caching"] is True and got["events_endpoint"] == "tcp://127.0.0.1:5557"
        assert got["served_model_name"] == ["qwen3-8b"]
    assert "kv_role" in bad["error"]  # negative control: vLLM's parser does check the role
