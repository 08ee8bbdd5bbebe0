"""The few operations a formula needs that differ between numbers and numpy arrays.

Cost and scoring formulas (router/core/load.py, router/core/policies.py) are written once
and evaluated either on plain numbers (one replica at a time: small fleets and the
simulator) or on numpy arrays (one element per replica: large fleets, where per-replica
Python would dominate a request's cost). Everything else they use (``+ - * / //``,
comparisons) behaves the same on both; these do not. (Conditionals are written as
arithmetic instead, e.g. ``maximum(x, 0) * flag``, exact on both.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _minimum(a: Any, b: Any) -> Any:
    return a if a <= b else b


def _maximum(a: Any, b: Any) -> Any:
    return a if a >= b else b


class Ops:
    """Operations on numbers (``SCALAR``); :data:`ARRAY` has the numpy ones. (Plain Python
    functions: a call costs about half of builtin ``min`` / ``max``, which parse ``key=``.)"""

    __slots__ = ()
    minimum: Callable[[Any, Any], Any] = staticmethod(_minimum)
    maximum: Callable[[Any, Any], Any] = staticmethod(_maximum)
    trunc: Callable[[Any], Any] = int  # toward zero, as an integer


class _ArrayOps(Ops):
    __slots__ = ()
    minimum = staticmethod(np.minimum)
    maximum = staticmethod(np.maximum)

    @staticmethod
    def trunc(a: Any) -> Any:
        return np.trunc(a).astype(np.int64)


SCALAR = Ops()
ARRAY: Ops = _ArrayOps()
