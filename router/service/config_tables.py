"""Raw configuration tables, before any section's meaning (router/service/config.py builds
the settings from them): a file (TOML, or YAML by its suffix) read into one, tables layered
one over the other, and a table checked against the settings dataclass it fills. Errors
raise ConfigError naming the file or the key.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from router.core.errors import ConfigError
from router.service.settings import SECRET_KEYS, declared_kind

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

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

            try:
                data = yaml.safe_load(raw) or {}
            except yaml.MarkedYAMLError as exc:
                raise ConfigError(f"cannot parse config file {p}: {_yaml_problem(exc)}") from None
        else:
            data = tomllib.loads(raw.decode("utf-8"))
    except ConfigError:
        raise
    except Exception as exc:  # yaml and toml raise their own error types
        raise ConfigError(f"cannot parse config file {p}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table/mapping at the top level")
    return data


def _yaml_problem(exc: Any) -> str:
    """A YAML syntax error (``yaml.MarkedYAMLError``) as its problem and where: PyYAML's own
    message quotes the offending line, a secret on it included."""
    parts = []
    for what, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
        if what:
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            parts.append(f"{what}{at}")
    return ": ".join(parts) or type(exc).__name__


def merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of tables; ``extra`` wins; arrays (replicas) are replaced, not appended."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def table_or_empty(value: Any) -> Any:
    """A section as written, None (an empty YAML key) as an empty table: a ``false``,
    ``""`` or ``[]`` is kept for the caller to refuse as not a table (never read as empty)."""
    return {} if value is None else value


def refuse_empty(settings: DataclassInstance, where: str, allowed: Sequence[str] = ()) -> None:
    """ConfigError naming a string setting of ``settings`` that is "" (but those ``allowed``):
    never a value (an empty ``api_keys_file`` or ``grpc_token`` would leave the router or
    its index open to all, an empty ``host`` binds every interface, an empty ``zmq`` follows
    no events, an empty ``tokenizer`` reads the working directory); a setting is left out
    by not setting it."""
    for f in fields(settings):
        if f.name not in allowed and getattr(settings, f.name) == "":
            raise ConfigError(f"{where}.{f.name}: empty; remove the setting or give a value")


def typed(
    cls: type[_Table], table: Mapping[str, Any], where: str, skip: Sequence[str] = ()
) -> _Table:
    """Build dataclass ``cls`` from ``table`` checking names and scalar types."""
    return cls(**checked(cls, table, where, skip))


def checked(
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
            got = (
                f"a value of type {type(value).__name__} (not shown)"
                if key in SECRET_KEYS
                else repr(value)
            )
            raise ConfigError(f"{where}.{key}: expected {kind}, got {got}{_yaml_hint(kind, value)}")
        kwargs[key] = value
    return kwargs


def _yaml_hint(kind: str, value: Any) -> str:
    """How to write ``value`` where YAML 1.1 (PyYAML) read it as another type: ``off`` /
    ``on`` / ``no`` / ``yes`` are booleans, ``1e3`` (no dot) is text; "" for other values."""
    if isinstance(value, bool) and kind.startswith("str"):
        return " (YAML reads on/off, yes/no as booleans: quote it)"
    if isinstance(value, str) and kind.startswith(("int", "float")):
        try:
            number = float(value)
        except ValueError:
            return ""
        if kind.startswith("int") and number.is_integer():
            return f" (YAML 1.1 reads {value} as text: write {int(number)})"
        if kind.startswith("float") and math.isfinite(number):
            return f" (YAML 1.1 reads {value} as text: write {number!r})"
    return ""
