"""Builds the service's settings tree (router/service/settings.py), read once at start-up
from a file (TOML or YAML), the environment (``KVROUTER_*``, router/service/config_env.py)
and command-line flags, in that order of precedence (flags win).

File layout (every section optional; see docs/configuration.md)::

    [server]       host, port, workers, max_body_mb, admin_token, debug_header, timeouts,
                   max_retries, retry_after_s, seed, decisions_kept, health_interval_s, ...
    [[replicas]]   url, model, name, rack, region, role, dp_ranks
    [models.NAME]  policy, block_size, hybrid, state_interval_blocks, speculative_ttl_s,
                   speculate_sessions, engine_block_size, eagle,
                   context_length, tokenizer, bpe_file, pattern, chat_template,
                   chat_template_content_format, chat_template_kwargs and
                   reasoning_effort_map (tables), exclude_tools_when_tool_choice_none,
                   anthropic_disabled_thinking_effort, cache_mb, chars_per_token,
                   add_bos_to_completions, render, render_url, render_timeout_s,
                   render_api_key (router/service/render.py)
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
Environment: ``KVROUTER_CONFIG`` names the file; the other variables are read by
``config_env.env_overrides``.
Replica URLs are plain ``http://host:port`` (router/service/replica_url.py). A model with a
tokenizer directory and no ``context_length`` takes its ``model_max_length``
(``tokenizer_max_length``). Errors raise ConfigError naming the key (or variable).
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from router.core.admission import AdmissionSettings
from router.core.disagg import LinkModel, PdKnobs, PdSetup, Role, TransferSizes
from router.core.errors import ConfigError
from router.core.policies import POLICY_NAMES, make_policy
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.events.endpoints import engine_endpoints
from router.service.config_env import env_overrides
from router.service.replica_url import ReplicaUrl
from router.service.settings import (
    DEFAULT_POLICY,
    ROUTING_KEYS,
    ZMQ_AUTO,
    ModelSettings,
    ReplicaSettings,
    ServerSettings,
    Settings,
    SloSettings,
    declared_kind,
)
from router.store.codec import master_secret
from router.store.schema import check_redis_url
from router.tokenize.anthropic import DISABLED_THINKING_EFFORT_OPTIONS
from router.tokenize.content_format import CONTENT_FORMAT_OPTIONS
from router.tokenize.multimodal import ImageSettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

MiB = 2**20
_Table = TypeVar("_Table", bound="DataclassInstance")


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
        kind = declared_kind(cls, key)
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
_AT_LEAST_ONE = ("outlier_consecutive_failures", "pool_per_replica", "redis_stream_shards")
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
    if server.grpc_port is not None and not 0 <= server.grpc_port < 65536:
        raise ConfigError(f"server.grpc_port: {server.grpc_port} is not a TCP port (0: any free)")
    if server.log_level.lower() not in _LOG_LEVELS:
        raise ConfigError(
            f"server.log_level: {server.log_level!r} is not one of " + ", ".join(_LOG_LEVELS)
        )


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
    triples = {n for n in (f.name for f in fields(AdmissionSettings)) if _is_triple(n)}
    scalars = {k: v for k, v in table.items() if k != "enabled" and k not in triples}
    knobs: dict[str, Any] = _checked(AdmissionSettings, scalars, where)
    for key in triples & table.keys():
        value = table[key]
        if not (
            isinstance(value, list)
            and len(value) == 3
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        ):
            raise ConfigError(f"{where}.{key}: expected 3 numbers (priority, default, flex)")
        knobs[key] = tuple(value)
    try:
        settings = AdmissionSettings(**knobs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return settings if enabled else None


def _is_triple(name: str) -> bool:
    """Whether AdmissionSettings' ``name`` is a per-class (priority, default, flex) triple."""
    return isinstance(getattr(AdmissionSettings(), name), tuple)


def _check_pd_types(table: Mapping[str, Any], where: str) -> None:
    """ConfigError naming the ``[models.NAME.pd]`` key whose value is not of its declared
    type, or is a non-finite or negative number (``margin_s`` may be negative: it favours the
    remote prefill); unknown keys: PdSetup.from_mapping; the other ranges: the
    dataclasses'."""
    for key, value in table.items():
        for cls in (PdKnobs, LinkModel, TransferSizes):
            if key in {f.name for f in fields(cls)}:
                _checked(cls, {key: value}, where)
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if number and not math.isfinite(value):
                    raise ConfigError(f"{where}.{key}: must be a finite number")
                if number and key != "margin_s" and value < 0:
                    raise ConfigError(f"{where}.{key}: must be a finite number >= 0")
                break


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


def _check_model_ranges(routing: RoutingSettings, where: str) -> None:
    """ConfigError naming the ``[models.NAME]`` / ``[models.NAME.busy]`` key whose value is
    out of range: negative TTLs (0: off), busy thresholds below 0 or a KV usage above 1."""
    for name in ("speculative_ttl_s", "session_ttl_s"):
        v = getattr(routing, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"{where}.{name}: must be a finite number >= 0 (0: off)")
    busy = routing.busy
    for name in ("max_in_flight", "max_queued_prefill_tokens"):
        if (v := getattr(busy, name)) is not None and v < 0:
            raise ConfigError(f"{where}.busy.{name}: must be >= 0, got {v}")
    if busy.max_kv_usage is not None and not 0 < busy.max_kv_usage <= 1:
        raise ConfigError(f"{where}.busy.max_kv_usage: must be in (0, 1], got {busy.max_kv_usage}")


def _model(name: str, table: Any) -> ModelSettings:
    where = f"models.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table")
    routing_kw = {k: table[k] for k in ROUTING_KEYS if k in table}
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
    for key in ("block_size", "state_interval_blocks", "engine_block_size"):
        value = getattr(routing, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}.{key}: expected a non-negative integer")
    if not routing.reuse_window_s > 0:
        raise ConfigError(f"{where}.reuse_window_s: expected a positive number of seconds")
    _check_model_ranges(routing, where)
    if routing.block_size <= 0:
        raise ConfigError(f"{where}.block_size: must be positive")
    engine_block, block = routing.engine_block_size, routing.block_size
    if engine_block and engine_block % block and block % engine_block:
        raise ConfigError(
            f"{where}.engine_block_size: {engine_block} is neither a multiple nor a divisor "
            f"of block_size {block} (the router could not tell where the engines' hits land)"
        )
    if not isinstance(routing.eagle, bool):
        raise ConfigError(f"{where}.eagle: expected true or false")
    if routing.hybrid is not None and not isinstance(routing.hybrid, bool):
        raise ConfigError(f"{where}.hybrid: expected true or false (omit it: learned)")
    params = table.get("policy_params") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.policy_params: must be a table")
    skip = (*ROUTING_KEYS, "busy", "policy_params", "images", "slo", "pd", "admission")
    # ModelSettings' name and routing are built here, never read from the table
    known = {f.name for f in fields(ModelSettings)} - {"name", "routing"} | set(skip)
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    rest = {k: v for k, v in table.items() if k not in skip}
    model = _typed(ModelSettings, {**rest, "name": name}, where)
    if model.chat_template_content_format not in CONTENT_FORMAT_OPTIONS:
        raise ConfigError(
            f"{where}.chat_template_content_format: {model.chat_template_content_format!r} is "
            "not one of " + ", ".join(CONTENT_FORMAT_OPTIONS)
        )
    loras = model.default_mm_loras
    if not isinstance(loras, (list, tuple)) or not all(isinstance(v, str) and v for v in loras):
        raise ConfigError(f"{where}.default_mm_loras: must be an array of adapter names")
    model = replace(model, default_mm_loras=tuple(loras))
    if model.lora_base is not None:
        if not isinstance(model.lora_base, str) or not model.lora_base:
            raise ConfigError(f"{where}.lora_base: expected the base model's name (a string)")
        if model.lora_base == name:
            raise ConfigError(
                f"{where}.lora_base: names the adapter itself; give the base model the "
                "engines serve it on (omit it for a base model)"
            )
    if not isinstance(model.chat_template_kwargs, Mapping):
        raise ConfigError(f"{where}.chat_template_kwargs: must be a table")
    effort_map = model.reasoning_effort_map
    if not isinstance(effort_map, Mapping) or not all(
        isinstance(v, str) for v in effort_map.values()
    ):
        raise ConfigError(f"{where}.reasoning_effort_map: must be a table of strings")
    if model.anthropic_disabled_thinking_effort not in DISABLED_THINKING_EFFORT_OPTIONS:
        raise ConfigError(
            f"{where}.anthropic_disabled_thinking_effort: "
            f"{model.anthropic_disabled_thinking_effort!r} is not one of "
            + ", ".join(DISABLED_THINKING_EFFORT_OPTIONS)
        )
    if model.render not in ("local", "engine"):
        raise ConfigError(f"{where}.render: {model.render!r} is not one of local, engine")
    if model.render_url is not None:
        parts = urlsplit(model.render_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"{where}.render_url: {model.render_url!r} is not an http(s) URL")
        model = replace(model, render_url=model.render_url.rstrip("/"))
    if not (math.isfinite(model.cache_mb) and model.cache_mb >= 0):
        raise ConfigError(f"{where}.cache_mb: must be a finite number >= 0")
    if not (math.isfinite(model.chars_per_token) and model.chars_per_token > 0):
        raise ConfigError(f"{where}.chars_per_token: must be a finite number > 0")
    if not (isinstance(model.render_timeout_s, int | float) and model.render_timeout_s > 0):
        raise ConfigError(f"{where}.render_timeout_s: expected a positive number of seconds")
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
        _check_pd_types(pd_tab, f"{where}.pd")
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
    path = path or env.get("KVROUTER_CONFIG")
    if path:
        data = read_file(path)
    later = [env_overrides(env), *([overrides] if overrides else [])]
    if policy_file:
        tuned = read_file(policy_file).get("models") or {}
        if isinstance(tuned, Mapping):
            rest = data
            for layer in later:
                rest = merge(rest, layer)
            _check_tuned_models(tuned, _named_models(rest), policy_file, _discovers(rest))
        data = merge(data, {"models": tuned})
    for layer in later:
        data = merge(data, layer)
    if policy is not None and isinstance(data.get("models", {}), Mapping):
        data = {**data, "models": _with_policy(data, policy)}
    return build_settings(data)


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
