"""Settings from the environment: ``KVROUTER_SERVER__<KEY>`` and
``KVROUTER_MODELS__<NAME>__<KEY>`` for any scalar (e.g. ``KVROUTER_SERVER__PORT=9000``,
``KVROUTER_MODELS__KIMI__POLICY=ours``), values converted by the setting's declared type,
``KVROUTER_REPLICAS`` (``model=url,model=url``) and ``KVROUTER_ADMIN_TOKEN``; other
``KVROUTER_*`` variables belong to other components and are ignored (``env_overrides``): the
publisher's ``KVROUTER_PUBLISHER__<FLAG>`` follow the same convention (router/publisher/env.py).
Errors raise ConfigError naming the variable."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from router.core.errors import ConfigError
from router.core.routing_settings import BusyThresholds, RoutingSettings
from router.service.settings import (
    ROUTING_KEYS,
    ModelSettings,
    ServerSettings,
    SloSettings,
    declared_kind,
)

if TYPE_CHECKING:
    pass


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


def _model_key_kinds() -> dict[str, str]:
    """Scalar keys of a ``[models.NAME]`` table and their declared types."""
    kinds = {
        f.name: declared_kind(ModelSettings, f.name)
        for f in fields(ModelSettings)
        if f.name not in ("name", "routing", "policy_params", "images", "slo", "admission")
    }
    kinds.update({k: declared_kind(RoutingSettings, k) for k in ROUTING_KEYS})
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
        kinds = {f.name: declared_kind(ServerSettings, f.name) for f in fields(ServerSettings)}
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
        kinds = {f.name: declared_kind(cls, f.name) for f in fields(cls)}
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
    (bool: true/false, 1/0, yes/no, on/off, any case); an empty (or blank) str setting
    is refused. ConfigError names ``var``."""
    if kind == _UNTYPED:
        return _scalar(text)
    base = {part.strip() for part in kind.split("|")} - {"None"}
    if base == {"str"} and not text.strip():
        # (``KVROUTER_X=${SECRET}`` with the secret unset: no value was meant; a number's
        # or a flag's empty text is refused below, as any text it does not parse as)
        raise ConfigError(f"{var}: empty; unset it to leave {where} as configured")
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
            if not out["replicas"]:  # it would replace the file's replicas with none
                raise ConfigError(f"{var}: empty; unset it to keep the file's replicas")
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
