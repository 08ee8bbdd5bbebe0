"""``kvrouter publish`` flags from the environment, in the router's convention
(``KVROUTER_<SECTION>__<KEY>``, docs/configuration.md "Environment"): the section is
``PUBLISHER`` and the key a flag's name, ``-`` written ``_`` (``--engine-metrics`` is
``KVROUTER_PUBLISHER__ENGINE_METRICS``). Flags given on the command line win.

Values are converted as the flag converts them, and flags that repeat or take several
values (``--zmq``, ``--replay``, ``--dp-ranks``) take a comma-separated list. A variable of the
section naming no flag, or a value that is empty or does not convert, stops the command with
an error naming the variable (:func:`check`). The names of earlier releases (``RENAMED``) are still
read, with a warning naming the new one.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping

PREFIX = "KVROUTER_PUBLISHER__"
# earlier names -> their name in the convention
RENAMED = {
    "KVROUTER_REDIS_URL": "KVROUTER_PUBLISHER__REDIS",
    "KVROUTER_SIGNING_KEY": "KVROUTER_PUBLISHER__SIGNING_KEY",
}
_ERRORS = "env_errors"  # where apply() leaves its errors on the parsed namespace
# where apply() leaves the values of repeatable flags: argparse appends a flag's values to
# its default, so they are filled in by check() when the command line gave none
_REPEATED = "env_repeated"


def variable(action: argparse.Action) -> str:
    """The variable that sets ``action``'s flag."""
    return PREFIX + action.option_strings[-1].lstrip("-").replace("-", "_").upper()


def _convert(action: argparse.Action, var: str, text: str) -> object:
    if not text.strip():  # (KVROUTER_PUBLISHER__SIGNING_KEY=${KEY} with KEY unset: no key)
        flag = action.option_strings[-1]
        raise ValueError(f"{var}: empty; unset it to leave {flag} as its default")
    convert = action.type if callable(action.type) else str
    several = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    parts = [p.strip() for p in text.split(",") if p.strip()] if several else [text]
    try:
        values = [convert(p) for p in parts]
    except (TypeError, ValueError):
        kind = getattr(convert, "__name__", "value")
        raise ValueError(
            f"{var}: {action.option_strings[-1]} expects {kind}, got {text!r}"
        ) from None
    return values if several else values[0]


def apply(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Set ``parser``'s defaults from ``environ`` (flags still win); a flag the environment
    sets is no longer required. Errors are kept for :func:`check` (the parser of every
    ``kvrouter`` command is built, not only this one's)."""
    by_var = {variable(a): a for a in parser._actions if a.option_strings and a.dest != "help"}
    errors: list[str] = []
    repeated: dict[str, object] = {}
    env = dict(environ)
    for old, new in RENAMED.items():
        if old in env and new not in env:
            env[new] = env[old]
    for var, text in sorted(env.items()):
        if not var.startswith(PREFIX):
            continue
        action = by_var.get(var)
        if action is None:
            known = ", ".join(sorted(by_var))
            errors.append(f"{var}: not a flag of kvrouter publish (known: {known})")
            continue
        try:
            value = _convert(action, var, text)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        if isinstance(action, argparse._AppendAction):
            repeated[action.dest] = value
        else:
            parser.set_defaults(**{action.dest: value})
        action.required = False
    parser.set_defaults(**{_ERRORS: errors, _REPEATED: repeated})


def check(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Raise ValueError with the first problem :func:`apply` found; fill in the repeatable
    flags the command line left unset; warn about old names."""
    errors: list[str] = getattr(args, _ERRORS, [])
    if errors:
        raise ValueError(errors[0])
    repeated: dict[str, object] = getattr(args, _REPEATED, {})
    for dest, value in repeated.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, value)
    for old, new in RENAMED.items():
        if old in environ:
            logging.getLogger("kvrouter.publish").warning(
                "%s is read as %s, its name since the environment convention was unified; "
                "rename it",
                old,
                new,
            )
