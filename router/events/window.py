"""Sliding-window attention groups, read as prefix checkpoints.

A sliding-window layer attends to the last ``window`` tokens only, so an engine serves a
cached prefix of L tokens from a sliding-window group when the blocks holding the window
before L are cached there, whatever happened to the blocks before it. vLLM's rule
(``SlidingWindowManager.find_longest_cache_hit``, 0.34): the ``need = cdiv(window - 1,
block_size)`` engine blocks ending at L are all cached in the group, or, for a prefix of
fewer blocks than that, every block from the start. The engine's hit is the longest prefix
usable in every group (``HybridKVCacheCoordinator``): the full-attention KV of [0, L) and the
window before L.

That is the recurrent-state rule with a different reason for a checkpoint: a
:class:`WindowGroup` says at which canonical prefixes (router block boundaries) the window is
complete, and the re-blocker publishes those as ``Kind.STATE`` checkpoints, stored while the
window's blocks are and removed when one of them goes. So the index, the routing rule and
the speculation treat a full + sliding-window model (gpt-oss, Gemma 3) like a hybrid one.
Beside other state-like groups (a mamba group, a window of another size) a checkpoint is
published only where every group has one (router/events/state_groups.py).

Blocks outside the window are freed while a request runs, so they are evicted first: the
full-attention KV of a shared prefix routinely outlives the window blocks at its end, and a
KV-only index would predict hits the engine does not grant. vLLM 0.34 may also cache only
the window tails of segments (``prefix_cache_retention_interval``): its events then name
only the kept blocks, and checkpoints exist where their windows are complete.

Contract: every block is named by the engine hash it shares with the full-attention block
at the same position (vLLM hashes a block's tokens once for every group of one block size);
the caller passes that block's parent hash, its depth in engine blocks and the canonical hash
of the prefix it ends (None off a router block boundary).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Final


def blocks_needed(window: int, block_size: int) -> int:
    """Engine blocks a hit needs before its end: vLLM's ``cdiv(window - 1, block_size)``
    (at least one)."""
    return max(1, -(-(window - 1) // block_size))


# A block's word (``WindowGroup._word``): depth << _DEPTH_SHIFT | run << _RUN_SHIFT | flags.
# ``depth``: engine blocks from the sequence start to the block's end (0: not known, a
# placeholder for a parent named before it was stored); ``run``: stored blocks ending here,
# capped at ``need`` (at most the chain's length); _STORED; _VALID: a checkpoint is
# published here. Int-valued tables are never GC-tracked (router/events/block_table.py).
_STORED: Final = 1
_VALID: Final = 2
_RUN_SHIFT: Final = 2
_RUN_BITS: Final = (1 << 32) - 1
_DEPTH_SHIFT: Final = 34


@dataclass(slots=True)
class WindowChange:
    """Checkpoints that became usable (``stored``: canonical hash, depth in engine blocks)
    and those no longer usable (``removed``: canonical hashes)."""

    stored: list[tuple[int, int]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


# one stored block: (hash, parent hash, depth in engine blocks, canonical hash or None)
Block = tuple[int, int | None, int, int | None]


class WindowGroup:
    """One sliding-window group of one engine: which cached blocks complete a window.
    Blocks are keyed by engine hash in int-valued dicts (never GC-tracked)."""

    __slots__ = (
        "_canonical", "_child", "_last", "_next", "_parent", "_prev", "_word", "need", "visits",
    )  # fmt: skip

    def __init__(self, need: int) -> None:
        if need <= 0:
            raise ValueError("need must be positive")
        self.need = need
        self._word: dict[int, int] = {}  # see _DEPTH_SHIFT
        self._parent: dict[int, int] = {}  # absent: not known
        self._canonical: dict[int, int] = {}  # the prefix ending here, at router boundaries
        # a block's children, in the order they were named: a list linked through int
        # tables (a block a thousand cached prompts continue takes a child in O(1))
        self._child: dict[int, int] = {}  # the first child (absent: none)
        self._last: dict[int, int] = {}  # the last child, once there are two or more
        self._next: dict[int, int] = {}  # the next sibling (absent: none)
        self._prev: dict[int, int] = {}  # the previous sibling (absent: none)
        self.visits = 0  # nodes recomputed, over the group's life (a cost figure)

    def __len__(self) -> int:
        return len(self._word)

    def clear(self) -> None:
        for table in (
            self._word, self._parent, self._canonical, self._child, self._last, self._next,
            self._prev,
        ):  # fmt: skip
            table.clear()

    def checkpoints(self) -> set[int]:
        """The canonical hashes of the checkpoints published now (the window before each
        is cached)."""
        canonical = self._canonical
        return {canonical[h] for h, w in self._word.items() if w & _VALID and h in canonical}

    def stored(self, blocks: list[Block], change: WindowChange) -> None:
        """These blocks are cached in the group (module docstring for what each names)."""
        flipped = []
        words, canonicals, parents = self._word, self._canonical, self._parent
        for h, parent, depth, canonical in blocks:
            w = words.get(h)
            if w is None:
                words[h] = depth << _DEPTH_SHIFT | _STORED
                if canonical is not None:
                    canonicals[h] = canonical
                if parent is not None:
                    parents[h] = parent
                    self._add_child(parent, h)
            elif w & _STORED:
                continue
            else:  # a placeholder (a parent named before it was stored) or stored again
                words[h] = depth << _DEPTH_SHIFT | w & ~(-1 << _DEPTH_SHIFT) | _STORED
                if canonical is None:
                    canonicals.pop(h, None)
                else:
                    canonicals[h] = canonical
                if h not in parents and parent is not None:
                    parents[h] = parent
                    self._add_child(parent, h)
            flipped.append(h)
        self._refresh(flipped, change)

    def removed(self, hashes: tuple[int, ...] | list[int], change: WindowChange) -> int:
        """These blocks left the group's cache; how many of them were stored."""
        flipped = []
        words = self._word
        for h in hashes:
            w = words.get(h)
            if w is not None and w & _STORED:
                words[h] = w & ~_STORED
                flipped.append(h)
        self._refresh(flipped, change)
        for h in flipped:
            self._forget(h)
        return len(flipped)

    def _add_child(self, parent: int, h: int) -> None:
        """``h`` is a child of ``parent`` (a placeholder made for it if not known)."""
        if parent not in self._word:
            self._word[parent] = 0
        first = self._child.get(parent)
        if first is None:
            self._child[parent] = h
            return
        last = self._last.get(parent, first)
        self._next[last] = h
        self._prev[h] = last
        self._last[parent] = h

    def _remove_child(self, parent: int, h: int) -> None:
        """``h`` (a child of ``parent``) is no longer one."""
        if h not in self._prev and self._child.get(parent) != h:
            return  # not a child of it
        before, after = self._prev.pop(h, None), self._next.pop(h, None)
        if before is None:
            if after is None:
                del self._child[parent]
            else:
                self._child[parent] = after
        else:
            if after is None:
                del self._next[before]
            else:
                self._next[before] = after
        if after is None:
            if before is None or before == self._child.get(parent):
                self._last.pop(parent, None)
            else:
                self._last[parent] = before
        else:
            if before is None:
                del self._prev[after]
            else:
                self._prev[after] = before
            if after == self._last.get(parent) and after == self._child[parent]:
                del self._last[parent]

    def _refresh(self, changed: list[int], change: WindowChange) -> None:
        """Recompute runs and checkpoints from the ``changed`` blocks down their
        descendants, as far as a run changes (at most ``need`` blocks deep), parents before
        children (by depth), each block once: a chain of n blocks costs O(n + need)."""
        if not changed:
            return
        words, parents, canonicals, need = self._word, self._parent, self._canonical, self.need
        first_child, following = self._child, self._next
        queued = set(changed)
        heap = [(words[h] >> _DEPTH_SHIFT, seq, h) for seq, h in enumerate(changed)]
        heapq.heapify(heap)
        seq = len(heap)
        self.visits += len(heap)
        while heap:
            depth, _, h = heapq.heappop(heap)
            w = words[h]
            canonical = None
            if w & _STORED:
                p = parents.get(h)
                above = words.get(p) if p is not None else None
                run = min(need, (0 if above is None else above >> _RUN_SHIFT & _RUN_BITS) + 1)
                canonical = canonicals.get(h)
                valid = canonical is not None and run >= min(need, depth)
            else:
                run = 0
                valid = False
            if valid:
                if not w & _VALID:
                    w |= _VALID
                    assert canonical is not None
                    change.stored.append((canonical, depth))
            elif w & _VALID:
                w &= ~_VALID
                canonical = canonicals.get(h)
                if canonical is not None:
                    change.removed.append(canonical)
            old = w >> _RUN_SHIFT & _RUN_BITS
            if run != old:  # a flipped block's always does
                w += (run - old) << _RUN_SHIFT
                c = first_child.get(h)
                while c is not None:
                    if c in words and c not in queued:
                        queued.add(c)
                        seq += 1
                        self.visits += 1
                        heapq.heappush(heap, (words[c] >> _DEPTH_SHIFT, seq, c))
                    c = following.get(c)
            words[h] = w

    def _forget(self, h: int) -> None:
        """Drop an unstored block nobody below needs, and placeholders above it left
        empty."""
        words = self._word
        while True:
            w = words.get(h)
            if w is None or w & _STORED or h in self._child:
                return
            del words[h]
            self._canonical.pop(h, None)
            parent = self._parent.pop(h, None)
            if parent is None or parent not in words:
                return
            self._remove_child(parent, h)
            h = parent
