"""Request values read as vLLM reads them: its request models are pydantic models in lax mode,
which take ``"stream": "yes"`` or ``"max_tokens": 5.0`` as ``True`` and ``5``. The router reads
the few fields it needs (router.service.intake, router.service.stream_usage,
router.tokenize.request_fields) the same way, so it neither refuses a request the engine serves
nor reads it otherwise than the engine.

Each function returns :data:`INVALID` for a value pydantic refuses (the engine answers 400).
"""

from __future__ import annotations

import enum
from typing import Final


class Invalid(enum.Enum):
    """A value pydantic refuses."""

    INVALID = 0


INVALID: Final = Invalid.INVALID

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(value: object) -> bool | Invalid | None:
    """``value`` as a pydantic ``bool | None`` field reads it: a bool, None, the numbers 0 and
    1, or one of pydantic's words (any case, no surrounding space); else :data:`INVALID`."""
    if value is None or type(value) is bool:
        return value
    if type(value) is int or type(value) is float:
        if value == 1:
            return True
        if value == 0:
            return False
        return INVALID
    if type(value) is str:
        low = value.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    return INVALID


def lax_int(value: object) -> int | Invalid | None:
    """``value`` as a pydantic ``int | None`` field reads it: an int (a bool as 0 / 1), None,
    a float with no fraction, or a decimal string (surrounding space, a sign, ``_`` between
    digits and a zero fraction allowed); else :data:`INVALID`."""
    if value is None or type(value) is int:
        return value
    if type(value) is bool:
        return int(value)
    if type(value) is float:
        return int(value) if value.is_integer() and abs(value) < 2**63 else INVALID
    if type(value) is str:
        text = value.strip()
        whole, dot, fraction = text.partition(".")
        if dot and (not fraction or fraction.strip("0")):
            return INVALID
        digits = whole.lstrip("+-")
        if len(whole) - len(digits) > 1 or not digits.replace("_", "").isascii():
            return INVALID
        try:
            return int(whole)
        except ValueError:
            return INVALID
    return INVALID
