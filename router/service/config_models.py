"""The ``[models.NAME]`` tables of the configuration, each parsed and validated into a
:class:`~router.service.settings.ModelSettings` (router/service/config.py builds the rest)::

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

A model with a tokenizer directory and no ``context_length`` takes its ``model_max_length``
(``tokenizer_max_length``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from router.core.admission import AdmissionSettings
from router.core.disagg import LinkModel, PdKnobs, PdSetup, TransferSizes
from router.core.errors import ConfigError
from router.core.load import CostModel
from router.core.policies import POLICIES, POLICY_NAMES, make_policy
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.service.config_tables import checked, refuse_empty, table_or_empty, typed
from router.service.settings import ROUTING_KEYS, ModelSettings, SloSettings
from router.tokenize.anthropic import DISABLED_THINKING_EFFORT_OPTIONS
from router.tokenize.content_format import CONTENT_FORMAT_OPTIONS
from router.tokenize.multimodal import ImageSettings


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
    knobs: dict[str, Any] = checked(AdmissionSettings, scalars, where)
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
                checked(cls, {key: value}, where)
                number = isinstance(value, int | float) and not isinstance(value, bool)
                if number and not math.isfinite(value):
                    raise ConfigError(f"{where}.{key}: must be a finite number")
                if number and key != "margin_s" and value < 0:
                    raise ConfigError(f"{where}.{key}: must be a finite number >= 0")
                break


def _check_policy_param_types(policy: str, params: Mapping[str, Any], where: str) -> None:
    """ConfigError naming the ``policy_params`` key whose value is not of the policy's
    declared type (a string ``"false"`` for a boolean would be true; ``cost``: a table of
    CostModel numbers); unknown keys and ranges: make_policy. A field a compiled core
    reports as ``type`` is skipped: its compiled constructor checks it."""
    cls = POLICIES.get(policy)
    if cls is None:
        return
    declared = {f.name: f.type for f in fields(cls)}
    for key, value in params.items():
        if key == "cost" and key in declared:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where}.cost: must be a table of cost-model numbers")
            cost = {f.name: f.type for f in fields(CostModel)}
            typed_cost = {k: v for k, v in value.items() if cost.get(k, type) is not type}
            checked(CostModel, typed_cost, f"{where}.cost")
        elif declared.get(key, type) is not type:
            checked(cls, {key: value}, where)


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


def model_settings(name: str, table: Any) -> ModelSettings:
    where = f"models.{name}"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: must be a table")
    routing_kw = {k: table[k] for k in ROUTING_KEYS if k in table}
    busy_tab = table_or_empty(table.get("busy"))
    if not isinstance(busy_tab, Mapping):
        raise ConfigError(f"{where}.busy: must be a table")
    # router/core's dataclasses, type-checked here as the service's are (a compiled core
    # would refuse a wrong type with a TypeError, the pure one would carry it to routing)
    busy = BusyThresholds(**checked(BusyThresholds, busy_tab, f"{where}.busy"))
    try:
        routing = RoutingSettings(busy=busy, **checked(RoutingSettings, routing_kw, where))
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for key in ("block_size", "state_interval_blocks", "engine_block_size"):
        value = getattr(routing, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}.{key}: expected a non-negative integer")
    if not 0 < (window := routing.reuse_window_s) < math.inf:
        # (inf: exp(-horizon / inf) = 1, every evicting cache a certain loss, whatever its
        # horizon, and none when all are full: router/core/turnover.py)
        raise ConfigError(
            f"{where}.reuse_window_s: expected a positive number of seconds (finite), "
            f"got {window!r}"
        )
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
    params = table_or_empty(table.get("policy_params"))
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.policy_params: must be a table")
    skip = (*ROUTING_KEYS, "busy", "policy_params", "images", "slo", "pd", "admission")
    # ModelSettings' name and routing are built here, never read from the table
    known = {f.name for f in fields(ModelSettings)} - {"name", "routing"} | set(skip)
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(sorted(known))})")
    rest = {k: v for k, v in table.items() if k not in skip}
    model = typed(ModelSettings, {**rest, "name": name}, where)
    refuse_empty(model, where)
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
    timeout = model.render_timeout_s
    if not (isinstance(timeout, int | float) and timeout > 0 and math.isfinite(timeout)):
        raise ConfigError(f"{where}.render_timeout_s: expected a finite number of seconds > 0")
    images_tab = table.get("images")
    if images_tab is not None:
        if not isinstance(images_tab, Mapping):
            raise ConfigError(f"{where}.images: must be a table")
        try:
            images = typed(ImageSettings, images_tab, f"{where}.images")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}.images: {exc}") from None
        model = replace(model, images=images)
    slo_tab = table_or_empty(table.get("slo"))
    if not isinstance(slo_tab, Mapping):
        raise ConfigError(f"{where}.slo: must be a table")
    try:
        model = replace(model, slo=typed(SloSettings, slo_tab, f"{where}.slo").targets())
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
    _check_policy_param_types(model.policy, params, f"{where}.policy_params")
    try:
        make_policy(model.policy, params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}.policy_params: {exc}") from None
    if model.num_reserved is not None and model.num_reserved < 0:
        raise ConfigError(f"{where}.num_reserved: must be >= 0, got {model.num_reserved}")
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
