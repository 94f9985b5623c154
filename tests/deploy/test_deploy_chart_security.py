"""The chart closes the event plane: engine event sockets on loopback, a NetworkPolicy that
lets only router pods reach the bridge, tokens from Secrets, probes on /livez and /readyz.
Rendered with the real Helm library (see test_deploy_chart)."""

from __future__ import annotations

import json
from typing import Any

from kvroute.router.config_load import env_name
from tests.deploy.test_deploy_chart import by_kind, objects

SECRETS = json.dumps(
    {
        "router": {"adminTokenSecret": "kvroute-admin"},
        "worker": {"bridge": {"tokenSecret": "kvroute-bridge", "tokenSecretKey": "t"}},
    }
)


def container(objs: dict[tuple[str, str], Any], component: str, name: str) -> dict[str, Any]:
    (deployment,) = [
        d
        for d in by_kind(objs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    spec = deployment["spec"]["template"]["spec"]
    (found,) = [c for c in spec["containers"] if c["name"] == name]
    return {"container": found, "volumes": spec.get("volumes", [])}


def test_vllm_event_sockets_bind_to_loopback() -> None:
    vllm = container(objects(), "worker", "vllm")["container"]
    config = json.loads(vllm["args"][vllm["args"].index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://127.0.0.1:5557"
    assert config["replay_endpoint"] == "tcp://127.0.0.1:5558"


def test_only_router_pods_reach_the_bridge_port() -> None:
    objs = objects()
    (policy,) = by_kind(objs, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"]["kvroute.io/role"] == "worker"
    grpc_rules = [
        r for r in policy["spec"]["ingress"] if {"port": 50051, "protocol": "TCP"} in r["ports"]
    ]
    (rule,) = grpc_rules
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ml"}
    assert all(
        50051 not in [p["port"] for p in r["ports"]] or r.get("from")
        for r in policy["spec"]["ingress"]
    )
    off = objects(json.dumps({"worker": {"networkPolicy": {"enabled": False}}}))
    assert by_kind(off, "NetworkPolicy") == []


def test_tokens_come_from_secrets() -> None:
    objs = objects(SECRETS)
    router = container(objs, "router", "router")
    (env,) = router["container"]["env"]
    assert env == {
        "name": "KVROUTE_ADMIN__TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "kvroute-admin", "key": "token"}},
    }
    bridge = container(objs, "worker", "kv-bridge")
    args = bridge["container"]["args"]
    assert args[args.index("--token-file") + 1] == "/etc/kvroute-bridge/token"
    for pod in (router, bridge):
        (volume,) = [v for v in pod["volumes"] if v["name"] == "bridge-token"]
        assert volume["secret"] == {
            "secretName": "kvroute-bridge",
            "items": [{"key": "t", "path": "token"}],
        }
        mounts = {m["name"]: m["mountPath"] for m in pod["container"]["volumeMounts"]}
        assert mounts["bridge-token"] == "/etc/kvroute-bridge"
    (configmap,) = by_kind(objs, "ConfigMap")
    text = configmap["data"]["config.yaml"]
    assert "bridge_token_file: /etc/kvroute-bridge/token" in text
    # no secret value anywhere but in Secrets the operator made (none rendered here)
    assert by_kind(objs, "Secret") == []


def test_read_only_admin_token_from_its_own_secret() -> None:
    values = {"router": {"adminTokenSecret": "kvroute-admin", "adminReadTokenSecret": "ro"}}
    env = container(objects(json.dumps(values)), "router", "router")["container"]["env"]
    assert env == [
        {
            "name": "KVROUTE_ADMIN__TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "kvroute-admin", "key": "token"}},
        },
        {
            "name": "KVROUTE_ADMIN__READ_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "ro", "key": "token"}},
        },
    ]
    alone = {"router": {"adminReadTokenSecret": "ro", "adminReadTokenSecretKey": "k"}}
    (only,) = container(objects(json.dumps(alone)), "router", "router")["container"]["env"]
    assert only == {
        "name": "KVROUTE_ADMIN__READ_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "ro", "key": "k"}},
    }
    # the names the chart sets are the router's own variables for these settings
    assert env_name("admin.token") == env[0]["name"]
    assert env_name("admin.read_token") == env[1]["name"]
    none = container(objects(), "router", "router")["container"]
    assert "env" not in none


def test_probes_use_livez_and_readyz() -> None:
    objs = objects()
    for component, name in (("router", "router"), ("worker", "kv-bridge")):
        c = container(objs, component, name)["container"]
        assert c["livenessProbe"]["httpGet"]["path"] == "/livez", name
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", name
