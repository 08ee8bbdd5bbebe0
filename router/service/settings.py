"""The service's typed settings tree (``Settings``): what ``router.service.config`` builds
from a file, the environment (router/service/config_env.py) and flags, read once at
start-up; every component takes the part it needs from here. Defaults are the values an
unconfigured router runs with (docs/configuration.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from router.core.admission import AdmissionSettings
from router.core.disagg import PdSetup
from router.core.routing_settings import RoutingSettings
from router.core.slo import DEFAULT_TIERS, DEFAULT_TPOT_S, SloTargets, SloTier, parse_tiers
from router.tokenize.multimodal import ImageSettings

if TYPE_CHECKING:
    pass


ZMQ_AUTO = "auto"  # ReplicaSettings.zmq: the replica says where it publishes
# a health probe waits at most this many health_interval_s (a sweep ends with its slowest
# probe, and the next starts after it: one hung replica must not hold the others' probes)
HEALTH_TIMEOUT_INTERVALS = 4


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    # workers > 1: a worker whose event loop sends its parent no heartbeat for this long is
    # killed and replaced (router/service/supervisor.py); 0: never
    worker_hang_s: float = 30.0
    # workers > 1: "reuseport": each worker binds the port (SO_REUSEPORT, one accept queue
    # each); "shared": the parent binds it once, every worker accepts from that one queue
    listener: str = "reuseport"
    # workers > 1: how often each takes the others' in-flight load (load_share.py); 0: never
    load_share_interval_s: float = 0.025
    # with redis_url: pods share in-flight load through Redis (pod_exchange.py, docs/pods.md)
    pods_exchange: str = "stream"  # stream (push on change) | hash (poll) | off
    pods_exchange_interval_s: float = 0.005  # stream: change check; hash: poll period
    pods_stale_s: float = 1.0  # a pod silent this long stops counting
    pod_name: str | None = None  # default <hostname>:<port>
    max_body_mb: float = 64.0  # a 1M-token prompt is 4-8 MB of JSON
    admin_token: str | None = None
    debug_header: bool = False
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 3600.0
    first_byte_timeout_s: float = 600.0
    max_retries: int = 2
    retry_after_s: int = 1
    unhealthy_cooldown_s: float = 5.0
    health_interval_s: float = 1.0  # active probes of replicas' /health; 0: none
    # a probe unanswered this long marks the replica down; <= HEALTH_TIMEOUT_INTERVALS x interval
    health_timeout_s: float = 1.0
    # reliability (router/service/retry.py, router/core/outliers.py, docs/operations.md)
    first_byte_min_s: float = 10.0  # the first-byte deadline: factor x predicted, >= this
    first_byte_factor: float = 4.0  # ... and <= first_byte_timeout_s
    retry_budget_ratio: float = 0.2  # retries add at most this share of the last 10 s' requests
    retry_budget_min: int = 20  # ... plus this many
    outlier_detection: bool = True
    outlier_consecutive_failures: int = 3
    outlier_base_ejection_s: float = 2.0  # the n-th ejection in a row lasts n x this
    outlier_max_ejection_s: float = 60.0
    outlier_max_ejected_share: float = 0.5  # of a model's replicas (at least one)
    outlier_latency_factor: float = 5.0  # first byte this far past the peers' median ...
    outlier_latency_min_s: float = 1.0  # ... and past its prediction by this long: ejected
    # front-end connection limits (router/service/fast_server.py)
    header_timeout_s: float = 15.0  # a request's line and headers must arrive within this
    body_timeout_s: float = 60.0  # longest wait between two pieces of a request body
    keep_alive_timeout_s: float = 30.0  # an idle connection is closed after this
    send_timeout_s: float = 60.0  # a client taking no byte of its answer this long: aborted
    max_connections: int = 0  # per process, answered 503 beyond; 0: 80% of the fd limit
    engine_metrics_interval_s: float = 1.0  # scrape of replicas with metrics_url
    seed: int = 0
    decisions_kept: int = 256
    pool_per_replica: int = 256
    log_level: str = "info"
    # obsolete: the router serves its port with one HTTP server (router/service/fast_server.py);
    # "aiohttp", which chose another, is accepted with a warning (docs/configuration.md)
    http_engine: str = "fast"
    # security and reliability (router/service/security.py, docs/operations.md)
    api_keys: str | None = None  # comma-separated client keys; None: no key required
    api_keys_file: str | None = None  # one key per line
    max_concurrent_per_key: int = 0  # 0: unlimited; per client address without keys
    # service classes of API keys (comma-separated) for SLO-aware admission
    # (router/service/admission.py); other keys are "default"
    priority_keys: str | None = None
    flex_keys: str | None = None
    max_header_kb: float = 32.0  # total request header block; 0: unlimited
    max_prompt_tokens: int = 0  # 0: only the models' context_length applies
    shutdown_timeout_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    redis_url: str | None = None  # shared index: follow the Redis store (docs/redis.md)
    # route to the replicas publishers register in Redis too (None: yes when redis_url is set);
    # statically configured replicas always stay and win over a registration of the same name
    discover_replicas: bool | None = None
    redis_key_prefix: str = "kvr"
    redis_stream_shards: int = 8
    # with redis_url: stored Responses API ids are shared with the other pods through Redis,
    # each kept this long (router/service/response_share.py); 0: not shared
    response_ids_ttl_s: float = 86400.0
    # Redis came back empty: how long a known replica stays while its publisher registers
    # again (the publishers' lease TTL, --lease-ttl)
    redis_lost_grace_s: float = 10.0
    # hex master secret: accept only change entries signed by the replica they name
    # (docs/redis.md "Signed change entries"); None: no signature checks
    redis_signing_master: str | None = None
    # gRPC beside HTTP (router/rpc, docs/grpc.md); grpc_port None: off, 0: any free port
    grpc_port: int | None = None
    grpc_host: str | None = None  # default: the HTTP host
    # bearer token of gateways and publishers: Router and Index calls (Router calls also take
    # the client keys, held to their per-key limits; a grpc_token call is not limited)
    grpc_token: str | None = None
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    grpc_max_message_mb: float = 16.0
    # Live-traffic recording for offline replay (router/recorder.py, docs/tuning.md)
    record_path: str | None = None  # rotating Mooncake-compatible JSONL; None: off
    record_max_mb: float = 256.0
    record_backups: int = 5
    record_key: str | None = None  # secret for fleet-consistent ids; None: <path>.key
    # Speculative index entries (approximate mode, event lag) are capped at this many block
    # names; beyond it those soonest to expire go first, whatever their TTL (bounds router
    # memory; router/core/index.py PrefixIndex).
    max_speculative_blocks: int = 1_000_000
    # Live KV-event batches a subscription to an engine's ZMQ endpoint buffers before its
    # handler takes them; beyond it they are dropped and refilled from the engine's replay
    # socket, or counted lost (router/events/backlog.py, docs/engines.md)
    max_event_backlog_mb: float = 64.0
    # Byte-identical request bodies (parallel sampling, retries) reuse the first one's prompt
    # processing (router/service/body_memo.py); 0: off
    body_memo_mb: float = 16.0


@dataclass(slots=True, frozen=True)
class ReplicaSettings:
    """One statically configured replica; ``dp_ranks`` > 1 makes one schedulable key per rank
    (requests carry ``X-data-parallel-rank``)."""

    url: str
    model: str
    name: str
    rack: str | None = None
    region: str | None = None
    dp_ranks: int = 1
    # prefill / decode / both: its part under prefill/decode disaggregation (docs/pd.md)
    role: str = "both"
    # Single-router mode without Redis: the router follows the engine's ZMQ KV events itself.
    # engine KV-event PUB endpoint, e.g. tcp://10.0.0.7:5557; "auto": asked of the replica
    # (vLLM's GET /kv_event_sources, router/events/discovery.py)
    zmq: str | None = None
    zmq_replay: str | None = None  # its replay ROUTER endpoint (fills sequence gaps)
    # The engine's Prometheus page, scraped by the router itself for load and prefix-cache
    # counters (without Redis there is no publisher to do it), e.g. http://10.0.0.7:8000/metrics
    metrics_url: str | None = None


DEFAULT_POLICY = "ours"


@dataclass(slots=True, frozen=True)
class ModelSettings:
    name: str
    policy: str = DEFAULT_POLICY
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    context_length: int | None = None
    tokenizer: str | None = None  # model directory (tokenizer.json or tiktoken BPE + config)
    bpe_file: str | None = None
    pattern: str | None = None
    num_reserved: int | None = None
    chat_template: str | None = None  # file overriding the directory's template
    # vLLM's --chat-template-content-format: auto (from the template), string or openai
    chat_template_content_format: str = "auto"
    # vLLM's --default-chat-template-kwargs: under every request's chat_template_kwargs
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's --reasoning-effort-map: a request's reasoning_effort rewritten before the template
    reasoning_effort_map: Mapping[str, str] = field(default_factory=dict)
    # vLLM's --exclude-tools-when-tool-choice-none: no tools in the prompt of a request whose
    # tool_choice is "none" (chat, and the Messages / Responses APIs' chat conversions)
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's --enable-prompt-embeds: its template step tokenizes every chat (no BOS from a
    # request's add_special_tokens; router/tokenize/request_fields.py tokenizes_in_template)
    enable_prompt_embeds: bool = False
    # vLLM's --default-mm-loras keys (and any other adapter loaded under a content part's
    # type name): a chat request naming exactly one of them by a part type is served with
    # that adapter, whose blocks are keyed with it (router/tokenize/keying.py mm_lora)
    default_mm_loras: tuple[str, ...] = ()
    # the model is a LoRA adapter the engines serve on this base model (vLLM's --lora-modules
    # name): its replica entries index only blocks stored with the adapter from the start;
    # None: learned from the first such block each engine publishes (router/events/reblock.py)
    lora_base: str | None = None
    # vLLM's --anthropic-disabled-thinking-effort: the reasoning_effort of a Messages API body
    # with thinking disabled / between_tools; "auto": vLLM's probe of the chat template
    # (router/tokenize/anthropic.py)
    anthropic_disabled_thinking_effort: str = "auto"
    # "engine": prompts rendered by the engine's render endpoints (router/service/render.py)
    render: str = "local"
    render_url: str | None = None  # a renderer's base URL; None: the model's replicas
    render_timeout_s: float = 5.0
    render_api_key: str | None = None  # bearer token for the render endpoints
    cache_mb: float = 256.0  # incremental tokenization cache
    chars_per_token: float = 4.0  # approximate mode
    # the BOS before a prompt encoded with special tokens (a completion's, by default); None:
    # as the engine's tokenizer adds it (router.tokenize.tokenizers.adds_bos)
    add_bos_to_completions: bool | None = None
    # [models.NAME.images]: image placeholders and vLLM's image hash (router/tokenize/multimodal)
    images: ImageSettings | None = None
    # [models.NAME.slo]: the TTFT / TPOT targets ``ours`` routes for and the SLO metrics count
    slo: SloTargets = field(default_factory=SloTargets)
    # [models.NAME.pd]: prefill/decode disaggregation (None: off)
    pd: PdSetup | None = None
    # [models.NAME.admission] with enabled = true: SLO-aware admission (None: off)
    admission: AdmissionSettings | None = None


@dataclass(slots=True, frozen=True)
class SloSettings:
    """``[models.NAME.slo]`` as written: a TTFT tier table, or one TTFT target for every
    prompt, and the TPOT target (seconds); unset halves keep router.core.slo's defaults."""

    ttft_tiers: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None

    def targets(self) -> SloTargets:
        """Raises ValueError where both TTFT forms are set: one would silently win."""
        if self.ttft_s is not None and self.ttft_tiers is not None:
            raise ValueError(
                "ttft_s and ttft_tiers are both set; set one (ttft_s: one target for every "
                "prompt; ttft_tiers: a target by prompt length)"
            )
        tiers = parse_tiers(self.ttft_tiers) if self.ttft_tiers else DEFAULT_TIERS
        if self.ttft_s is not None:
            tiers = (SloTier(None, self.ttft_s),)
        return SloTargets(tiers, DEFAULT_TPOT_S if self.tpot_s is None else self.tpot_s)


@dataclass(slots=True, frozen=True)
class Settings:
    server: ServerSettings = field(default_factory=ServerSettings)
    replicas: tuple[ReplicaSettings, ...] = ()
    models: Mapping[str, ModelSettings] = field(default_factory=dict)
    # Hooks for parts built elsewhere (index event sources, dynamic registries): async context
    # factories run by the app's cleanup_ctx with the app as argument. Not read from files.
    background: tuple[Callable[..., Any], ...] = ()

    def model(self, name: str) -> ModelSettings:
        """Settings of ``name`` (defaults for a model only named by replicas)."""
        return self.models.get(name) or ModelSettings(name=name)


# Settings that hold a credential: a configuration error names them but never shows their
# value (router/service/config_tables.py checked); the log filter masks their values
# (router/service/security.py server_secrets).
SECRET_KEYS = frozenset(
    (
        "admin_token",
        "api_keys",
        "grpc_token",
        "redis_signing_master",
        "record_key",
        "render_api_key",
    )
)

# The keys of a [models.NAME] table that ``kvrouter sim tune`` writes (sim/tuned.py) and
# ``serve --policy-file`` reads; a policy file's other keys are refused (config.py).
TUNED_KEYS = ("policy", "policy_params", "block_size", "hybrid", "state_interval_blocks")

# The [models.NAME] keys that go to RoutingSettings (router/core/routing_settings.py).
ROUTING_KEYS = (
    "block_size",
    "hybrid",
    "state_interval_blocks",
    "speculative_ttl_s",
    "speculate_sessions",
    "session_ttl_s",
    "reuse_window_s",
    "engine_block_size",
    "eagle",
)


# Field types that a compiled router/core (``make compile``, mypyc) reports as ``type``: its
# classes keep only the annotations they can check. tests/test_config_env.py checks these
# against the source's annotations.
LOST_WHEN_COMPILED = {
    ("BusyThresholds", "max_in_flight"): "int | None",
    ("BusyThresholds", "max_queued_prefill_tokens"): "int | None",
    ("BusyThresholds", "max_kv_usage"): "float | None",
    ("RoutingSettings", "hybrid"): "bool | None",
    ("RoutingSettings", "speculative_ttl_s"): "float | None",
}


def declared_kind(cls: type, name: str) -> str:
    """The declared type of field ``name`` of dataclass ``cls``, as text (``"int | None"``)."""
    hint = next(f.type for f in fields(cls) if f.name == name)
    if hint is type:
        return LOST_WHEN_COMPILED[(cls.__name__, name)]
    return hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))
