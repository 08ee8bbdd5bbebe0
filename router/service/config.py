"""The service's typed settings tree, read once at start-up from a file (TOML or YAML), the
environment (``KVROUTER_*``) and command-line flags, in that order of precedence (flags win).

File layout (every section optional; see docs/configuration.md)::

    [server]       host, port, workers, max_body_mb, admin_token, debug_header, timeouts,
                   max_retries, retry_after_s, seed, decisions_kept, health_interval_s, ...
    [[replicas]]   url, model, name, rack, region, role, dp_ranks
    [models.NAME]  policy, block_size, hybrid, state_interval_blocks, speculative_ttl_s,
                   speculate_sessions,
                   context_length, tokenizer, bpe_file, pattern, chat_template, cache_mb,
                   chars_per_token, add_bos_to_completions
    [models.NAME.policy_params]   keys of router.core.policies.make_policy (``cost`` nested)
    [models.NAME.busy]            max_in_flight, max_queued_prefill_tokens, max_kv_usage,
                                  reject_when_all_busy
    [models.NAME.images]          placeholder, token, tokens, min_pixels, max_pixels,
                                  model_id, hash_algorithm (router/tokenize/multimodal.py)
    [models.NAME.pd]              mode (off/always/auto) and the other keys of
                                  router.core.disagg.PdSetup (docs/pd.md)
    [models.NAME.slo]             ttft_tiers ("8192:2,32768:5,*:60"), ttft_s (one target for
                                  every prompt), tpot_s (router/core/slo.py)
    [models.NAME.admission]       enabled, and router/core/admission.py's knobs (file only)

The simulator's tuned-policy file (``[models.NAME] policy / block_size / hybrid /
state_interval_blocks / policy_params``, sim/tuned.py) is the same shape, so it can be passed
as the config file or merged with ``--policy-file``.
Environment: ``KVROUTER_CONFIG`` (file path), ``KVROUTER_SERVER__<KEY>`` and
``KVROUTER_MODELS__<NAME>__<KEY>`` for any scalar (e.g. ``KVROUTER_SERVER__PORT=9000``,
``KVROUTER_MODELS__KIMI__POLICY=ours``), values converted by the setting's declared type,
``KVROUTER_REPLICAS`` (``model=url,model=url``) and ``KVROUTER_ADMIN_TOKEN``; other
``KVROUTER_*`` variables belong to other components and are ignored (``env_overrides``): the
publisher's ``KVROUTER_PUBLISHER__<FLAG>`` follow the same convention (router/publisher/env.py).
Replica URLs are plain ``http://host:port`` (router/service/replica_url.py). A model with a
tokenizer directory and no ``context_length`` takes its ``model_max_length``
(``tokenizer_max_length``). Errors raise ConfigError naming the key (or variable).
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from router.core.admission import AdmissionSettings
from router.core.disagg import PdSetup, Role
from router.core.errors import ConfigError
from router.core.policies import POLICY_NAMES, make_policy
from router.core.routing import BusyThresholds, RoutingSettings
from router.core.slo import DEFAULT_TIERS, DEFAULT_TPOT_S, SloTargets, SloTier, parse_tiers
from router.events.endpoints import engine_endpoints
from router.service.replica_url import ReplicaUrl
from router.tokenize.multimodal import ImageSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MiB = 2**20
_Table = TypeVar("_Table", bound="DataclassInstance")


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
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
    health_timeout_s: float = 1.0  # a probe unanswered this long marks the replica down
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
    # hex master secret: accept only change entries signed by the replica they name
    # (docs/redis.md "Signed change entries"); None: no signature checks
    redis_signing_master: str | None = None
    # gRPC beside HTTP (router/rpc, docs/grpc.md); grpc_port None: off, 0: any free port
    grpc_port: int | None = None
    grpc_host: str | None = None  # default: the HTTP host
    grpc_token: str | None = None  # bearer token for Router/Index calls
    grpc_tls_cert: str | None = None
    grpc_tls_key: str | None = None
    grpc_max_message_mb: float = 16.0
    # Live-traffic recording for offline replay (router/recorder.py, docs/tuning.md)
    record_path: str | None = None  # rotating Mooncake-compatible JSONL; None: off
    record_max_mb: float = 256.0
    record_backups: int = 5
    record_key: str | None = None  # secret for fleet-consistent ids; None: <path>.key
    # Speculative index entries (approximate mode, event lag) are capped at this many block
    # names; beyond it the oldest go first, whatever their TTL (bounds router memory).
    max_speculative_blocks: int = 1_000_000
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
    zmq: str | None = None  # engine KV-event PUB endpoint, e.g. tcp://10.0.0.7:5557
    zmq_replay: str | None = None  # its replay ROUTER endpoint (fills sequence gaps)
    # The engine's Prometheus page, scraped by the router itself for load and prefix-cache
    # counters (without Redis there is no publisher to do it), e.g. http://10.0.0.7:8000/metrics
    metrics_url: str | None = None


@dataclass(slots=True, frozen=True)
class ModelSettings:
    name: str
    policy: str = "ours"
    policy_params: Mapping[str, Any] = field(default_factory=dict)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    context_length: int | None = None
    tokenizer: str | None = None  # model directory (tokenizer.json or tiktoken BPE + config)
    bpe_file: str | None = None
    pattern: str | None = None
    num_reserved: int | None = None
    chat_template: str | None = None  # file overriding the directory's template
    cache_mb: float = 256.0  # incremental tokenization cache
    chars_per_token: float = 4.0  # approximate mode
    add_bos_to_completions: bool = False
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


# ---------------------------------------------------------------------------- parsing


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw) or {}
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except Exception as exc:  # yaml and toml raise their own error types
        raise ConfigError(f"cannot parse config file {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table/mapping at the top level")
    return data


def _scalar(text: str) -> Any:
    """An environment value: TOML scalar syntax when it parses (numbers, booleans, quoted
    strings, arrays), else the raw string. Only for settings without a declared type
    (``policy_params``, whose keys depend on the policy)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


_ENV_PREFIX = "KVROUTER_"
# The file's top-level tables (Settings.background is built in code, never read).
_SECTIONS = ("server", "replicas", "models")
_UNTYPED = "policy_params"  # its values are TOML scalars (see _scalar)


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


def _kind(cls: type, name: str) -> str:
    """The declared type of field ``name`` of dataclass ``cls``, as text (``"int | None"``)."""
    hint = next(f.type for f in fields(cls) if f.name == name)
    if hint is type:
        return LOST_WHEN_COMPILED[(cls.__name__, name)]
    return hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))


def _model_key_kinds() -> dict[str, str]:
    """Scalar keys of a ``[models.NAME]`` table and their declared types."""
    kinds = {
        f.name: _kind(ModelSettings, f.name)
        for f in fields(ModelSettings)
        if f.name not in ("name", "routing", "policy_params", "images", "slo", "admission")
    }
    kinds.update({k: _kind(RoutingSettings, k) for k in _ROUTING_KEYS})
    return kinds


def _field_kind(kinds: Mapping[str, str], key: str, var: str, where: str) -> str:
    kind = kinds.get(key)
    if kind is None:
        raise ConfigError(
            f"{var}: {where}: unknown key {key!r} (known: {', '.join(sorted(kinds))})"
        )
    return kind


def _env_path(var: str) -> list[str] | None:
    """The settings path ``var`` overrides, or None when it is not a config variable.

    ``KVROUTER_<SECTION>__<KEY>[__<KEY>]`` with SECTION one of the file's top-level tables,
    plus the alias ``KVROUTER_ADMIN_TOKEN``; other ``KVROUTER_*`` names (``KVROUTER_DEBUG``,
    ``KVROUTER_PUBLISHER__<FLAG>``, ...) belong to other components. A name
    that is a known server key behind a single underscore (``KVROUTER_SERVER_PORT``) is a
    ConfigError rather than silently ignored."""
    if not var.startswith(_ENV_PREFIX) or var == "KVROUTER_CONFIG":
        return None
    path = var[len(_ENV_PREFIX) :].lower().split("__")
    if path == ["admin_token"]:
        return ["server", "admin_token"]
    if path[0] in _SECTIONS:
        return path
    head, _, rest = path[0].partition("_")
    if head == "server" and len(path) == 1 and rest in {f.name for f in fields(ServerSettings)}:
        raise ConfigError(f"{var}: not read; did you mean KVROUTER_SERVER__{rest.upper()}?")
    if head == "models" and rest and len(path) > 1:
        raise ConfigError(f"{var}: not read; write KVROUTER_MODELS__<NAME>__<KEY>")
    return None


def _env_kind(var: str, path: Sequence[str]) -> str:
    """The declared type of the setting at ``path`` (``_UNTYPED`` for policy parameters);
    ConfigError naming ``var`` for a key the section does not have."""
    section, *keys = path
    if section == "replicas":
        raise ConfigError(f"{var}: replicas are set as a whole: KVROUTER_REPLICAS=MODEL=URL,...")
    if section == "server":
        if not keys or not keys[0]:
            raise ConfigError(f"{var}: name a key: KVROUTER_SERVER__<KEY>")
        kinds = {f.name: _kind(ServerSettings, f.name) for f in fields(ServerSettings)}
        kind = _field_kind(kinds, keys[0], var, "server")
        if len(keys) > 1:
            raise ConfigError(f"{var}: server.{keys[0]} is not a table")
        return kind
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"{var}: name a model and a key: KVROUTER_MODELS__<NAME>__<KEY>")
    name, key, *sub = keys
    where = f"models.{name}"
    if key == _UNTYPED:
        if not sub:
            raise ConfigError(
                f"{var}: {where}.{key} is a table: "
                f"KVROUTER_MODELS__{name.upper()}__POLICY_PARAMS__<KEY>"
            )
        return _UNTYPED
    tables: dict[str, type] = {"busy": BusyThresholds, "slo": SloSettings}
    if key in tables:
        if len(sub) != 1:
            raise ConfigError(
                f"{var}: {where}.{key} is a table: "
                f"KVROUTER_MODELS__{name.upper()}__{key.upper()}__<KEY>"
            )
        cls = tables[key]
        kinds = {f.name: _kind(cls, f.name) for f in fields(cls)}
        return _field_kind(kinds, sub[0], var, f"{where}.{key}")
    kind = _field_kind(_model_key_kinds(), key, var, where)
    if sub:
        raise ConfigError(f"{var}: {where}.{key} is not a table")
    return kind


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _env_value(var: str, where: str, kind: str, text: str) -> Any:
    """``text`` converted to the setting's declared ``kind``: str settings keep the raw text
    (``"12345"``, ``"true"`` stay strings); int, float and bool settings must parse as one
    (bool: true/false, 1/0, yes/no, on/off, any case). ConfigError names ``var``."""
    if kind == _UNTYPED:
        return _scalar(text)
    base = {part.strip() for part in kind.split("|")} - {"None"}
    try:
        if base == {"str"}:
            return text
        if base == {"int"}:
            return int(text.strip())
        if base == {"float"}:
            return float(text.strip())
        if base == {"bool"} and text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
    except ValueError:
        pass
    expected = {"int": "an integer", "float": "a number", "bool": "true or false"}
    if len(base) == 1 and (wanted := expected.get(next(iter(base)))):
        raise ConfigError(f"{var}: {where} expects {wanted}, got {text!r}")
    raise ConfigError(f"{var}: {where} ({kind}) cannot be set from the environment")


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config overrides among ``environ``: ``KVROUTER_A__B__C=value`` ->
    ``{"a": {"b": {"c": value}}}`` (names lower-cased, so model names too).

    Only variables that name a setting are read (see ``_env_path``): ``KVROUTER_SERVER__<KEY>``,
    ``KVROUTER_MODELS__<NAME>__<KEY>`` (``__BUSY__<KEY>``, ``__POLICY_PARAMS__<KEY>[__<KEY>]``),
    ``KVROUTER_REPLICAS`` (``model=url,...``) and ``KVROUTER_ADMIN_TOKEN``; any other
    ``KVROUTER_*`` variable is left to the component that reads it. An unknown key inside one of
    those sections, or a value that does not parse as its setting's declared type, is a
    ConfigError naming the variable."""
    out: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    for var, text in sorted(environ.items()):
        path = _env_path(var)
        if path is None:
            continue
        if path == ["replicas"]:
            out["replicas"] = parse_replica_list(text.split(","))
            continue
        where = ".".join(path)
        value = _env_value(var, where, _env_kind(var, path), text)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{var}: conflicts with another KVROUTER_ variable")
        if isinstance(node.get(path[-1]), dict):
            raise ConfigError(f"{var}: conflicts with another KVROUTER_ variable")
        if path[-1] in node and node[path[-1]] != value:
            other = origin[tuple(path)]
            raise ConfigError(f"{other} and {var} both set {where}, differently; set one")
        node[path[-1]] = value
        origin[tuple(path)] = var
    return out


def parse_replica_list(items: Sequence[str]) -> list[dict[str, Any]]:
    """``model=url`` strings (from flags or the environment) as replica tables."""
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        model, sep, url = item.partition("=")
        if not sep or not model or not url:
            raise ConfigError(f"replica {item!r} must be written MODEL=URL")
        out.append({"model": model.strip(), "url": url.strip()})
    return out


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of tables; ``extra`` wins; arrays (replicas) are replaced, not appended."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def _typed(
    cls: type[_Table], table: Mapping[str, Any], where: str, skip: Sequence[str] = ()
) -> _Table:
    """Build dataclass ``cls`` from ``table`` checking names and scalar types."""
    return cls(**_checked(cls, table, where, skip))


def _checked(
    cls: type, table: Mapping[str, Any], where: str, skip: Sequence[str] = ()
) -> dict[str, Any]:
    """``table`` as keyword arguments of dataclass ``cls``: names known, scalars of their
    declared types (floats from integers too; None where the type allows it)."""
    known = {f.name for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key in skip:
            continue
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        kind = _kind(cls, key)
        ok = True
        if value is None:
            ok = "None" in kind
        elif kind.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind.startswith("float"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif kind.startswith("bool"):
            ok = isinstance(value, bool)
        elif kind.startswith("str"):
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{where}.{key}: expected {kind}, got {value!r}")
        kwargs[key] = value
    return kwargs


def _check_pods(server: ServerSettings) -> None:
    if server.pods_exchange not in ("stream", "hash", "off"):
        raise ConfigError(f"server.pods_exchange: {server.pods_exchange!r} is not stream/hash/off")
    for name in ("pods_exchange_interval_s", "pods_stale_s"):
        v = getattr(server, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"server.{name}: must be a finite number > 0")


def _admission(table: Any, where: str) -> AdmissionSettings | None:
    """``[models.NAME.admission]``: ``enabled`` (default false) and the knobs of
    router.core.admission.AdmissionSettings (per-class knobs as 3-element arrays)."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table")
    enabled = table.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}.enabled: expected true or false")
    knobs: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
    knobs.pop("enabled", None)
    try:
        settings = AdmissionSettings(**knobs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return settings if enabled else None


def _replica(i: int, table: Any) -> ReplicaSettings:
    """One ``[[replicas]]`` table; its url is checked by :class:`ReplicaUrl` and stored as
    ``http://host[:port]`` (scheme lower-case, no trailing ``/``): what the proxy expects."""
    where = f"replicas[{i}]"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table with url and model")
    for key in ("url", "model"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise ConfigError(f"{where}: {key!r} is required (a non-empty string)")
    try:
        url = ReplicaUrl.parse(table["url"])
    except ValueError as exc:
        raise ConfigError(f"{where}.url: {exc}") from None
    table = {**table, "url": url.base}
    name = table.get("name") or url.netloc
    rep = _typed(ReplicaSettings, {**table, "name": name}, where)
    if rep.dp_ranks < 1:
        raise ConfigError(f"{where}.dp_ranks: must be >= 1")
    try:
        rep = replace(rep, role=Role.parse(rep.role).value)
    except ConfigError as exc:
        raise ConfigError(f"{where}.role: {exc}") from None
    if rep.zmq_replay and not rep.zmq:
        raise ConfigError(f"{where}.zmq_replay: needs zmq")
    if rep.zmq:
        try:  # rank N follows the engine's ports + N: they must exist
            engine_endpoints(
                [rep.zmq], [rep.zmq_replay] if rep.zmq_replay else [], range(rep.dp_ranks)
            )
        except ValueError as exc:
            raise ConfigError(f"{where}.zmq: {exc}") from None
    if rep.metrics_url is not None:
        m = urlsplit(rep.metrics_url)
        if m.scheme not in ("http", "https") or not m.netloc:
            raise ConfigError(f"{where}.metrics_url: {rep.metrics_url!r} is not an http(s) URL")
    return rep


_ROUTING_KEYS = (
    "block_size",
    "hybrid",
    "state_interval_blocks",
    "speculative_ttl_s",
    "speculate_sessions",
    "session_ttl_s",
    "reuse_window_s",
)


def _model(name: str, table: Any) -> ModelSettings:
    where = f"models.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table")
    routing_kw = {k: table[k] for k in _ROUTING_KEYS if k in table}
    busy_tab = table.get("busy") or {}
    if not isinstance(busy_tab, Mapping):
        raise ConfigError(f"{where}.busy: must be a table")
    # router/core's dataclasses, type-checked here as the service's are (a compiled core
    # would refuse a wrong type with a TypeError, the pure one would carry it to routing)
    busy = BusyThresholds(**_checked(BusyThresholds, busy_tab, f"{where}.busy"))
    try:
        routing = RoutingSettings(busy=busy, **_checked(RoutingSettings, routing_kw, where))
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for key, kind in (("block_size", int), ("state_interval_blocks", int)):
        if not isinstance(getattr(routing, key), kind) or getattr(routing, key) < 0:
            raise ConfigError(f"{where}.{key}: expected a non-negative integer")
    if not routing.reuse_window_s > 0:
        raise ConfigError(f"{where}.reuse_window_s: expected a positive number of seconds")
    if routing.block_size <= 0:
        raise ConfigError(f"{where}.block_size: must be positive")
    if routing.hybrid is not None and not isinstance(routing.hybrid, bool):
        raise ConfigError(f"{where}.hybrid: expected true or false (omit it: learned)")
    params = table.get("policy_params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.policy_params: must be a table")
    skip = (*_ROUTING_KEYS, "busy", "policy_params", "images", "slo", "pd", "admission")
    rest = {k: v for k, v in table.items() if k not in skip}
    model = _typed(ModelSettings, {**rest, "name": name}, where)
    images_tab = table.get("images")
    if images_tab is not None:
        if not isinstance(images_tab, Mapping):
            raise ConfigError(f"{where}.images: must be a table")
        try:
            images = _typed(ImageSettings, images_tab, f"{where}.images")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.images: {exc}") from None
        model = replace(model, images=images)
    slo_tab = table.get("slo") or {}
    if not isinstance(slo_tab, Mapping):
        raise ConfigError(f"{where}.slo: must be a table")
    try:
        model = replace(model, slo=_typed(SloSettings, slo_tab, f"{where}.slo").targets())
    except ValueError as exc:
        raise ConfigError(f"{where}.slo: {exc}") from None
    pd_tab = table.get("pd")
    if pd_tab is not None:
        if not isinstance(pd_tab, Mapping):
            raise ConfigError(f"{where}.pd: must be a table")
        try:
            setup = PdSetup.from_mapping(pd_tab, model.slo.tpot_s)
        except ConfigError as exc:
            raise ConfigError(f"{where}.pd: {exc}") from None
        model = replace(model, pd=setup if setup.knobs.mode != "off" else None)
    model = replace(model, admission=_admission(table.get("admission"), f"{where}.admission"))
    if model.policy not in POLICY_NAMES:
        raise ConfigError(
            f"{where}.policy: unknown policy {model.policy!r}; choose one of "
            + ", ".join(POLICY_NAMES)
        )
    try:
        make_policy(model.policy, params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}.policy_params: {exc}") from None
    if model.context_length is not None and model.context_length <= 0:
        raise ConfigError(f"{where}.context_length: must be positive")
    context_length = model.context_length
    if context_length is None and model.tokenizer is not None:
        context_length = tokenizer_max_length(Path(model.tokenizer))
    out: ModelSettings = replace(
        model, routing=routing, policy_params=dict(params), context_length=context_length
    )
    return out


# HF writes a huge sentinel (int(1e30)) for "no known limit"; no real context is above this.
_MAX_SANE_CONTEXT = 2**31


def tokenizer_max_length(directory: Path) -> int | None:
    """``model_max_length`` of ``directory``'s ``tokenizer_config.json`` when it is a real
    context length (an integer, or integral float, in 1..2**31); None when the directory,
    the file or the key is missing or the value is HF's "unknown" sentinel. A file that is
    not a JSON object is a ConfigError (the tokenizer loader would refuse it too)."""
    if not directory.is_dir():
        return None  # reported by the tokenizer loader, with the model's key
    from router.tokenize.tokenizers import read_tokenizer_config

    value = read_tokenizer_config(directory).get("model_max_length")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if 1 <= value <= _MAX_SANE_CONTEXT else None


def build_settings(data: Mapping[str, Any]) -> Settings:
    """Validate a merged configuration mapping into :class:`Settings`."""
    unknown = set(data) - {"server", "replicas", "models"}
    if unknown:
        raise ConfigError(f"unknown top-level section(s): {', '.join(sorted(unknown))}")
    server_tab = data.get("server") or {}
    if not isinstance(server_tab, Mapping):
        raise ConfigError("server: must be a table")
    server = _typed(ServerSettings, server_tab, "server")
    if server.redis_signing_master is not None:
        try:
            if len(bytes.fromhex(server.redis_signing_master)) < 16:
                raise ValueError("shorter than 16 bytes")
        except ValueError as exc:
            raise ConfigError(f"server.redis_signing_master: not a hex secret ({exc})") from None
    if not 0 < server.port < 65536:
        raise ConfigError(f"server.port: {server.port} is not a TCP port")
    if server.http_engine not in ("aiohttp", "fast"):
        raise ConfigError(
            f"server.http_engine: {server.http_engine!r} is not one of 'aiohttp', 'fast'"
        )
    if server.http_engine == "aiohttp":
        logging.getLogger("kvrouter.config").warning(
            "server.http_engine = 'aiohttp' is obsolete and ignored: the router serves every "
            "route with its own HTTP server"
        )
    if server.workers < 1 or server.max_retries < 0 or server.max_body_mb <= 0:
        raise ConfigError("server: workers >= 1, max_retries >= 0 and max_body_mb > 0 required")
    if not (math.isfinite(server.load_share_interval_s) and server.load_share_interval_s >= 0):
        raise ConfigError("server.load_share_interval_s: must be a finite number >= 0 (0: off)")
    if server.engine_metrics_interval_s <= 0:
        raise ConfigError("server.engine_metrics_interval_s: must be > 0")
    _check_pods(server)
    if not math.isfinite(server.max_body_mb):
        raise ConfigError("server.max_body_mb: must be a finite number")
    if not (math.isfinite(server.body_memo_mb) and server.body_memo_mb >= 0):
        raise ConfigError("server.body_memo_mb: must be a finite number >= 0 (0: memo off)")
    raw_replicas = data.get("replicas") or []
    if not isinstance(raw_replicas, list):
        raise ConfigError("replicas: must be an array of tables ([[replicas]])")
    replicas = tuple(_replica(i, r) for i, r in enumerate(raw_replicas))
    names = [r.name for r in replicas]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"replicas: duplicate name(s) {', '.join(sorted(dupes))}")
    models_tab = data.get("models") or {}
    if not isinstance(models_tab, Mapping):
        raise ConfigError("models: must be a table of [models.NAME] tables")
    models = {name: _model(name, t) for name, t in models_tab.items()}
    return Settings(server=server, replicas=replicas, models=models)


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    policy_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """File (``path`` or ``$KVROUTER_CONFIG``) < tuned policy file < environment < overrides."""
    env = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    path = path or env.get("KVROUTER_CONFIG")
    if path:
        data = read_file(path)
    if policy_file:
        tuned = read_file(policy_file)
        data = merge(data, {"models": tuned.get("models") or {}})
    data = merge(data, env_overrides(env))
    if overrides:
        data = merge(data, overrides)
    return build_settings(data)
