"""The few operations a formula needs that differ between numbers and numpy arrays.

Cost and scoring formulas (router/core/load.py, router/core/policies.py) are written once
and evaluated either on plain numbers (one replica at a time: small fleets and the
simulator) or on numpy arrays (one element per replica: large fleets, where per-replica
Python would dominate a request's cost). Everything else they use (``+ - * / //``,
comparisons) behaves the same on both; these do not. (Conditionals are written as
arithmetic instead, e.g. ``maximum(x, 0) * flag``, exact on both.)
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Ops:
    """Operations on numbers (``SCALAR``); :data:`ARRAY` has the numpy ones. (Methods, not
    builtin ``min`` / ``max``, which parse ``key=``: a call costs about half. Methods rather
    than functions stored on the class, so that compiled builds (mypyc) dispatch the
    override too.)"""

    __slots__ = ()

    def minimum(self, a: Any, b: Any) -> Any:
        return a if a <= b else b

    def maximum(self, a: Any, b: Any) -> Any:
        return a if a >= b else b

    def trunc(self, a: Any) -> Any:
        """Toward zero, as an integer."""
        return int(a)


class _ArrayOps(Ops):
    __slots__ = ()

    def minimum(self, a: Any, b: Any) -> Any:
        return np.minimum(a, b)

    def maximum(self, a: Any, b: Any) -> Any:
        return np.maximum(a, b)

    def trunc(self, a: Any) -> Any:
        return np.trunc(a).astype(np.int64)


SCALAR = Ops()
ARRAY: Ops = _ArrayOps()
