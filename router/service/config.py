"""Builds the service's settings tree (router/service/settings.py), read once at start-up
from a file (TOML or YAML), the environment (``KVROUTER_*``, router/service/config_env.py)
and command-line flags, in that order of precedence (flags win).

File layout (every section optional; see docs/configuration.md)::

    [server]       host, port, workers, max_body_mb, admin_token, debug_header, timeouts,
                   max_retries, retry_after_s, seed, decisions_kept, health_interval_s, ...
    [[replicas]]   url, model, name, rack, region, role, dp_ranks
    [models.NAME]  per-model tables and their sub-tables (router/service/config_models.py)

The simulator's tuned-policy file (``[models.NAME] policy / block_size / hybrid /
state_interval_blocks / policy_params``, sim/tuned.py) is the same shape, so it can be passed
as the config file or merged with ``--policy-file``.
Environment: ``KVROUTER_CONFIG`` names the file; the other variables are read by
``config_env.env_overrides``.
Replica URLs are plain ``http://host:port`` (router/service/replica_url.py).
Errors raise ConfigError naming the key (or variable). Reading a file, layering tables and
checking a table's keys and types: router/service/config_tables.py.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from router.core.disagg import Role
from router.core.errors import ConfigError
from router.events.endpoints import engine_endpoints
from router.rpc.settings import MAX_MESSAGE_MB
from router.service.config_env import env_overrides
from router.service.config_models import model_settings
from router.service.config_tables import merge, read_file, refuse_empty, table_or_empty, typed
from router.service.http_connection import MAX_HEAD_BYTES
from router.service.replica_url import ReplicaUrl
from router.service.security import read_api_keys
from router.service.settings import (
    DEFAULT_POLICY,
    HEALTH_TIMEOUT_INTERVALS,
    TUNED_KEYS,
    ZMQ_AUTO,
    ReplicaSettings,
    ServerSettings,
    Settings,
)
from router.store.base import MAX_DP_RANKS
from router.store.codec import master_secret
from router.store.schema import check_redis_url, prefix_problem, shards_problem


def _check_pods(server: ServerSettings) -> None:
    if server.pods_exchange not in ("stream", "hash", "off"):
        raise ConfigError(f"server.pods_exchange: {server.pods_exchange!r} is not stream/hash/off")
    for name in ("pods_exchange_interval_s", "pods_stale_s", "redis_lost_grace_s"):
        v = getattr(server, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"server.{name}: must be a finite number > 0")
    interval, stale = server.pods_exchange_interval_s, server.pods_stale_s
    if server.pods_exchange != "off" and interval > stale / 4:
        # a member sends at most once an interval, its heartbeat every stale/4: slower, the
        # others drop its view as silent while its requests are still in flight (docs/pods.md)
        raise ConfigError(
            f"server.pods_exchange_interval_s: {interval:g} is more than a quarter of "
            f"server.pods_stale_s ({stale:g}): the other pods would stop counting this "
            "one's requests between its snapshots"
        )


# [server] numbers and their ranges (others: _check_pods, build_settings)
_POSITIVE = (  # finite, > 0
    "connect_timeout_s",
    "request_timeout_s",
    "first_byte_timeout_s",
    "first_byte_min_s",
    "first_byte_factor",
    "health_timeout_s",
    "engine_metrics_interval_s",
    "outlier_base_ejection_s",
    "outlier_max_ejection_s",
    "outlier_latency_factor",
    "grpc_max_message_mb",
    "record_max_mb",
    "max_event_backlog_mb",
)
_NON_NEGATIVE = (  # finite, >= 0 (0: off or automatic, see ServerSettings)
    "health_interval_s",
    "unhealthy_cooldown_s",
    "outlier_latency_min_s",
    "header_timeout_s",
    "body_timeout_s",
    "keep_alive_timeout_s",
    "send_timeout_s",
    "shutdown_timeout_s",
    "worker_hang_s",
    "retry_after_s",
    "retry_budget_min",
    "max_connections",
    "max_prompt_tokens",
    "decisions_kept",
    "record_backups",
    "max_speculative_blocks",
    "max_header_kb",
    "max_concurrent_per_key",
)
_AT_LEAST_ONE = ("outlier_consecutive_failures", "pool_per_replica")
_SHARES = ("retry_budget_ratio", "outlier_max_ejected_share")  # in [0, 1]
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _check_server_ranges(server: ServerSettings) -> None:
    """ConfigError naming the ``[server]`` key whose value is out of its range: a negative
    timeout, a share above 1, a gRPC port that is not one, a log level logging lacks."""
    for name in _POSITIVE:
        if not (math.isfinite(v := getattr(server, name)) and v > 0):
            raise ConfigError(f"server.{name}: must be a finite number > 0, got {v!r}")
    for name in _NON_NEGATIVE:
        if not (math.isfinite(v := getattr(server, name)) and v >= 0):
            raise ConfigError(f"server.{name}: must be a finite number >= 0, got {v!r}")
    for name in _AT_LEAST_ONE:
        if (v := getattr(server, name)) < 1:
            raise ConfigError(f"server.{name}: must be >= 1, got {v!r}")
    for name in _SHARES:
        if not 0 <= (v := getattr(server, name)) <= 1:
            raise ConfigError(f"server.{name}: must be in [0, 1], got {v!r}")
    for low, high in (
        # the first-byte deadline: first_byte_factor x predicted, within [min, timeout]
        ("first_byte_min_s", "first_byte_timeout_s"),
        # the n-th ejection in a row: n x base, at most max
        ("outlier_base_ejection_s", "outlier_max_ejection_s"),
    ):
        if (v := getattr(server, low)) > (top := getattr(server, high)):
            raise ConfigError(
                f"server.{low}: {v:g} is more than server.{high} ({top:g}), its upper bound: "
                f"it would never apply; lower it or raise {high}"
            )
    interval, wait = server.health_interval_s, server.health_timeout_s
    if interval > 0 and wait > HEALTH_TIMEOUT_INTERVALS * interval:
        # (above the interval is fine: the next sweep starts when the slow one ends)
        raise ConfigError(
            f"server.health_timeout_s: {wait:g} is more than {HEALTH_TIMEOUT_INTERVALS} x "
            f"server.health_interval_s ({interval:g}), where probes are cut (a sweep waits "
            "for its slowest probe); lower it or probe less often"
        )
    # a key is priority if listed there, else flex (router/service/admission.py)
    priority = set(read_api_keys(server.priority_keys, None))
    if both := priority.intersection(read_api_keys(server.flex_keys, None)):
        raise ConfigError(
            f"server.flex_keys: {len(both)} key{'s are' if len(both) > 1 else ' is'} in "
            "server.priority_keys too (not shown); a key has one service class"
        )
    if server.grpc_max_message_mb >= MAX_MESSAGE_MB:
        raise ConfigError(
            f"server.grpc_max_message_mb: must be below {MAX_MESSAGE_MB} (grpc counts a "
            f"message's bytes in a 32-bit integer), got {server.grpc_max_message_mb:g}"
        )
    if server.max_header_kb * 1024 > MAX_HEAD_BYTES:
        raise ConfigError(
            f"server.max_header_kb: must be at most {MAX_HEAD_BYTES // 1024} (the HTTP "
            f"parser's ceiling on a request head), got {server.max_header_kb:g}"
        )
    # TLS is on when both files are set (router/rpc/server.py): one alone is a mistake
    tls = [k for k in ("grpc_tls_cert", "grpc_tls_key") if getattr(server, k) is not None]
    if len(tls) == 1:
        missing = "grpc_tls_key" if tls == ["grpc_tls_cert"] else "grpc_tls_cert"
        raise ConfigError(
            f"server.{missing}: needed with {tls[0]} (alone, gRPC would serve in plaintext)"
        )
    if server.grpc_port is not None and not 0 <= server.grpc_port < 65536:
        raise ConfigError(f"server.grpc_port: {server.grpc_port} is not a TCP port (0: any free)")
    # the Redis key schema's (router/store/schema.py KeySchema), checked before start-up
    if problem := prefix_problem(server.redis_key_prefix):
        raise ConfigError(f"server.redis_key_prefix: {problem}")
    if problem := shards_problem(server.redis_stream_shards):
        raise ConfigError(f"server.redis_stream_shards: {problem}")
    if server.log_level.lower() not in _LOG_LEVELS:
        raise ConfigError(
            f"server.log_level: {server.log_level!r} is not one of " + ", ".join(_LOG_LEVELS)
        )


# [server] strings whose "" is not refused here: blank api_keys are refused when the app is
# built (security.Limits, with a blank file's)
_EMPTY_ALLOWED = ("api_keys",)


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
    if table.get("name") == "":
        raise ConfigError(f"{where}.name: must be a non-empty string (omit it: host:port)")
    name = url.netloc if table.get("name") is None else table["name"]  # typed: a str
    rep = typed(ReplicaSettings, {**table, "name": name}, where)
    refuse_empty(rep, where)
    if not 1 <= rep.dp_ranks <= MAX_DP_RANKS:
        raise ConfigError(f"{where}.dp_ranks: must be in [1, {MAX_DP_RANKS}]")
    try:
        rep = replace(rep, role=Role.parse(rep.role).value)
    except ConfigError as exc:
        raise ConfigError(f"{where}.role: {exc}") from None
    if rep.zmq_replay and not rep.zmq:
        raise ConfigError(f"{where}.zmq_replay: needs zmq")
    if rep.zmq == ZMQ_AUTO:
        if rep.zmq_replay:
            raise ConfigError(
                f'{where}.zmq_replay: with zmq = "{ZMQ_AUTO}" the replica names it itself'
            )
    elif rep.zmq:
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


def _warn_same_engine(replicas: tuple[ReplicaSettings, ...]) -> None:
    """Two entries with one url and model are one engine the router counts as two: it
    gets two replicas' share of the traffic and its load is split between them. Allowed
    (benchmarks spread many names over few engines), but never silently."""
    seen: dict[tuple[str, str], str] = {}
    pairs: list[str] = []
    for rep in replicas:
        first = seen.setdefault((rep.url, rep.model), rep.name)
        if first != rep.name:
            pairs.append(f"{first!r} and {rep.name!r} ({rep.url} serving {rep.model!r})")
    if pairs:
        more = f" and {len(pairs) - 3} more" if len(pairs) > 3 else ""
        logging.getLogger("kvrouter.config").warning(
            "replicas %s%s are the same engine listed twice: each is routed to and loaded "
            "as a replica of its own",
            "; ".join(pairs[:3]),
            more,
        )


def build_settings(data: Mapping[str, Any]) -> Settings:
    """Validate a merged configuration mapping into :class:`Settings`."""
    unknown = set(data) - {"server", "replicas", "models"}
    if unknown:
        raise ConfigError(f"unknown top-level section(s): {', '.join(sorted(unknown))}")
    server_tab = table_or_empty(data.get("server"))
    if not isinstance(server_tab, Mapping):
        raise ConfigError("server: must be a table")
    server = typed(ServerSettings, server_tab, "server")
    refuse_empty(server, "server", _EMPTY_ALLOWED)
    if server.redis_signing_master is not None:
        try:
            master_secret(server.redis_signing_master)
        except ValueError as exc:
            raise ConfigError(f"server.redis_signing_master: not a hex secret ({exc})") from None
    if not 0 < server.port < 65536:
        raise ConfigError(f"server.port: {server.port} is not a TCP port")
    if server.redis_url is not None:
        try:
            check_redis_url(server.redis_url)
        except ConfigError as exc:
            raise ConfigError(f"server.redis_url: {exc}") from None
    if server.http_engine not in ("aiohttp", "fast"):
        raise ConfigError(
            f"server.http_engine: {server.http_engine!r} is not one of 'aiohttp', 'fast'"
        )
    if server.http_engine == "aiohttp":
        logging.getLogger("kvrouter.config").warning(
            "server.http_engine = 'aiohttp' is obsolete and ignored: the router serves every "
            "route with its own HTTP server"
        )
    if server.listener not in ("reuseport", "shared"):
        raise ConfigError(
            f"server.listener: {server.listener!r} is not one of 'reuseport', 'shared'"
        )
    for key, ok, need in (
        ("workers", server.workers >= 1, ">= 1"),
        ("max_retries", server.max_retries >= 0, ">= 0"),
        ("max_body_mb", server.max_body_mb > 0, "> 0"),
    ):
        if not ok:
            raise ConfigError(f"server.{key}: must be {need}, got {getattr(server, key)}")
    if not (math.isfinite(server.load_share_interval_s) and server.load_share_interval_s >= 0):
        raise ConfigError("server.load_share_interval_s: must be a finite number >= 0 (0: off)")
    _check_server_ranges(server)
    _check_pods(server)
    if not math.isfinite(server.max_body_mb):
        raise ConfigError("server.max_body_mb: must be a finite number")
    if not (math.isfinite(server.body_memo_mb) and server.body_memo_mb >= 0):
        raise ConfigError("server.body_memo_mb: must be a finite number >= 0 (0: memo off)")
    if not (math.isfinite(server.response_ids_ttl_s) and server.response_ids_ttl_s >= 0):
        raise ConfigError("server.response_ids_ttl_s: must be a finite number >= 0 (0: off)")
    raw_replicas = data.get("replicas")
    raw_replicas = [] if raw_replicas is None else raw_replicas
    if not isinstance(raw_replicas, list):
        raise ConfigError("replicas: must be an array of tables ([[replicas]])")
    replicas = tuple(_replica(i, r) for i, r in enumerate(raw_replicas))
    names = [r.name for r in replicas]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"replicas: duplicate name(s) {', '.join(sorted(dupes))}")
    _warn_same_engine(replicas)
    models_tab = table_or_empty(data.get("models"))
    if not isinstance(models_tab, Mapping):
        raise ConfigError("models: must be a table of [models.NAME] tables")
    models = {name: model_settings(name, t) for name, t in models_tab.items()}
    for name, model in models.items():
        base = models.get(model.lora_base or "")
        if base is not None and base.lora_base is not None:
            raise ConfigError(
                f"models.{name}.lora_base: {base.name!r} is an adapter itself (lora_base = "
                f"{base.lora_base!r}); an adapter is served on a base model"
            )
    return Settings(server=server, replicas=replicas, models=models)


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    policy_file: str | os.PathLike[str] | None = None,
    policy: str | None = None,
) -> Settings:
    """File (``path`` or ``$KVROUTER_CONFIG``) < tuned policy file < environment < overrides.

    ``policy`` (``serve --policy``) is every model's policy: each ``[models.NAME]`` of every
    source and each model a replica names, validated with its ``policy_params`` as a file's."""
    env = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    if path is None and (path := env.get("KVROUTER_CONFIG")) is not None and not path.strip():
        # (KVROUTER_CONFIG=${CONFIG} with CONFIG unset: a file was meant, not the defaults)
        raise ConfigError("KVROUTER_CONFIG: empty; unset it to run without a config file")
    if path:
        data = read_file(path)
    from_env = env_overrides(env)
    later = [from_env, *([overrides] if overrides else [])]
    if policy_file:
        tuned = _read_tuned(policy_file)
        rest = data
        for layer in later:
            rest = merge(rest, layer)
        _check_tuned_models(tuned, _named_models(rest), policy_file, _discovers(rest))
        data = merge(data, {"models": tuned})
    _check_env_models(data, from_env, overrides or {}, env)
    for layer in later:
        data = merge(data, layer)
    if policy is not None and isinstance(data.get("models", {}), Mapping):
        data = {**data, "models": _with_policy(data, policy)}
    return build_settings(data)


def _read_tuned(policy_file: str | os.PathLike[str]) -> Mapping[str, Any]:
    """The ``[models.NAME]`` tables of a ``--policy-file``, each holding only tuned settings
    (TUNED_KEYS): another section would be ignored and another model key would override
    the main file's without a word, so both are a ConfigError naming the file."""
    raw = read_file(policy_file)
    if sections := sorted(set(raw) - {"models"}):
        raise ConfigError(
            f"{policy_file}: [{sections[0]}] is not read from a policy file (only "
            "[models.NAME] tuned settings are); set it in the main configuration"
        )
    tuned = raw.get("models")
    if not isinstance(tuned, Mapping) or not tuned:
        raise ConfigError(f"{policy_file}: expected at least one [models.NAME] table")
    for name, table in tuned.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"{policy_file}: models.{name}: must be a table")
        if keys := sorted(set(table) - set(TUNED_KEYS)):
            raise ConfigError(
                f"{policy_file}: models.{name}: {keys[0]!r} is not a tuned setting (a policy "
                f"file holds {', '.join(TUNED_KEYS)}); set it in the main configuration"
            )
    return tuned


def _check_tuned_models(
    tuned: Mapping[str, Any],
    served: set[str],
    policy_file: str | os.PathLike[str],
    discovers: bool,
) -> None:
    """A tuned model no replica or ``[models]`` table of the rest names would tune nothing
    (``sim tune`` writes ``sim-model`` unless given ``--model``): refused; logged only where
    replicas are discovered in Redis (``discovers``), whose models the file may be the
    first to configure."""
    for name in tuned:
        if name in served:
            continue
        message = (
            f"{policy_file}: models.{name}: no replica or [models] table of the "
            f"configuration names this model (served: {', '.join(sorted(served)) or '-'});"
            " write the tuned file for a served model with kvrouter sim tune --model NAME"
        )
        if not discovers:
            raise ConfigError(message)
        logging.getLogger("kvrouter.config").warning(
            "%s; it applies only if a replica registers it in Redis", message
        )


def _check_env_models(
    data: Mapping[str, Any],
    from_env: Mapping[str, Any],
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
) -> None:
    """A ``KVROUTER_MODELS__<NAME>__*`` model that no file table, tuned table, flag or
    replica names would configure a model nothing serves (names after ``KVROUTER_`` are
    lower-cased: ``KIMI`` for a file's ``Kimi``) and leave the intended one as it was:
    refused, naming the variable. Kept where replicas are discovered in Redis (they may
    register it) or where nothing else names a model (the environment is the
    configuration)."""
    env_models = from_env.get("models")
    if not isinstance(env_models, Mapping):
        return
    rest = merge(merge(dict(data), {k: v for k, v in from_env.items() if k != "models"}), overrides)
    served = _named_models(rest)
    if not served or _discovers(merge(merge(dict(data), from_env), overrides)):
        return
    for name in sorted(set(env_models) - served):
        var = next(v for v in sorted(environ) if v.lower().startswith(f"kvrouter_models__{name}__"))
        raise ConfigError(
            f"{var}: no replica or [models] table names model {name!r} (served: "
            f"{', '.join(sorted(served))}); names after KVROUTER_ are lower-cased, a model "
            "named with capitals, '-', '.' or '/' is configured in the file"
        )


def _discovers(data: Mapping[str, Any]) -> bool:
    """Whether the merged settings discover replicas in Redis (``server.redis_url``)."""
    server = data.get("server")
    return isinstance(server, Mapping) and bool(server.get("redis_url"))


def _with_policy(data: Mapping[str, Any], policy: str) -> dict[str, Any]:
    """``data``'s models, each model it names with ``policy``; a model's ``policy_params`` for
    another policy are dropped (they tune that one), its own policy's are kept."""
    models = dict(data.get("models") or {})
    for name in _named_models(data):
        table = models.get(name)
        table = dict(table) if isinstance(table, Mapping) else {}
        if table.get("policy", DEFAULT_POLICY) != policy:
            table.pop("policy_params", None)
        models[name] = {**table, "policy": policy}
    return models


def _named_models(data: Mapping[str, Any]) -> set[str]:
    """Every model the merged settings name: their ``[models]`` tables and replicas' ``model``."""
    models = data.get("models")
    names = set(models) if isinstance(models, Mapping) else set()
    replicas = data.get("replicas")
    if isinstance(replicas, Sequence) and not isinstance(replicas, str):
        names.update(
            r["model"]
            for r in replicas
            if isinstance(r, Mapping) and isinstance(r.get("model"), str)
        )
    return names
