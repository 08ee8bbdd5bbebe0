"""The tuned-settings file ``kvrouter sim tune`` writes and the router loads.

Format (TOML), one table per model::

    [models."sim-model"]
    policy = "ours"
    block_size = 64
    hybrid = true                 # optional: the model's recurrent-state grid, as simulated
    state_interval_blocks = 256   # (router.core.routing_settings.RoutingSettings fields)

    [models."sim-model".policy_params]
    w_prefill = 12.0
    w_queue = 1.0

    [models."sim-model".policy_params.cost]   # optional: router.core.load.CostModel fields
    step_overhead_s = 0.006

``policy_params`` holds exactly the keyword arguments ``router.core.policies.make_policy``
accepts for that policy (``cost`` as a nested table), so loading validates them by building
the policy once; a typo is a ConfigError, not a silently ignored setting. ``block_size``,
``hybrid`` and ``state_interval_blocks`` are the routing grid the tuner simulated; the router's
``load_settings(policy_file=...)`` merges them into ``[models.NAME]`` like the policy, so the
router hashes and speculates on the grid the parameters were tuned for. Files without them
(older tuner output) still load; the router then keeps its own values.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.core.errors import ConfigError
from router.core.policies import make_policy
from router.service.settings import TUNED_KEYS

if TYPE_CHECKING:
    from sim.cluster_config import ClusterConfig
    from sim.profiles import EngineProfile

_KEYS = TUNED_KEYS


def state_interval_blocks(profile: EngineProfile, block_size: int) -> int:
    """The recurrent-state checkpoint grid of ``profile`` in ``block_size``-token blocks, as the
    simulated router assumes it (sim/cluster.py): at least 1 for a hybrid model, 0 otherwise."""
    if not profile.hybrid:
        return 0
    return max(1, profile.checkpoint_interval_tokens // block_size)


@dataclass(slots=True, frozen=True)
class TunedPolicy:
    """A model's routing policy, its parameters and the routing grid they were tuned on, as
    the router's config wants them. ``None``: not in the file (the router keeps its value)."""

    model: str
    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None
    hybrid: bool | None = None
    state_interval_blocks: int | None = None

    @classmethod
    def for_cluster(
        cls, model: str, policy: str, params: Mapping[str, Any], config: ClusterConfig
    ) -> TunedPolicy:
        """``policy`` with ``params`` tuned on the simulated ``config``: its block size and the
        profile's hybrid state grid travel with them."""
        return cls(
            model,
            policy,
            dict(params),
            config.block_size,
            config.profile.hybrid,
            state_interval_blocks(config.profile, config.block_size),
        )


def _parse_grid(table: Mapping[str, Any], where: str) -> tuple[bool | None, int | None]:
    """``hybrid`` and ``state_interval_blocks`` of a model table (None when absent)."""
    hybrid = table.get("hybrid")
    if hybrid is not None and not isinstance(hybrid, bool):
        raise ConfigError(f"{where} hybrid must be true or false, got {hybrid!r}")
    interval = table.get("state_interval_blocks")
    if interval is not None and (
        not isinstance(interval, int) or isinstance(interval, bool) or interval < 0
    ):
        raise ConfigError(
            f"{where} state_interval_blocks must be a non-negative integer, got {interval!r}"
        )
    if hybrid is True and interval == 0:
        raise ConfigError(f"{where} a hybrid model needs state_interval_blocks >= 1")
    if hybrid is False and interval:
        raise ConfigError(f"{where} state_interval_blocks = {interval} is only for hybrid = true")
    return hybrid, interval


def _parse_model(name: str, table: Any, source: str) -> TunedPolicy:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: [models.{name}] must be a table")
    unknown = set(table) - set(_KEYS)
    if unknown:
        raise ConfigError(f"{source}: [models.{name}] unknown key(s) {', '.join(sorted(unknown))}")
    policy = table.get("policy")
    if not isinstance(policy, str):
        raise ConfigError(f'{source}: [models.{name}] needs policy = "<name>"')
    params = table.get("policy_params", {})
    if not isinstance(params, Mapping):
        raise ConfigError(f"{source}: [models.{name}.policy_params] must be a table")
    block = table.get("block_size")
    if block is not None and (not isinstance(block, int) or block <= 0):
        raise ConfigError(f"{source}: [models.{name}] block_size must be a positive integer")
    hybrid, interval = _parse_grid(table, f"{source}: [models.{name}]")
    try:
        make_policy(policy, params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: [models.{name}] {exc}") from None
    return TunedPolicy(name, policy, dict(params), block, hybrid, interval)


def load_all_tuned(path: str | Path) -> dict[str, TunedPolicy]:
    """Every model in a tuned-settings file (ConfigError on a missing/bad file)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such tuned-settings file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: {exc}") from None
    models = data.get("models")
    if not isinstance(models, Mapping) or not models:
        raise ConfigError(f"{p}: expected at least one [models.<name>] table")
    return {name: _parse_model(name, table, str(p)) for name, table in models.items()}


def load_tuned(path: str | Path, model: str | None = None) -> TunedPolicy:
    """The tuned policy of ``model`` (or of the only model in the file)."""
    models = load_all_tuned(path)
    if model is None:
        if len(models) != 1:
            raise ConfigError(f"{path}: several models ({', '.join(models)}); name one")
        return next(iter(models.values()))
    if model not in models:
        raise ConfigError(f"{path}: no settings for model {model!r}")
    return models[model]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _key(name: str) -> str:
    return name if name.replace("_", "").replace("-", "").isalnum() else _toml_value(name)


def dump_tuned(tuned: Mapping[str, TunedPolicy], header: str = "") -> str:
    """TOML text for ``tuned`` (the inverse of ``load_all_tuned``)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for name, t in tuned.items():
        table = f"models.{_key(name)}"
        lines += ["", f"[{table}]", f"policy = {_toml_value(t.policy)}"]
        if t.block_size is not None:
            lines.append(f"block_size = {t.block_size}")
        if t.hybrid is not None:
            lines.append(f"hybrid = {_toml_value(t.hybrid)}")
        if t.state_interval_blocks is not None:
            lines.append(f"state_interval_blocks = {t.state_interval_blocks}")
        flat = {k: v for k, v in t.params.items() if not isinstance(v, Mapping)}
        nested = {k: v for k, v in t.params.items() if isinstance(v, Mapping)}
        lines += ["", f"[{table}.policy_params]"]
        lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in flat.items()]
        for sub, values in nested.items():
            lines += ["", f"[{table}.policy_params.{_key(sub)}]"]
            lines += [f"{_key(k)} = {_toml_value(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"
