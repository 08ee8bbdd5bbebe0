"""Values derived from a tuple of replica keys, remembered while nothing they depend on moved.

Routing passes each model's key tuple (the registry keeps one per model until the fleet
changes) request after request; where those replicas sit in the prefix index
(``PrefixIndex.slots``) and in the load table (``LoadTracker.columns``) is worked out once per
tuple and *generation* (a counter the owner bumps whenever a position may have changed), not
per request. Only tuples are remembered: a list may be changed in place, and a caller's
one-off list (a gRPC Pick's candidates) would only push the models' tuples out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from router.core.types import ReplicaKey

T = TypeVar("T")


class PerTuple(Generic[T]):
    """Least-recently-used map from a key tuple (by identity) to a value of one generation."""

    __slots__ = ("_entries", "_size")

    def __init__(self, size: int = 16) -> None:
        self._size = size
        # id(keys) -> (keys, generation, value): the held reference keeps the id unique
        self._entries: dict[int, tuple[Sequence[ReplicaKey], int, T]] = {}

    def get(self, keys: Sequence[ReplicaKey], generation: int) -> T | None:
        if type(keys) is not tuple:
            return None
        found = self._entries.pop(id(keys), None)
        if found is None or found[0] is not keys or found[1] != generation:
            return None
        self._entries[id(keys)] = found  # most recently used
        return found[2]

    def put(self, keys: Sequence[ReplicaKey], generation: int, value: T) -> None:
        if type(keys) is not tuple:
            return
        if len(self._entries) >= self._size:
            del self._entries[next(iter(self._entries))]
        self._entries[id(keys)] = (keys, generation, value)
