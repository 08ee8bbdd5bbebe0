"""The configuration docs state what the code does: every TOML example in README.md and docs/
loads with the real settings loader, and docs/configuration.md's reference block names every
setting of the settings dataclasses with its default (introspected, so a new or changed
setting fails here until the docs say so)."""

from __future__ import annotations

import logging
import math
import re
import tomllib
from collections.abc import Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from router.core.admission import AdmissionSettings
from router.core.disagg import LinkModel, PdKnobs, TransferSizes
from router.core.policies import make_policy
from router.core.routing_settings import DEFAULT_SPECULATIVE_TTL_S, BusyThresholds, RoutingSettings
from router.core.slo import DEFAULT_TIERS, DEFAULT_TPOT_S, parse_tiers
from router.service.config import build_settings
from router.service.settings import (
    ROUTING_KEYS,
    ModelSettings,
    ReplicaSettings,
    ServerSettings,
    SloSettings,
)
from router.tokenize.multimodal import ImageSettings

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy/README.md"]
HEX_SECRET = "ab" * 32
# placeholders the docs write for secrets, and what stands in for them here
PLACEHOLDERS = {
    'redis_signing_master = "..."': f'redis_signing_master = "{HEX_SECRET}"',
    'redis_signing_master = "…64 hex digits…"': f'redis_signing_master = "{HEX_SECRET}"',
}


def _toml_blocks() -> Iterator[tuple[str, str]]:
    for path in DOCS:
        for i, block in enumerate(re.findall(r"```toml\n(.*?)```", path.read_text(), re.S)):
            for old, new in PLACEHOLDERS.items():
                block = block.replace(old, new)
            yield f"{path.relative_to(ROOT)}#{i}", block


@pytest.mark.parametrize(("where", "block"), list(_toml_blocks()), ids=lambda v: v[:40])
def test_every_documented_toml_example_loads(
    where: str, block: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvrouter.config"):
        build_settings(tomllib.loads(block))
    assert not caplog.records, f"{where}: {[r.getMessage() for r in caplog.records]}"


def _reference() -> dict[str, dict[str, Any]]:
    """docs/configuration.md's reference block: section -> key -> documented value (commented
    lines too: ``# key = value``; ``# key: ...`` documents a key without a value)."""
    text = (ROOT / "docs/configuration.md").read_text()
    block = re.findall(r"```toml\n(.*?)```", text, re.S)[0]
    out: dict[str, dict[str, Any]] = {}
    section = ""
    for line in block.splitlines():
        if m := re.match(r"^(?:# )?\[\[?([\w.-]+)\]\]?", line):
            section = m.group(1).replace("kimi-k3", "NAME")
            out.setdefault(section, {})
        elif m := re.match(r"^(?:# ?)?([a-z_]+) = (.*)$", line):
            value = tomllib.loads(f"v = {m.group(2)}")["v"]
            out[section].setdefault(m.group(1), value)
        elif m := re.match(r"^# ([a-z_]+): ", line):
            out[section].setdefault(m.group(1), None)
    return out


def _defaults(*classes: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls in classes:
        for f in fields(cls):
            if f.name in skip:
                continue
            if f.default is not MISSING:
                out[f.name] = f.default
            elif f.default_factory is not MISSING:
                out[f.name] = f.default_factory()
            else:
                out[f.name] = MISSING  # required
    return out


_ours = make_policy("ours", {})
_sub = ("name", "routing", "policy_params", "images", "slo", "pd", "admission")
# section of the reference block -> the settings it documents, with their defaults
SECTIONS: dict[str, dict[str, Any]] = {
    "server": _defaults(ServerSettings),
    "replicas": _defaults(ReplicaSettings),
    "models.NAME": {
        **_defaults(ModelSettings, skip=_sub),
        **{k: v for k, v in _defaults(RoutingSettings).items() if k in ROUTING_KEYS},
        "speculative_ttl_s": DEFAULT_SPECULATIVE_TTL_S,  # None in the dataclass: this
    },
    "models.NAME.busy": _defaults(BusyThresholds),
    "models.NAME.slo": {**_defaults(SloSettings), "tpot_s": DEFAULT_TPOT_S},
    "models.NAME.admission": {**_defaults(AdmissionSettings), "enabled": False},
    "models.NAME.images": _defaults(ImageSettings),
    "models.NAME.policy_params": {"cost": None}
    | {k: getattr(_ours, k) for k in ("w_queue", "w_eviction", "eviction_risk_floor")}
    | {k: getattr(_ours, k) for k in ("w_interference", "w_batch", "w_miss", "miss_margin")},
}
# Values the reference block shows as examples, not as defaults (its comments say the default).
EXAMPLES = {
    "server": {
        "host", "pod_name", "admin_token", "redis_url", "redis_signing_master",
        "discover_replicas", "grpc_port", "grpc_host", "grpc_token", "grpc_tls_cert",
        "grpc_tls_key", "record_path", "record_key", "api_keys", "api_keys_file",
        "priority_keys", "flex_keys", "http_engine",
    },
    "replicas": {"url", "model", "name", "rack", "region", "zmq", "zmq_replay", "metrics_url"},
    "models.NAME": {
        "hybrid", "state_interval_blocks", "engine_block_size", "eagle", "context_length",
        "tokenizer", "bpe_file", "pattern", "num_reserved", "chat_template",
        "chat_template_kwargs", "reasoning_effort_map", "exclude_tools_when_tool_choice_none",
        "anthropic_disabled_thinking_effort", "render", "render_url", "render_api_key",
        "lora_base",
    },
    "models.NAME.busy": {"max_in_flight", "max_queued_prefill_tokens", "max_kv_usage"},
    "models.NAME.slo": {"ttft_s", "ttft_tiers"},  # the tiers: the test below
    "models.NAME.admission": {"enabled"},
    "models.NAME.images": {"placeholder", "token", "model_id"},
    "models.NAME.policy_params": {"cost"},
}  # fmt: skip


def _same(documented: Any, default: Any) -> bool:
    if isinstance(default, tuple):
        return len(documented) == len(default) and all(map(_same, documented, default))
    if isinstance(default, float) and isinstance(documented, (int, float)):
        return math.isclose(documented, default) or documented == default
    return bool(documented == default)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_reference_block_documents_every_setting_with_its_default(section: str) -> None:
    documented = _reference()[section]
    settings = SECTIONS[section]
    assert sorted(set(settings) - set(documented)) == [], "settings the docs do not name"
    assert sorted(set(documented) - set(settings)) == [], "documented keys the code lacks"
    for key, value in documented.items():
        if key in EXAMPLES[section]:
            continue
        default = settings[key]
        assert _same(value, default), f"{section}.{key}: docs {value!r}, code {default!r}"


def test_documented_default_ttft_tiers_are_the_code_default() -> None:
    assert parse_tiers(_reference()["models.NAME.slo"]["ttft_tiers"]) == DEFAULT_TIERS


def test_pd_docs_name_every_pd_setting_with_its_default() -> None:
    """``[models.NAME.pd]``: docs/pd.md's example names every key PdSetup.from_mapping reads
    (the link model's keys in a comment), with its default."""
    text = (ROOT / "docs/pd.md").read_text()
    block = re.findall(r"```toml\n(.*?)```", text, re.S)[0]
    table = tomllib.loads(block)["models"]["kimi-k3"]["pd"]
    defaults = _defaults(PdKnobs, TransferSizes, skip=("tpot_target_s",))
    for key, default in defaults.items():
        assert key in table, f"pd.{key} undocumented in docs/pd.md"
        assert _same(table[key], default), f"pd.{key}: docs {table[key]!r}, code {default!r}"
    for key in _defaults(LinkModel):
        assert re.search(rf"^#.*\b{key}\b", block, re.M), f"pd.{key} undocumented in docs/pd.md"


@pytest.mark.parametrize(
    "key", ["header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "send_timeout_s"]
)
def test_reference_block_says_a_zero_front_timeout_is_off(key: str) -> None:
    """0 turns each client-connection timeout off (router/service/fast_server.py and
    http_connection.py: no deadline set); the reference line says so."""
    text = (ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith(f"{key} = "))
    assert "0: off" in line, line
