"""Checkpoints of an engine with several state-like groups: usable only where all have one.

A hybrid engine serves a cached prefix of L tokens only where every group can resume at L
(vLLM's ``HybridKVCacheCoordinator`` grants the longest prefix every group's manager
accepts): the full-attention KV of [0, L), a recurrent state saved at L in each ``mamba``
group, and the window before L in each sliding-window group. The re-blocker turns both of
the last two into ``Kind.STATE`` checkpoints (canonical hash of the prefix they end), one
group at a time. With one state-like group those are the engine's checkpoints as they are;
with more (mamba + sliding window as in SambaY / Phi-4-mini-flash, two windows of different
sizes, two mamba groups) a checkpoint is published only while every group holds it, and
withdrawn as soon as one loses it.

:class:`StateGroups` keeps, for each group, the checkpoints it holds as the index would see
them were that group the engine's only one: a hash is held from the group's last store of
it to its next removal, whatever the tier (the index keeps one state set per replica, of
every tier). What it publishes is their intersection. A group first seen after checkpoints
were published (the router learns an engine's groups from its events) withdraws those it
does not hold.

A group's checkpoints are the keys of a dict of int -> int (the value is unused, 0), not a
set: a set is always tracked by the garbage collector (every full collection would walk
every checkpoint), a dict holding only ints never is (tests/test_events_gc.py;
router/events/block_table.py says why that matters).

Pure: no I/O, no clock; the caller turns the hashes returned into index events.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class StateGroups:
    """The state-like groups of one engine (two or more) and the checkpoints each holds."""

    __slots__ = ("_held",)

    def __init__(self, held: Mapping[int, Iterable[int]]) -> None:
        """``held``: the groups known so far and what each holds; their intersection is what
        is published from now on (the caller publishes nothing else)."""
        # group -> its checkpoints (keys; module docstring)
        self._held: dict[int, dict[int, int]] = {
            group: dict.fromkeys(hashes, 0) for group, hashes in held.items()
        }

    def __contains__(self, group: int) -> bool:
        return group in self._held

    def groups(self) -> tuple[int, ...]:
        return tuple(self._held)

    def published(self) -> set[int]:
        """The checkpoints every group holds."""
        held = sorted(self._held.values(), key=len)
        if not held:
            return set()
        out = set(held[0])
        for other in held[1:]:
            out &= other.keys()
        return out

    def join(self, group: int, held: Iterable[int] = ()) -> list[int]:
        """A group seen for the first time, holding ``held``: the checkpoints published
        before that it lacks (to withdraw). A known group: nothing changes."""
        if group in self._held:
            return []
        before = self.published()
        mine = self._held[group] = dict.fromkeys(held, 0)
        return [h for h in before if h not in mine]

    def stored(self, group: int, hashes: Iterable[int]) -> list[int]:
        """``group`` now holds ``hashes``: those every group holds (to publish; ones
        published already are announced again, as a single group's would be)."""
        mine = self._held.get(group)
        if mine is None:
            mine = self._held[group] = {}
        out = list(hashes)
        mine.update(dict.fromkeys(out, 0))
        for g, held in self._held.items():
            if g != group:
                out = [h for h in out if h in held]
        return out

    def removed(self, group: int, hashes: Iterable[int]) -> list[int]:
        """``group`` no longer holds ``hashes``: those that were published (to withdraw)."""
        mine = self._held.get(group)
        if mine is None:
            return []
        out = []
        for h in hashes:
            if h in mine:
                del mine[h]
                out.append(h)
        for g, held in self._held.items():
            if g != group:
                out = [h for h in out if h in held]
        return out

    def reset(self, held: Mapping[int, Iterable[int]]) -> set[int]:
        """Every group's holdings replaced (the engine cleared its cache and kept some
        blocks; a group not named holds nothing): what is published now."""
        for group in self._held:
            self._held[group] = dict.fromkeys(held.get(group, ()), 0)
        return self.published()
