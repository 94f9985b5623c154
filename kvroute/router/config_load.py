"""Build a `RouterConfig` from defaults < YAML file < KVROUTE_* environment < flags.

Every value is type-checked against the dataclass field it lands in, and the whole result is
validated before the router starts; all problems are reported at once, each with its path
(`policy.prefill_tokens_per_s: expected a number > 0, got -1`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union
from urllib.parse import urlsplit

import yaml

from kvroute.router.config import (
    POLICY_NAMES,
    TOKENIZER_MODES,
    WORKER_ROLES,
    AdminConfig,
    ModelSpec,
    PolicyConfig,
    RouterConfig,
    WorkerSpec,
)
from kvroute.router.edge.trust import parse_networks
from kvroute.router.fleet.discovery import (
    DiscoveryConfigError,
    parse_discovery_config,
    valid_worker_name,
)

ENV_PREFIX = "KVROUTE_"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Keys earlier versions accepted that no longer do anything: ignored with a warning, so a
# working deployment's config file does not stop the router on upgrade.
RETIRED_KEYS = {
    "policy.affinity_max_workers": (
        "the policy now takes every worker's full-attention coverage from the scoring walk"
    ),
    "policy.step_wait_weight": "the step wait was removed; docs/decisions/step-wait.md",
    **dict.fromkeys(
        (
            "policy.tokens_per_running_home",
            "policy.home_load_bound",
            "policy.decode_s_per_running_home",
        ),
        "the home discount was removed; docs/decisions/home-discount-and-load-bound.md",
    ),
}
# Policy keys once in seconds, now in prefill tokens (so a fleet's true rate keeps the
# ranking): converted at the configured rate with a warning, so the router ranks as before.
SECONDS_TO_TOKENS_KEYS = {
    "decode_s_per_running": "tokens_per_running",
    "session_slack_s": "session_slack_tokens",
}

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """The configuration is invalid; the message lists every problem found."""


def load_config(
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    """Read, merge, type-check and validate the configuration.

    `path` is a YAML file (or KVROUTE_CONFIG from `env` when None); `env` defaults to
    os.environ; `overrides` are dotted keys from command-line flags ("policy.name": "random").
    """
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    path = path or env.get(ENV_PREFIX + "CONFIG")
    if path:
        data = _read_yaml(path)
    _merge(data, env_overrides(env))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    return config_from_dict(data)


def config_from_dict(data: Mapping[str, Any]) -> RouterConfig:
    """Type-check and validate an already merged mapping (YAML-shaped)."""
    errors: list[str] = []
    config = _build(RouterConfig, _normalise(data), "", errors)
    if not errors:
        errors.extend(validate(config))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    assert isinstance(config, RouterConfig)
    return config


def env_name(dotted: str) -> str:
    """The environment variable that sets the config key `dotted` ("admin.token" ->
    KVROUTE_ADMIN__TOKEN); `env_overrides` reads exactly these names."""
    return ENV_PREFIX + dotted.upper().replace(".", "__")


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """KVROUTE_SECTION__FIELD=value pairs as a nested mapping (values parsed as YAML scalars).

    Only names whose first part is a known top-level key are taken, so unrelated KVROUTE_*
    variables of other components are ignored.
    """
    known = {f.name for f in dataclasses.fields(RouterConfig)}
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if parts[0] not in known:
            continue
        _set_dotted(out, ".".join(parts), yaml.safe_load(raw) if raw != "" else "")
    return out


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    return data


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, str) and part == "policy":
            child = {"name": child}  # `policy: NAME` shorthand, then a policy.* override
        if not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[parts[-1]] = value


def _normalise(data: Mapping[str, Any]) -> dict[str, Any]:
    """Accept the shorthands: `policy: NAME` and `models: {NAME: PATH-or-mode}`."""
    out = dict(data)
    if isinstance(out.get("policy"), str):
        out["policy"] = {"name": out["policy"]}
    for dotted, why in RETIRED_KEYS.items():
        section, key = dotted.split(".")
        node = out.get(section)
        if isinstance(node, Mapping) and key in node:
            out[section] = {k: v for k, v in node.items() if k != key}
            log.warning("config: %s is no longer used and is ignored (%s)", dotted, why)
    policy = out.get("policy")
    if isinstance(policy, Mapping) and SECONDS_TO_TOKENS_KEYS.keys() & policy.keys():
        out["policy"] = _seconds_to_tokens(policy)
    models = out.get("models")
    if isinstance(models, Mapping):
        out["models"] = {
            name: ({"tokenizer": spec} if isinstance(spec, str) else spec or {})
            for name, spec in models.items()
        }
    return out


def _seconds_to_tokens(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Replace the policy's former seconds keys by their token keys (an explicit token key
    wins); a value that is not a number is left for validation to report."""
    out = dict(policy)
    rate = out.get("prefill_tokens_per_s", PolicyConfig().prefill_tokens_per_s)
    for old, new in SECONDS_TO_TOKENS_KEYS.items():
        if old not in out:
            continue
        seconds = out.pop(old)
        if new in out:
            log.warning("config: policy.%s is replaced by policy.%s and is ignored", old, new)
            continue
        try:
            out[new] = _number(seconds) * _number(rate)
        except (TypeError, ValueError):
            out[new] = seconds  # reported by validation, under its new name
            continue
        log.warning(
            "config: policy.%s (seconds) is now policy.%s (prefill tokens): %s s at %s "
            "tokens/s taken as %s tokens",
            old, new, seconds, rate, out[new],
        )  # fmt: skip
    return out


def _number(value: Any) -> float:
    """A YAML number or numeric string as a float (TypeError/ValueError otherwise)."""
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")
    return float(value)


def _build(tp: Any, value: Any, path: str, errors: list[str]) -> Any:
    """Convert `value` to type `tp`, appending problems to `errors` (returns None then)."""
    where = path or "config"
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _build(args[0], value, path, errors)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            errors.append(f"{where}: expected a mapping, got {_show(value)}")
            return None
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        for key in value:
            if key not in names:
                errors.append(f"{_join(path, str(key))}: unknown key")
        kwargs = {
            key: _build(hints[key], value[key], _join(path, key), errors)
            for key in names
            if key in value
        }
        try:
            return typing.cast(Any, tp)(**kwargs)
        except TypeError as exc:  # only reachable through earlier errors
            errors.append(f"{where}: {exc}")
            return None
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list, got {_show(value)}")
            return []
        (item_tp,) = typing.get_args(tp)
        return [_build(item_tp, v, f"{where}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            errors.append(f"{where}: expected a mapping, got {_show(value)}")
            return {}
        _, val_tp = typing.get_args(tp)
        return {str(k): _build(val_tp, v, _join(path, str(k)), errors) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{where}: expected true or false, got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{where}: expected an integer, got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            errors.append(f"{where}: expected a number, got {_show(value)}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            errors.append(f"{where}: expected a string, got {_show(value)}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {where}")  # programming error


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate(c: RouterConfig) -> list[str]:
    """Semantic checks on a well-typed config; returns the problems (empty = valid)."""
    errors: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    need(0 <= c.port <= 65535, f"port: expected 0..65535, got {c.port}")
    need(c.processes >= 1, f"processes: expected >= 1, got {c.processes}")
    need(c.log_level in LOG_LEVELS, f"log_level: expected one of {LOG_LEVELS}")
    ix = c.index
    need(0 <= ix.processes <= 64, f"index.processes: expected 0..64, got {ix.processes}")
    for key in ("deadline_s", "status_interval_s", "restart_max_s"):
        value = getattr(ix, key)
        need(value > 0, f"index.{key}: expected a number > 0, got {value}")
    need(ix.release_after_s >= 0, f"index.release_after_s: expected >= 0, got {ix.release_after_s}")
    if c.discovery:
        try:
            parse_discovery_config(c.discovery)
        except DiscoveryConfigError as exc:
            errors.append(str(exc))
    if not c.workers and not c.admin.token and not c.discovery:
        errors.append(
            "workers: at least one worker is needed (or discovery, or admin.token to add them)"
        )
    seen: set[str] = set()
    for i, w in enumerate(c.workers):
        errors.extend(validate_worker(w, f"workers[{i}]"))
        need(w.name not in seen, f"workers[{i}].name: duplicate name {w.name!r}")
        seen.add(w.name)
    errors.extend(validate_pd_pools(c.workers))
    for name, m in c.models.items():
        where = f"models.{name}"
        if m.tokenizer is not None and m.tokenizer not in TOKENIZER_MODES:
            need(Path(m.tokenizer).is_dir(), f"{where}.tokenizer: no such directory {m.tokenizer}")
        if m.chat_template is not None:
            need(Path(m.chat_template).is_file(), f"{where}.chat_template: no such file")
        if m.alignment is not None:
            need(
                m.alignment > 0 and m.alignment % c.policy.hash_unit == 0,
                f"{where}.alignment: expected a positive multiple of policy.hash_unit",
            )
    t = c.tokenizer.default
    if t is not None and t not in TOKENIZER_MODES:
        need(Path(t).is_dir(), f"tokenizer.default: no such directory {t}")
    need(c.tokenizer.threads >= 1, "tokenizer.threads: expected >= 1")
    need(c.tokenizer.inline_chars >= 0, "tokenizer.inline_chars: expected >= 0")
    need(c.tokenizer.partial_min_chars >= 0, "tokenizer.partial_min_chars: expected >= 0")
    need(c.tokenizer.cache_entries >= 0, "tokenizer.cache_entries: expected >= 0")

    p = c.policy
    need(p.name in POLICY_NAMES, f"policy.name: expected one of {', '.join(POLICY_NAMES)}")
    for key in (
        "prefill_tokens_per_s",
        "cpu_tier_tokens_per_s",
        "storage_tier_tokens_per_s",
        "saturation_queue_s",
        "session_bounded_load",
        "working_set_idle_s",
        "return_interval_s",
    ):
        need(getattr(p, key) > 0, f"policy.{key}: expected a number > 0")
    need(p.tokens_per_running >= 0, "policy.tokens_per_running: expected >= 0")
    need(p.affinity_weight >= 0, "policy.affinity_weight: expected >= 0")
    need(p.sharing_max_keys >= 1, "policy.sharing_max_keys: expected >= 1")
    need(p.placement_weight >= 0, "policy.placement_weight: expected >= 0")
    need(
        p.working_set_max_conversations >= 1,
        "policy.working_set_max_conversations: expected >= 1",
    )
    need(p.queue_weight >= 0, "policy.queue_weight: expected >= 0")
    need(p.session_bounded_load >= 1, "policy.session_bounded_load: expected >= 1")
    need(p.session_slack_tokens >= 0, "policy.session_slack_tokens: expected >= 0")
    need(0 < p.kv_usage_saturation <= 1, "policy.kv_usage_saturation: expected in (0, 1]")
    need(p.max_running_per_worker >= 1, "policy.max_running_per_worker: expected >= 1")
    need(p.virtual_nodes >= 1, "policy.virtual_nodes: expected >= 1")
    need(p.hash_unit >= 1, "policy.hash_unit: expected >= 1")
    need(p.expect_seconds >= 0, "policy.expect_seconds: expected >= 0")
    need(p.avg_prompt_tokens >= 0, "policy.avg_prompt_tokens: expected >= 0")

    need(c.pd.link_gbps > 0, "pd.link_gbps: expected > 0")
    need(c.pd.kv_bytes_per_token >= 1, "pd.kv_bytes_per_token: expected >= 1")
    need(c.pd.running_s >= 0, "pd.running_s: expected >= 0")

    lim = c.limits
    for key in ("max_body_bytes", "max_in_flight", "decisions_buffer", "max_workers"):
        need(getattr(lim, key) >= 1, f"limits.{key}: expected >= 1")
    need(lim.upstream_connections >= 1, "limits.upstream_connections: expected >= 1")
    for key in ("connect_s", "read_idle_s", "health_s", "shutdown_s"):
        need(getattr(c.timeouts, key) > 0, f"timeouts.{key}: expected > 0")
    need(c.timeouts.retry_after_s >= 0, "timeouts.retry_after_s: expected >= 0")

    edge = c.edge
    need(
        edge.body_bytes_in_flight >= lim.max_body_bytes,
        "edge.body_bytes_in_flight: expected >= limits.max_body_bytes",
    )
    need(
        edge.limit_concurrency >= lim.max_in_flight,
        "edge.limit_concurrency: below max_in_flight",
    )
    need(
        edge.client_send_buffer_bytes == 0 or edge.client_send_buffer_bytes >= 4096,
        "edge.client_send_buffer_bytes: expected 0 or >= 4096",
    )
    for key in ("body_read_s", "pool_wait_s", "write_stall_s", "request_deadline_s"):
        need(getattr(edge, key) > 0, f"edge.{key}: expected > 0")
    try:
        parse_networks(edge.trusted_proxies)
    except ValueError as exc:
        need(False, f"edge.trusted_proxies: {exc}")

    tls = c.upstream_tls
    need(
        tls.ca_file is None or Path(tls.ca_file).is_file(),
        f"upstream_tls.ca_file: no such file {tls.ca_file}",
    )
    need(tls.server_name is None or bool(tls.server_name), "upstream_tls.server_name: empty")

    r = c.retry
    need(r.max_attempts >= 1, "retry.max_attempts: expected >= 1")
    need(r.backoff_initial_s >= 0, "retry.backoff_initial_s: expected >= 0")
    need(r.backoff_multiplier >= 1, "retry.backoff_multiplier: expected >= 1")
    need(r.backoff_max_s >= r.backoff_initial_s, "retry.backoff_max_s: below backoff_initial_s")
    need(r.budget_ratio >= 0, "retry.budget_ratio: expected >= 0")
    need(r.budget_min_per_s >= 0, "retry.budget_min_per_s: expected >= 0")

    b = c.breaker
    need(b.failure_threshold >= 1, "breaker.failure_threshold: expected >= 1")
    need(b.open_s > 0, "breaker.open_s: expected > 0")
    need(b.half_open_successes >= 1, "breaker.half_open_successes: expected >= 1")

    h = c.health
    need(h.interval_s > 0, "health.interval_s: expected > 0")
    need(h.unhealthy_after >= 1, "health.unhealthy_after: expected >= 1")
    need(h.healthy_after >= 1, "health.healthy_after: expected >= 1")
    need(h.models_interval_s > 0, "health.models_interval_s: expected > 0")
    need(c.load.metrics_interval_s >= 0, "load.metrics_interval_s: expected >= 0")
    need(
        c.load.metrics_max_interval_s >= c.load.metrics_interval_s,
        "load.metrics_max_interval_s: expected >= load.metrics_interval_s",
    )

    e = c.events
    need(e.reconnect_initial_s > 0, "events.reconnect_initial_s: expected > 0")
    need(e.reconnect_max_s >= e.reconnect_initial_s, "events.reconnect_max_s: below initial")
    need(e.max_entries_per_worker >= 1, "events.max_entries_per_worker: expected >= 1")
    need(e.max_pending_per_worker >= 0, "events.max_pending_per_worker: expected >= 0")
    need(e.snapshot_step_blocks >= 1, "events.snapshot_step_blocks: expected >= 1")
    need(e.apply_delay_s >= 0, "events.apply_delay_s: expected >= 0")
    for name in ("bridge_token_file", "bridge_ca_file", "bridge_cert_file", "bridge_key_file"):
        path = getattr(e, name)
        need(path is None or Path(path).is_file(), f"events.{name}: no such file {path}")
    need(
        (e.bridge_cert_file is None) == (e.bridge_key_file is None),
        "events.bridge_cert_file and events.bridge_key_file go together",
    )
    need(
        e.bridge_cert_file is None or e.bridge_ca_file is not None,
        "events.bridge_cert_file: needs events.bridge_ca_file (client certificates are for TLS)",
    )

    v = c.verify
    need(v.window >= 1, "verify.window: expected >= 1")
    need(1 <= v.min_samples <= v.window, "verify.min_samples: expected in 1..window")
    need(0 < v.miss_fraction <= 1, "verify.miss_fraction: expected in (0, 1]")
    need(v.tolerance_tokens >= 0, "verify.tolerance_tokens: expected >= 0")
    need(v.resync_cooldown_s >= 0, "verify.resync_cooldown_s: expected >= 0")
    errors.extend(validate_admin(c.admin))
    return errors


def validate_admin(a: AdminConfig) -> list[str]:
    """Checks on the admin tokens: at most one source each, long enough, files present, and
    the read-only token different from the full one."""
    errors: list[str] = []
    for key in ("token", "read_token"):
        value, path = getattr(a, key), getattr(a, key + "_file")
        if value is not None and path is not None:
            errors.append(f"admin.{key}: give {key} or {key}_file, not both")
        if value is not None and len(value) < 8:
            errors.append(f"admin.{key}: use >= 8 characters")
        if path is not None and not Path(path).is_file():
            errors.append(f"admin.{key}_file: no such file {path}")
    if a.token is not None and a.token == a.read_token:
        errors.append("admin.read_token: must differ from admin.token")
    return errors


def validate_worker(w: WorkerSpec, where: str = "worker") -> list[str]:
    """Checks on one worker spec (also used by the admin API's add)."""
    errors: list[str] = []
    if not valid_worker_name(w.name):
        errors.append(
            f"{where}.name: expected letters, digits and ._-:/ (e.g. namespace/pod), "
            f"starting with a letter or digit, got {w.name!r}"
        )
    url = urlsplit(w.url)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        errors.append(f"{where}.url: expected http://host:port (no path), got {w.url!r}")
    if w.bridge is not None and not _is_host_port(w.bridge):
        errors.append(f"{where}.bridge: expected host:port, got {w.bridge!r}")
    for key in ("zmq", "replay"):
        value = getattr(w, key)
        if value is not None and not (value.startswith(("tcp://", "ipc://")) and "://" in value):
            errors.append(f"{where}.{key}: expected tcp://host:port, got {value!r}")
    if w.bridge is not None and w.zmq is not None:
        errors.append(f"{where}: give bridge or zmq, not both")
    if w.replay is not None and w.zmq is None:
        errors.append(f"{where}.replay: only meaningful with zmq")
    if w.dp_rank < 0:
        errors.append(f"{where}.dp_rank: expected >= 0")
    if w.model is not None and not w.model:
        errors.append(f"{where}.model: expected a non-empty name")
    if w.role not in WORKER_ROLES:
        errors.append(f"{where}.role: expected one of {', '.join(WORKER_ROLES)}, got {w.role!r}")
    elif w.role != "both" and not w.model:
        errors.append(f"{where}.model: a {w.role} worker must name its model")
    return errors


def validate_pd_pools(workers: list[WorkerSpec]) -> list[str]:
    """A model with prefill workers needs decode workers and the other way round (mixed
    `both` workers may serve the same model beside them)."""
    roles: dict[str, set[str]] = {}
    for w in workers:
        if w.model and w.role in ("prefill", "decode"):
            roles.setdefault(w.model, set()).add(w.role)
    errors = []
    for model, have in sorted(roles.items()):
        for missing in sorted({"prefill", "decode"} - have):
            errors.append(
                f"workers: model {model!r} has {' and '.join(sorted(have))} workers but no "
                f"{missing} worker"
            )
    return errors


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def worker_from_dict(data: Mapping[str, Any]) -> WorkerSpec:
    """A worker spec from an admin request body; raises ConfigError with every problem."""
    errors: list[str] = []
    spec = _build(WorkerSpec, data, "worker", errors)
    if not errors:
        assert isinstance(spec, WorkerSpec)
        errors.extend(validate_worker(spec))
    if errors:
        raise ConfigError("; ".join(errors))
    assert isinstance(spec, WorkerSpec)
    return spec


def describe_defaults() -> str:
    """The full configuration reference as commented YAML (defaults and meanings)."""
    lines = ["# kvroute serve: configuration reference (defaults shown)"]
    _describe(RouterConfig(), RouterConfig, 0, lines)
    return "\n".join(lines) + "\n"


def _describe(obj: Any, tp: Any, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for f in dataclasses.fields(tp):
        doc = f.metadata.get("doc", "")
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:  # {doc}")
            _describe(value, type(value), depth + 1, lines)
        elif f.name == "workers":
            lines.append(f"{pad}workers:  # {doc}")
            _describe_list_item(WorkerSpec, depth + 1, lines)
        elif f.name == "models":
            lines.append(f"{pad}models:  # {doc}")
            lines.append(f"{pad}  MODEL-NAME:")
            _describe(ModelSpec(), ModelSpec, depth + 2, lines)
        else:
            lines.append(f"{pad}{f.name}: {yaml_scalar(value)}  # {doc}")


def _describe_list_item(tp: Any, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    obj = tp()
    for i, f in enumerate(dataclasses.fields(tp)):
        lead = "- " if i == 0 else "  "
        value = getattr(obj, f.name)
        lines.append(f"{pad}{lead}{f.name}: {yaml_scalar(value)}  # {f.metadata.get('doc', '')}")


def yaml_scalar(value: Any) -> str:
    """A value as it is written in the YAML file (flow style, one line)."""
    text: str = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("\n...").removesuffix(" ...")
