"""argparse ``type=`` checks for the command lines' numeric flags: a value outside its range
is refused while parsing (exit status 2, ``argument --FLAG: must be ...``), before any work
starts, instead of a traceback or a run that reports figures of nothing."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An integer flag's type: ``low`` or more."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def positive_float(text: str) -> float:
    """A float flag's type: > 0 and finite."""
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A float flag's type: >= 0 and finite."""
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {value}")
    return value


def fraction(text: str) -> float:
    """A float flag's type: a share, in [0, 1]."""
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def sizes(text: str) -> list[int]:
    """A comma-separated list flag's type: one or more integers, each >= 1."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must list integers >= 1, got {text!r}")
    return values


def port(text: str) -> int:
    """A TCP port flag's type: 0 (any free port) to 65535."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value
