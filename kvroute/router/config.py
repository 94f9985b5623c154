"""The router's configuration: every tunable, its default and what it means.

The records here are plain frozen dataclasses; `kvroute.router.config_load` builds them from a YAML
file, `KVROUTE_*` environment variables and command-line flags, and validates them. Each field
carries its documentation in `metadata["doc"]`, so `kvroute serve --print-defaults` can print
the whole reference from the one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

POLICY_NAMES = (
    "ttft",
    "full_attention_only",
    "round_robin",
    "random",
    "least_load",
    "session",
)
TOKENIZER_MODES = ("render", "request")  # anything else is a local model directory
# A worker's part in prefill/decode disaggregation (vLLM's kv_role kv_producer / kv_consumer);
# "both" serves whole requests (a mixed pool).
WORKER_ROLES = ("both", "prefill", "decode")


def _f(default: Any, doc: str) -> Any:
    """A dataclass field with an immutable default and its documentation."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine endpoint (one DP rank of one vLLM server)."""

    name: str = _f("", "unique worker name: its identity in the index, metrics and admin API")
    url: str = _f("", "the engine's OpenAI HTTP base URL, e.g. http://10.0.0.5:8000 (no /v1)")
    bridge: str | None = _f(None, "host:port of the worker's kvroute bridge (gRPC KV events)")
    zmq: str | None = _f(None, "tcp://host:port of the engine's ZMQ PUB socket (in-process)")
    replay: str | None = _f(None, "with zmq: tcp://host:port of the engine's replay socket")
    topic: str = _f("", "with zmq: the engine's KV-event topic prefix")
    dp_rank: int = _f(0, "data-parallel rank of the engine this worker stands for")
    model: str | None = _f(None, "served model name; learned from /v1/models when unset")
    instance: str = _f("", "incarnation id (e.g. pod uid); a change means a new engine")
    role: str = _f(
        "both",
        "both (serves whole requests), prefill or decode (one half of a disaggregated model; "
        "needs model set)",
    )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How the router gets exact token ids for one served (base) model."""

    tokenizer: str | None = _f(
        None,
        'local model directory, "render" (engine render endpoint) or "request" (ids given in '
        "the request); unset = tokenizer.default",
    )
    chat_template: str | None = _f(None, "optional .jinja file overriding the model's template")
    alignment: int | None = _f(None, "override the hit alignment (tokens) for this model")
    send_token_ids: bool = _f(
        False,
        "send plain chat requests and text completions as /v1/completions of the router's "
        "token ids, so the engine does not tokenize them again; needs a tokenizer giving the "
        "engine's exact ids",
    )
    embeddings_use_cache: bool = _f(
        False,
        "an embedding model whose /v1/embeddings read the prefix cache (decoder, last-token "
        "pooling: vLLM keeps prefix caching on); off: embeddings get no cache evidence",
    )


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    name: str = _f("ttft", "routing policy: " + ", ".join(POLICY_NAMES))
    prefill_tokens_per_s: float = _f(
        20000.0, "a worker's prefill throughput, tokens/s (converts tokens to seconds)"
    )
    learn_prefill_rate: bool = _f(
        False,
        "route with the prefill rate measured from streamed first bytes; prefill_tokens_per_s is "
        "then only its starting value",
    )
    queue_weight: float = _f(
        0.25,
        "weight of a worker's queued prefill in the TTFT estimate (>= 0); below 1 a request stays "
        "with its cache longer before load is balanced, 1 = the plain estimate",
    )
    tokens_per_running: float = _f(
        100.0,
        "prefill tokens each request already running on a worker adds to its TTFT estimate, for "
        "the decode steps that interleave with a prefill (>= 0)",
    )
    full_queue_without_reuse: bool = _f(
        True,
        "on a worker that reuses nothing of the request, count its queued prefill in full instead "
        "of at queue_weight",
    )
    cpu_tier_tokens_per_s: float = _f(
        200_000.0,
        "offloaded KV: tokens/s (> 0) a worker loads from its CPU tier instead of prefilling them; "
        "host-to-GPU bandwidth / KV bytes per token (200k: PCIe 4 x16 at 128 KiB per token)",
    )
    learn_cpu_tier_rate: bool = _f(
        False,
        "price each worker's CPU-tier tokens at the load rate its engine's /metrics report; "
        "cpu_tier_tokens_per_s is the rate until learned, and bounds it (within 100x)",
    )
    storage_tier_tokens_per_s: float = _f(
        30_000.0,
        "offloaded KV: tokens/s (> 0) a worker loads from its storage tier (disk, remote store); "
        "read bandwidth / KV bytes per token (30k: a local NVMe drive at 128 KiB per token)",
    )
    saturation_queue_s: float = _f(
        2.0, "a worker whose queued prefill exceeds this many seconds is saturated"
    )
    max_running_per_worker: int = _f(
        256, "a worker with this many running requests is saturated (vLLM max_num_seqs)"
    )
    kv_usage_saturation: float = _f(
        0.97, "a worker whose KV cache usage (from /metrics) reaches this is saturated"
    )
    spill: bool = _f(
        True, "when the best worker is saturated, send the request to the best unsaturated one"
    )
    affinity_weight: float = _f(
        1.5,
        "hybrid models: credit a worker this fraction (>= 0) of the prefill time of the prompt "
        "tokens its full-attention blocks hold beyond its reuse; 0 = greedy on reuse",
    )
    junction_shared_only: bool = _f(
        True,
        "hybrid models: no junction credit for a conversation's own history, only for prefixes "
        "other sessions share, and none below the fleet's best reuse",
    )
    sharing_max_keys: int = _f(
        262_144,
        "prompt index keys remembered with the session that asked for them, for "
        "junction_shared_only (>= 1; the oldest are forgotten first)",
    )
    placement_weight: float = _f(
        0.0,
        "weight (>= 0) of the expected re-prefill of the conversations a placement pushes out "
        "of a worker's KV pool (1 = at their prefill time); 0 = off",
    )
    working_set_max_conversations: int = _f(
        65_536,
        "conversations remembered per router as each worker's working set (>= 1; the least "
        "recently routed are forgotten first)",
    )
    working_set_idle_s: float = _f(
        1800.0, "a conversation not seen for this many seconds (> 0) leaves the working set"
    )
    return_interval_s: float = _f(
        60.0,
        "expected gap between a conversation's turns, seconds (> 0), until the router has "
        "measured gaps (then their average)",
    )
    session_header: str = _f("x-session-id", "request header holding the session key")
    session_field: str = _f("user", "request body field holding the session key")
    session_bounded_load: float = _f(
        1.25, "consistent hashing: a worker takes at most this factor times the mean load"
    )
    session_slack_tokens: float = _f(
        400.0,
        "a request with no cache evidence follows its session's hash only among workers within "
        "this many prefill tokens of the fastest estimate (>= 0; large = hash alone)",
    )
    virtual_nodes: int = _f(64, "consistent hashing: ring points per worker")
    hash_unit: int = _f(16, "index hash unit in tokens; must divide every group's block size")
    expect_seconds: float = _f(
        10.0, "after routing, credit the chosen worker with the prompt for this long"
    )
    avg_prompt_tokens: int = _f(
        1024, "initial estimate of a waiting request's prefill tokens (learned at run time)"
    )
    seed: int | None = _f(None, "seed of the random policy (unset = random)")


@dataclass(frozen=True, slots=True)
class PdConfig:
    """How the decode half of a disaggregated (prefill/decode) request is placed."""

    link_gbps: float = _f(
        400.0,
        "bandwidth a decode worker pulls KV blocks from a prefill worker at, Gbit/s (> 0; "
        "default one 400G RDMA NIC)",
    )
    kv_bytes_per_token: int = _f(
        131072,
        "KV cache bytes per token of the served model, all layers (>= 1; Llama-3.1-8B BF16: "
        "131072)",
    )
    running_s: float = _f(
        0.00012,
        "seconds (>= 0) charged per sequence running on a decode worker: what one more adds to "
        "a decode step (Llama-3.1-8B, H100, 2k context; see docs/policy.md to rescale)",
    )
    learn_link: bool = _f(
        False,
        "price transfers at the bandwidth measured from decode first bytes (pulls of >= 256 "
        "tokens); link_gbps is then only the starting value",
    )


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    max_body_bytes: int = _f(16 * 1024 * 1024, "request bodies above this get 413")
    max_in_flight: int = _f(4096, "requests in flight in this process above this get 503")
    decisions_buffer: int = _f(256, "routing decisions kept for GET /admin/decisions")
    max_workers: int = _f(4096, "workers the registry accepts (admin add beyond it fails)")
    upstream_connections: int = _f(
        1024, "pooled upstream connections per process (keep-alive), all workers"
    )


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    connect_s: float = _f(3.0, "upstream TCP connect timeout")
    read_idle_s: float = _f(600.0, "upstream silence (no byte) longer than this fails the call")
    health_s: float = _f(2.0, "timeout of one health / models / metrics probe")
    retry_after_s: int = _f(1, "Retry-After seconds sent with 503 when no worker can serve")
    keep_alive_s: float = _f(
        75.0,
        "idle client connections are kept this long, seconds; keep it above the load balancer's "
        "idle timeout (often 60 s)",
    )
    shutdown_s: float = _f(30.0, "on shutdown, wait this long for streams to finish")


@dataclass(frozen=True, slots=True)
class UpstreamTlsConfig:
    ca_file: str | None = _f(
        None, "PEM CA bundle trusted for https:// worker URLs; unset = the system's roots"
    )
    server_name: str | None = _f(
        None,
        "name checked in https:// workers' certificates instead of the URL's host (for "
        "engines addressed by pod IP); unset = the host",
    )


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_attempts: int = _f(3, "attempts per request, across workers, before the first byte")
    backoff_initial_s: float = _f(0.02, "wait before the second attempt")
    backoff_multiplier: float = _f(2.0, "each further wait is this many times longer")
    backoff_max_s: float = _f(0.5, "upper bound of one wait")
    budget_ratio: float = _f(0.2, "retries allowed as a fraction of recent requests")
    budget_min_per_s: float = _f(5.0, "retries always allowed per second regardless of ratio")


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = _f(5, "consecutive failures (connect, timeout, 5xx) that open it")
    open_s: float = _f(10.0, "how long it stays open before letting one probe through")
    half_open_successes: int = _f(2, "successful probes that close it again")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = _f(5.0, "active health check (GET /health) period per worker")
    unhealthy_after: int = _f(2, "consecutive failed checks that mark a worker unhealthy")
    healthy_after: int = _f(1, "consecutive good checks that mark it healthy again")
    models_interval_s: float = _f(30.0, "how often each worker's /v1/models is re-read")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    metrics_interval_s: float = _f(
        1.0, "how often each worker's /metrics is read (0 = never; own accounting only)"
    )
    metrics_max_interval_s: float = _f(
        16.0,
        "while a worker shows no other router's requests and KV usage clear of saturation, its "
        "scrape period doubles up to this, seconds (= metrics_interval_s: fixed)",
    )
    release_at_measured_rate: bool = _f(
        True,
        "a request's uncached prompt counts as queued until its first byte or estimated TTFT, "
        "converted to wall time at the measured prefill rate (off: at policy.prefill_tokens_per_s)",
    )


@dataclass(frozen=True, slots=True)
class EventsConfig:
    reconnect_initial_s: float = _f(0.2, "first wait before re-subscribing to a lost stream")
    reconnect_max_s: float = _f(5.0, "upper bound of the reconnect backoff")
    keepalive_s: float = _f(
        20.0, "gRPC keepalive ping period on bridge streams (finds a silently cut network)"
    )
    keepalive_timeout_s: float = _f(10.0, "a keepalive ping unanswered this long drops the stream")
    max_entries_per_worker: int = _f(2_000_000, "index entries kept per worker (LRU beyond)")
    max_pending_per_worker: int = _f(100_000, "unresolved reported blocks kept per worker")
    snapshot_step_blocks: int = _f(
        1024,
        "a snapshot is applied this many blocks at a time, serving requests in between "
        "(the old view answers until the new one is complete)",
    )
    apply_delay_s: float = _f(
        0.002,
        "a live event batch waits this long before it is applied, so the streamed tokens "
        "of the same engine step (which arrive with it) are relayed first (0 = at once)",
    )
    bridge_token_file: str | None = _f(
        None, "file holding the token sent to bridges (gRPC metadata); unset = none sent"
    )
    bridge_ca_file: str | None = _f(
        None, "PEM CA bundle that signed the bridges' certificates; set = connect with TLS"
    )
    bridge_cert_file: str | None = _f(
        None, "PEM client certificate presented to bridges that require one (mutual TLS)"
    )
    bridge_key_file: str | None = _f(None, "PEM private key of bridge_cert_file")
    bridge_tls_server_name: str | None = _f(
        None, "name bridges' certificates are checked against; unset = the bridge's address"
    )


@dataclass(frozen=True, slots=True)
class IndexConfig:
    processes: int = _f(
        0,
        "index shard processes per router host (0..64), each following a disjoint share of "
        "the workers' events off the proxy's event loop; 0 = the index in each router process",
    )
    deadline_s: float = _f(
        0.01,
        "with processes > 0: seconds a decision waits for the shards' answers (> 0); a shard "
        "late beyond it gives its workers no evidence in that decision",
    )
    status_interval_s: float = _f(
        1.0, "with processes > 0: seconds between polls of the shards' stream status (> 0)"
    )
    release_after_s: float = _f(
        10.0,
        "with processes > 0: a worker no router process follows any more is dropped from its "
        "shard after this many seconds (a restarting router finds it warm)",
    )
    restart_max_s: float = _f(
        10.0, "with processes > 0: upper bound of the backoff before restarting a shard (s)"
    )


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    enabled: bool = _f(True, "compare each response's cached_tokens with the prediction")
    window: int = _f(32, "recent responses per worker considered for drift")
    min_samples: int = _f(8, "responses needed in the window before drift is judged")
    miss_fraction: float = _f(0.5, "fraction of misses in the window that triggers a resync")
    tolerance_tokens: int = _f(
        0, "a prediction off by at most this many tokens (beyond alignment) is a hit"
    )
    resync_cooldown_s: float = _f(30.0, "minimum time between two resyncs of one worker")


@dataclass(frozen=True, slots=True)
class AdminConfig:
    token: str | None = _f(
        None,
        "full bearer token for /admin/* (read and change the fleet); set it from a Secret "
        "(env) or use token_file; unset with no read token = admin API disabled",
    )
    token_file: str | None = _f(
        None, "file holding the full admin token (a mounted Secret); not together with token"
    )
    read_token: str | None = _f(
        None,
        "read-only bearer token: the dashboard, GET /admin/* and POST /admin/score; refused "
        "(403) on routes that add, remove, drain, undrain or resync workers",
    )
    read_token_file: str | None = _f(
        None, "file holding the read-only admin token; not together with read_token"
    )
    response_headers: bool = _f(
        False, "add x-kvroute-worker / x-kvroute-predicted-cached-tokens to responses"
    )


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    default: str | None = _f(
        None,
        'tokenizer for models not listed under models: a directory, "render" or "request"; '
        "unset = such models are routed without cache evidence",
    )
    threads: int = _f(2, "threads tokenizing off the event loop")
    inline_chars: int = _f(
        4096,
        "prompt text not in the conversation prefix cache up to this many characters is "
        "encoded on the event loop (cheaper than the hop to a thread); 0 = always a thread",
    )
    partial_min_chars: int = _f(
        512,
        "a streamed request with at least this many new characters after a cached history is "
        "routed on the history's ids while the new text is encoded (0 = always encode first)",
    )
    remember_answers: bool = _f(
        True,
        "after a plain chat answer, encode the conversation with it into the prefix cache in "
        "the background, so the next turn encodes only its new message before dispatch",
    )
    cache_entries: int = _f(4096, "conversation prefixes whose ids are cached")
    render_timeout_s: float = _f(5.0, "timeout of one render-endpoint call")


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """Bounds that keep hostile or stuck clients and a busy fleet from exhausting the router."""

    body_bytes_in_flight: int = _f(
        256 * 1024 * 1024,
        "request body bytes held at once by this process, all requests together (bytes, >= "
        "limits.max_body_bytes); a body that does not fit gets 503 with Retry-After",
    )
    body_read_s: float = _f(
        30.0, "a client must send its whole request body within this many seconds, else 408"
    )
    limit_concurrency: int = _f(
        8192,
        "client connections plus requests uvicorn serves at once before it answers 503 itself "
        "(>= limits.max_in_flight)",
    )
    pool_wait_s: float = _f(
        5.0, "wait at most this many seconds for a free upstream connection, then 503 (> 0)"
    )
    write_stall_s: float = _f(
        30.0,
        "a streaming client that accepts no bytes for this many seconds is dropped and its "
        "upstream connection freed (> 0)",
    )
    client_send_buffer_bytes: int = _f(
        256 * 1024,
        "kernel send buffer of each client connection (bytes, 0 or >= 4096; 0: the kernel's "
        "autotuning, up to MiBs); what a client that stops reading holds before write_stall_s",
    )
    request_deadline_s: float = _f(
        600.0,
        "seconds from dispatch to the answer's first byte, all attempts and retries included; "
        "past it the client gets 504 and no further attempt starts (> 0)",
    )
    trusted_proxies: list[str] = field(
        default_factory=list,
        metadata={
            "doc": "peer addresses or CIDR ranges whose X-Forwarded-* / Forwarded headers are "
            "passed on to the engines; from any other peer they are dropped"
        },
    )


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = _f("127.0.0.1", "address to listen on")
    port: int = _f(8000, "port to listen on")
    processes: int = _f(1, "router processes sharing the port (flag --workers N)")
    log_level: str = _f("info", "debug, info, warning or error")
    workers: list[WorkerSpec] = field(
        default_factory=list, metadata={"doc": "the fleet (more can be added with the admin API)"}
    )
    models: dict[str, ModelSpec] = field(
        default_factory=dict, metadata={"doc": "per served model: tokenizer and alignment"}
    )
    policy: PolicyConfig = field(
        default_factory=PolicyConfig, metadata={"doc": "how a worker is chosen"}
    )
    pd: PdConfig = field(
        default_factory=PdConfig,
        metadata={"doc": "prefill/decode disaggregation: choosing the decode worker"},
    )
    limits: LimitsConfig = field(
        default_factory=LimitsConfig, metadata={"doc": "bounds on requests and memory"}
    )
    timeouts: TimeoutsConfig = field(
        default_factory=TimeoutsConfig, metadata={"doc": "upstream and probe timeouts"}
    )
    upstream_tls: UpstreamTlsConfig = field(
        default_factory=UpstreamTlsConfig, metadata={"doc": "TLS to https:// workers"}
    )
    retry: RetryConfig = field(
        default_factory=RetryConfig, metadata={"doc": "retries to another worker"}
    )
    breaker: BreakerConfig = field(
        default_factory=BreakerConfig, metadata={"doc": "per-worker circuit breaker"}
    )
    health: HealthConfig = field(
        default_factory=HealthConfig, metadata={"doc": "active health checks"}
    )
    load: LoadConfig = field(
        default_factory=LoadConfig, metadata={"doc": "load refresh from the engines' /metrics"}
    )
    events: EventsConfig = field(
        default_factory=EventsConfig, metadata={"doc": "KV-event subscriptions and index bounds"}
    )
    index: IndexConfig = field(
        default_factory=IndexConfig,
        metadata={"doc": "where the KV index runs: in the router process or in shard processes"},
    )
    verify: VerifyConfig = field(
        default_factory=VerifyConfig, metadata={"doc": "checking predictions against engines"}
    )
    admin: AdminConfig = field(default_factory=AdminConfig, metadata={"doc": "admin API"})
    discovery: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "doc": "dynamic worker sources: file and/or kubernetes (kvroute/router/fleet/discovery)"
        },
    )
    tokenizer: TokenizerConfig = field(
        default_factory=TokenizerConfig, metadata={"doc": "exact tokenization"}
    )
    edge: EdgeConfig = field(
        default_factory=EdgeConfig, metadata={"doc": "bounds against hostile or stuck clients"}
    )
