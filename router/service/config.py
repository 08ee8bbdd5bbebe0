"""The service's typed settings tree, read once at start-up from a file (TOML or YAML), the
environment (``KVROUTER_*``) and command-line flags, in that order of precedence (flags win).

File layout (every section optional; see docs/configuration.md)::

    [server]       host, port, workers, max_body_mb, admin_token, debug_header, timeouts,
                   max_retries, retry_after_s, seed, decisions_kept, health_interval_s, ...
    [[replicas]]   url, model, name, rack, region, dp_ranks
    [models.NAME]  policy, block_size, hybrid, state_interval_blocks, speculative_ttl_s,
                   context_length, tokenizer, bpe_file, pattern, chat_template, cache_mb,
                   chars_per_token, add_bos_to_completions
    [models.NAME.policy_params]   keys of router.core.policies.make_policy (``cost`` nested)
    [models.NAME.busy]            max_in_flight, max_queued_prefill_tokens, max_kv_usage,
                                  reject_when_all_busy

The simulator's tuned-policy file (``[models.NAME] policy / block_size / policy_params``) is
the same shape, so it can be passed as the config file or merged with ``--policy-file``.
Environment: ``KVROUTER_CONFIG`` (file path), ``KVROUTER_<SECTION>__<KEY>`` for any scalar
(e.g. ``KVROUTER_SERVER__PORT=9000``, ``KVROUTER_MODELS__KIMI__POLICY=ours``) and
``KVROUTER_REPLICAS`` (``model=url,model=url``). Errors raise ConfigError naming the key.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from router.core.errors import ConfigError
from router.core.policies import POLICY_NAMES, make_policy
from router.core.routing import BusyThresholds, RoutingSettings

MiB = 2**20


@dataclass(slots=True, frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_body_mb: float = 64.0  # a 1M-token prompt is 4-8 MB of JSON
    admin_token: str | None = None
    debug_header: bool = False
    connect_timeout_s: float = 3.0
    request_timeout_s: float = 3600.0
    first_byte_timeout_s: float = 600.0
    max_retries: int = 2
    retry_after_s: int = 1
    unhealthy_cooldown_s: float = 5.0
    health_interval_s: float = 0.0  # 0: no active probing of replicas' /health
    engine_metrics_interval_s: float = 1.0  # scrape of replicas with metrics_url
    seed: int = 0
    decisions_kept: int = 256
    pool_per_replica: int = 256
    log_level: str = "info"
    # "aiohttp": every endpoint on the aiohttp app; "fast": the two hot POST endpoints on a raw
    # asyncio/httptools server, the rest relayed to the aiohttp app (router/service/fast_server.py)
    http_engine: str = "fast"
    # security and reliability (router/service/security.py, docs/operations.md)
    api_keys: str | None = None  # comma-separated client keys; None: no key required
    api_keys_file: str | None = None  # one key per line
    max_concurrent_per_key: int = 0  # 0: unlimited; per client address without keys
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
    strings, arrays), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVROUTER_A__B__C=value`` -> ``{"a": {"b": {"c": value}}}`` (keys lower-cased)."""
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith("KVROUTER_") or key == "KVROUTER_CONFIG":
            continue
        path = [p.lower() for p in key[len("KVROUTER_") :].split("__")]
        if path == ["replicas"]:
            out["replicas"] = parse_replica_list(value.split(","))
            continue
        if path == ["admin_token"]:
            path = ["server", "admin_token"]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with another KVROUTER_ variable")
        node[path[-1]] = _scalar(value) if path[-1] != "admin_token" else value
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


def _typed(cls: type, table: Mapping[str, Any], where: str, skip: Sequence[str] = ()) -> Any:
    """Build dataclass ``cls`` from ``table`` checking names and scalar types."""
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in table.items():
        if key in skip:
            continue
        f = known.get(key)
        if f is None:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        kind = str(f.type)
        ok = True
        if kind.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind.startswith("float"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif kind.startswith("bool"):
            ok = isinstance(value, bool)
        elif kind.startswith("str"):
            ok = isinstance(value, str) or (value is None and "None" in kind)
        if not ok:
            raise ConfigError(f"{where}.{key}: expected {kind}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def _replica(i: int, table: Any) -> ReplicaSettings:
    where = f"replicas[{i}]"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table with url and model")
    for key in ("url", "model"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise ConfigError(f"{where}: {key!r} is required (a non-empty string)")
    parts = urlsplit(table["url"])
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"{where}.url: {table['url']!r} is not an http(s) URL")
    name = table.get("name") or parts.netloc
    rep = _typed(ReplicaSettings, {**table, "name": name}, where)
    if rep.dp_ranks < 1:
        raise ConfigError(f"{where}.dp_ranks: must be >= 1")
    if rep.metrics_url is not None:
        m = urlsplit(rep.metrics_url)
        if m.scheme not in ("http", "https") or not m.netloc:
            raise ConfigError(f"{where}.metrics_url: {rep.metrics_url!r} is not an http(s) URL")
    return rep  # type: ignore[no-any-return]


_ROUTING_KEYS = ("block_size", "hybrid", "state_interval_blocks", "speculative_ttl_s")


def _model(name: str, table: Any) -> ModelSettings:
    where = f"models.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table")
    routing_kw = {k: table[k] for k in _ROUTING_KEYS if k in table}
    busy_tab = table.get("busy") or {}
    if not isinstance(busy_tab, Mapping):
        raise ConfigError(f"{where}.busy: must be a table")
    try:
        busy = BusyThresholds(**busy_tab)
        routing = RoutingSettings(busy=busy, **routing_kw)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for key, kind in (("block_size", int), ("state_interval_blocks", int)):
        if not isinstance(getattr(routing, key), kind) or getattr(routing, key) < 0:
            raise ConfigError(f"{where}.{key}: expected a non-negative integer")
    if routing.block_size <= 0:
        raise ConfigError(f"{where}.block_size: must be positive")
    params = table.get("policy_params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.policy_params: must be a table")
    rest = {k: v for k, v in table.items() if k not in (*_ROUTING_KEYS, "busy", "policy_params")}
    model = _typed(ModelSettings, {**rest, "name": name}, where)
    if model.policy not in POLICY_NAMES:
        raise ConfigError(
            f"{where}.policy: unknown policy {model.policy!r}; choose one of "
            + ", ".join(POLICY_NAMES)
        )
    try:
        make_policy(model.policy, params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}.policy_params: {exc}") from None
    if routing.hybrid and routing.state_interval_blocks <= 0 and routing.speculative_ttl_s > 0:
        raise ConfigError(f"{where}: a hybrid model needs state_interval_blocks >= 1")
    if model.context_length is not None and model.context_length <= 0:
        raise ConfigError(f"{where}.context_length: must be positive")
    from dataclasses import replace

    out: ModelSettings = replace(model, routing=routing, policy_params=dict(params))
    return out


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
    if server.workers < 1 or server.max_retries < 0 or server.max_body_mb <= 0:
        raise ConfigError("server: workers >= 1, max_retries >= 0 and max_body_mb > 0 required")
    if server.engine_metrics_interval_s <= 0:
        raise ConfigError("server.engine_metrics_interval_s: must be > 0")
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
