"""Config: defaults, file + env + flag precedence, shorthands, and every kind of bad value."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from kvroute.router.cli import flag_overrides, parse_args
from kvroute.router.config import RouterConfig
from kvroute.router.config_load import (
    ConfigError,
    config_from_dict,
    describe_defaults,
    load_config,
    worker_from_dict,
)

FLEET = {
    "workers": [
        {"name": "w0", "url": "http://127.0.0.1:8001", "bridge": "127.0.0.1:50051", "dp_rank": 0},
        {"name": "w1", "url": "http://127.0.0.1:8002", "zmq": "tcp://127.0.0.1:5557"},
    ],
    "models": {"m": {"tokenizer": "render", "alignment": 32}},
}


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_fleet_config_as_sim_writes_it(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, FLEET), env={})
    assert [w.name for w in cfg.workers] == ["w0", "w1"]
    assert cfg.workers[0].bridge == "127.0.0.1:50051"
    assert cfg.workers[1].zmq == "tcp://127.0.0.1:5557"
    assert cfg.models["m"].tokenizer == "render"
    assert cfg.models["m"].alignment == 32
    assert cfg.policy.name == "ttft"  # default


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    data = {**FLEET, "port": 9000, "policy": "random", "limits": {"max_body_bytes": 1000}}
    path = write(tmp_path, data)
    env = {"KVROUTE_PORT": "9100", "KVROUTE_LIMITS__MAX_BODY_BYTES": "2000", "KVROUTE_X": "1"}
    cfg = load_config(path, env=env)
    assert cfg.port == 9100  # env beats file
    assert cfg.limits.max_body_bytes == 2000
    assert cfg.policy.name == "random"  # file beats default
    args = parse_args(["--port", "9200", "--policy", "least_load", "--admin-token", "t" * 8])
    cfg = load_config(path, env=env, overrides=flag_overrides(args))
    assert cfg.port == 9200  # flag beats env
    assert cfg.policy.name == "least_load"
    assert cfg.admin.token == "t" * 8
    assert cfg.timeouts == RouterConfig().timeouts  # untouched sections keep defaults


def test_config_path_from_environment(tmp_path: Path) -> None:
    path = write(tmp_path, FLEET)
    cfg = load_config(None, env={"KVROUTE_CONFIG": path, "KVROUTE_POLICY__NAME": "session"})
    assert cfg.policy.name == "session"
    assert len(cfg.workers) == 2


def test_namespace_pod_worker_names_are_accepted() -> None:
    cfg = config_from_dict({"workers": [{"name": "team-a/vllm-0", "url": "http://h:1"}]})
    assert cfg.workers[0].name == "team-a/vllm-0"


def test_model_shorthand_and_policy_mapping() -> None:
    cfg = config_from_dict(
        {**FLEET, "models": {"m": "request"}, "policy": {"name": "ttft", "spill": False}}
    )
    assert cfg.models["m"].tokenizer == "request"
    assert cfg.policy.spill is False


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"port": 70000}, "port: expected 0..65535"),
        ({"port": "x"}, "port: expected an integer"),
        ({"policy": "fastest"}, "policy.name: expected one of"),
        ({"polcy": "ttft"}, "polcy: unknown key"),
        ({"policy": {"prefill_tokens_per_s": -1}}, "policy.prefill_tokens_per_s"),
        ({"policy": {"spill": "yes"}}, "policy.spill: expected true or false"),
        (
            {"load": {"metrics_interval_s": 2, "metrics_max_interval_s": 1}},
            "load.metrics_max_interval_s: expected >= load.metrics_interval_s",
        ),
        ({"workers": []}, "workers: at least one worker"),
        ({"workers": [{"name": "a", "url": "localhost:80"}]}, "workers[0].url"),
        ({"workers": [{"name": "a b", "url": "http://h:1"}]}, "workers[0].name"),
        ({"workers": [{"name": "/pod", "url": "http://h:1"}]}, "workers[0].name"),
        ({"workers": [{"name": "a", "url": "http://h:1", "bridge": "h"}]}, "workers[0].bridge"),
        (
            {"workers": [{"name": "a", "url": "http://h:1", "bridge": "h:1", "zmq": "tcp://h:2"}]},
            "bridge or zmq, not both",
        ),
        (
            {"workers": [{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]},
            "duplicate name",
        ),
        ({"workers": [{"name": "a", "url": "http://h:1", "colour": 1}]}, "workers[0].colour"),
        ({"models": {"m": {"tokenizer": "/no/such/dir"}}}, "models.m.tokenizer: no such"),
        ({"models": {"m": {"alignment": 0}}}, "models.m.alignment"),
        ({"models": {"m": {"alignment": 24}}}, "multiple of policy.hash_unit"),
        ({"verify": {"min_samples": 100}}, "verify.min_samples"),
        ({"retry": {"max_attempts": 0}}, "retry.max_attempts"),
        ({"admin": {"token": "short"}}, "admin.token"),
        ({"admin": {"read_token": "short"}}, "admin.read_token: use >= 8"),
        (
            {"admin": {"token": "same-token", "read_token": "same-token"}},
            "admin.read_token: must differ",
        ),
        (
            {"admin": {"token": "long-enough", "token_file": "/no/such/file"}},
            "admin.token: give token or token_file",
        ),
        ({"admin": {"read_token_file": "/no/such/file"}}, "admin.read_token_file: no such"),
        ({"breaker": {"open_s": 0}}, "breaker.open_s"),
    ],
)
def test_bad_values_have_clear_errors(patch: dict[str, object], message: str) -> None:
    data = {**FLEET, **patch}
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert message in str(err.value)


def test_all_problems_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({**FLEET, "port": "x", "log_level": 3, "nope": 1})
    text = str(err.value)
    assert "port" in text and "log_level" in text and "nope" in text


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.yaml"), env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad), env={})
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(scalar), env={})


def test_no_workers_allowed_with_admin_token() -> None:
    cfg = config_from_dict({"admin": {"token": "secret-token"}})
    assert cfg.workers == []


def test_worker_from_dict_for_admin_add() -> None:
    spec = worker_from_dict({"name": "w9", "url": "http://127.0.0.1:9", "model": "m"})
    assert spec.model == "m"
    with pytest.raises(ConfigError, match=r"worker\.url"):
        worker_from_dict({"name": "w9", "url": "ftp://x"})
    with pytest.raises(ConfigError, match="unknown key"):
        worker_from_dict({"name": "w9", "url": "http://x:1", "extra": True})


def test_defaults_reference_documents_every_field() -> None:
    text = describe_defaults()
    for key in ("prefill_tokens_per_s: 20000.0", "max_body_bytes: 16777216", "token: null"):
        assert key in text
    assert text.count("#") > 60  # every line carries its documentation
    assert yaml.safe_load(text) is not None  # the reference is valid YAML itself


def test_discovery_section_is_validated() -> None:
    cfg = config_from_dict({"discovery": {"file": {"path": "/tmp/w.yaml"}}})
    assert cfg.workers == [] and cfg.discovery["file"]["path"] == "/tmp/w.yaml"
    with pytest.raises(ConfigError, match="discovery"):
        config_from_dict({**FLEET, "discovery": {"files": {}}})


@pytest.mark.parametrize(
    "key",
    [
        "affinity_max_workers",
        "step_wait_weight",
        "tokens_per_running_home",
        "home_load_bound",
        "decode_s_per_running_home",
    ],
)
def test_retired_key_is_ignored_with_one_warning(
    key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvroute.router.config_load"):
        cfg = config_from_dict({**FLEET, "policy": {"name": "ttft", key: 64}})
    assert cfg.policy.name == "ttft"
    warnings = [r for r in caplog.records if key in r.getMessage()]
    assert len(warnings) == 1 and "ignored" in warnings[0].getMessage()
    # a misspelt key next to it is still an error
    with pytest.raises(ConfigError, match="affinty_weight: unknown key"):
        config_from_dict({**FLEET, "policy": {"affinity_max_workers": 64, "affinty_weight": 1}})


def test_former_seconds_keys_become_tokens_at_the_configured_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A deployment's config from before the per-running terms moved to prefill tokens
    keeps routing as it did: seconds x its prefill rate, with one warning per key."""
    old = {
        "decode_s_per_running": 0.004,
        "session_slack_s": 0.05,
    }
    with caplog.at_level(logging.WARNING, logger="kvroute.router.config_load"):
        cfg = config_from_dict({**FLEET, "policy": {"prefill_tokens_per_s": 10_000, **old}})
    p = cfg.policy
    assert (p.tokens_per_running, p.session_slack_tokens) == (40.0, 500.0)
    assert len([r for r in caplog.records if "prefill tokens" in r.getMessage()]) == 2
    # at the default rate
    cfg = config_from_dict({**FLEET, "policy": {"decode_s_per_running": 0.005}})
    assert cfg.policy.tokens_per_running == 100.0
    # an explicit token key wins; a bad old value is reported under the new name
    cfg = config_from_dict(
        {**FLEET, "policy": {"decode_s_per_running": 0.5, "tokens_per_running": 7}}
    )
    assert cfg.policy.tokens_per_running == 7
    with pytest.raises(ConfigError, match=r"policy\.session_slack_tokens"):
        config_from_dict({**FLEET, "policy": {"session_slack_s": "soon"}})
    # a number given as a string (a quoted YAML value, a command-line flag) is converted too
    cfg = config_from_dict({**FLEET, "policy": {"session_slack_s": "0.02"}})
    assert cfg.policy.session_slack_tokens == pytest.approx(400.0)


def _pd_worker(name: str, port: int, role: str, model: str | None = "m") -> dict[str, object]:
    return {"name": name, "url": f"http://127.0.0.1:{port}", "role": role, "model": model}


def test_worker_roles_allow_a_pd_pool_beside_a_mixed_pool() -> None:
    cfg = config_from_dict(
        {
            "workers": [
                _pd_worker("p0", 9001, "prefill"),
                _pd_worker("d0", 9002, "decode"),
                _pd_worker("mix", 9003, "both"),
                {"name": "plain", "url": "http://127.0.0.1:9004"},
            ]
        }
    )
    assert [w.role for w in cfg.workers] == ["prefill", "decode", "both", "both"]


@pytest.mark.parametrize(
    ("workers", "message"),
    [
        ([_pd_worker("p0", 1, "prefill")], "model 'm' has prefill workers but no decode worker"),
        (
            [_pd_worker("d0", 1, "decode"), _pd_worker("x", 2, "both")],
            "model 'm' has decode workers but no prefill worker",
        ),
        ([_pd_worker("p0", 1, "prefill", None)], "workers[0].model: a prefill worker must name"),
        ([_pd_worker("p0", 1, "producer")], "workers[0].role: expected one of both, prefill"),
    ],
)
def test_pd_pools_are_validated(workers: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"workers": workers})
    assert message in str(err.value)


def test_pd_pool_check_is_per_model() -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {
                "workers": [
                    _pd_worker("p0", 1, "prefill", "a"),
                    _pd_worker("d0", 2, "decode", "a"),
                    _pd_worker("p1", 3, "prefill", "b"),
                ]
            }
        )
    assert "model 'b' has prefill workers but no decode worker" in str(err.value)
    assert "'a'" not in str(err.value)


def test_admin_add_takes_a_role() -> None:
    spec = worker_from_dict({"name": "d9", "url": "http://127.0.0.1:9", "model": "m",
                             "role": "decode"})  # fmt: skip
    assert spec.role == "decode"
    with pytest.raises(ConfigError, match=r"worker\.role"):
        worker_from_dict({"name": "d9", "url": "http://127.0.0.1:9", "role": "kv_consumer"})
    with pytest.raises(ConfigError, match="decode worker must name its model"):
        worker_from_dict({"name": "d9", "url": "http://127.0.0.1:9", "role": "decode"})
