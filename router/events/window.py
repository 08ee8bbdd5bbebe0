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


def blocks_needed(window: int, block_size: int) -> int:
    """Engine blocks a hit needs before its end: vLLM's ``cdiv(window - 1, block_size)``
    (at least one)."""
    return max(1, -(-(window - 1) // block_size))


@dataclass(slots=True)
class _Node:
    parent: int | None
    depth: int  # engine blocks from the sequence start to this block's end (0: not known)
    canonical: int | None  # canonical hash of the prefix ending here, at router boundaries
    stored: bool = False
    run: int = 0  # stored blocks ending here, capped at ``need``
    valid: bool = False  # a checkpoint is published here
    mark: int = 0  # the last refresh that queued it
    children: list[int] = field(default_factory=list)


@dataclass(slots=True)
class WindowChange:
    """Checkpoints that became usable (``stored``: canonical hash, depth in engine blocks)
    and those no longer usable (``removed``: canonical hashes)."""

    stored: list[tuple[int, int]] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


# one stored block: (hash, parent hash, depth in engine blocks, canonical hash or None)
Block = tuple[int, int | None, int, int | None]


class WindowGroup:
    """One sliding-window group of one engine: which cached blocks complete a window."""

    __slots__ = ("_nodes", "_refreshes", "need", "visits")

    def __init__(self, need: int) -> None:
        if need <= 0:
            raise ValueError("need must be positive")
        self.need = need
        self._nodes: dict[int, _Node] = {}
        self._refreshes = 0
        self.visits = 0  # nodes recomputed, over the group's life (a cost figure)

    def __len__(self) -> int:
        return len(self._nodes)

    def clear(self) -> None:
        self._nodes.clear()

    def checkpoints(self) -> set[int]:
        """The canonical hashes of the checkpoints published now (the window before each
        is cached)."""
        return {n.canonical for n in self._nodes.values() if n.valid and n.canonical is not None}

    def stored(self, blocks: list[Block], change: WindowChange) -> None:
        """These blocks are cached in the group (module docstring for what each names)."""
        flipped = []
        for h, parent, depth, canonical in blocks:
            node = self._nodes.get(h)
            if node is None:
                node = self._nodes[h] = _Node(parent, depth, canonical)
                if parent is not None:
                    self._parent_of(parent).children.append(h)
            elif node.stored:
                continue
            else:  # a placeholder (a parent named before it was stored) or stored again
                node.depth, node.canonical = depth, canonical
                if node.parent is None and parent is not None:
                    node.parent = parent
                    self._parent_of(parent).children.append(h)
            node.stored = True
            flipped.append(node)
        self._refresh(flipped, change)

    def removed(self, hashes: tuple[int, ...] | list[int], change: WindowChange) -> int:
        """These blocks left the group's cache; how many of them were stored."""
        flipped = []
        for h in hashes:
            node = self._nodes.get(h)
            if node is not None and node.stored:
                node.stored = False
                flipped.append((h, node))
        self._refresh([node for _, node in flipped], change)
        for h, node in flipped:
            self._forget(h, node)
        return len(flipped)

    def _parent_of(self, parent: int) -> _Node:
        node = self._nodes.get(parent)
        if node is None:
            node = self._nodes[parent] = _Node(None, 0, None)
        return node

    def _refresh(self, changed: list[_Node], change: WindowChange) -> None:
        """Recompute runs and checkpoints from the ``changed`` nodes down their descendants,
        as far as a run changes (at most ``need`` blocks deep), parents before children
        (by depth), each node once: a chain of n blocks costs O(n + need)."""
        if not changed:
            return
        self._refreshes += 1
        mark, nodes, need = self._refreshes, self._nodes, self.need
        heap: list[tuple[int, int, _Node]] = []
        for seq, node in enumerate(changed):
            node.mark = mark
            heap.append((node.depth, seq, node))
        heapq.heapify(heap)
        seq = len(heap)
        self.visits += len(heap)
        while heap:
            node = heapq.heappop(heap)[2]
            if node.stored:
                above = nodes.get(node.parent) if node.parent is not None else None
                run = min(need, (above.run if above is not None else 0) + 1)
            else:
                run = 0
            valid = node.stored and node.canonical is not None and run >= min(need, node.depth)
            if valid != node.valid:
                node.valid = valid
                if valid:
                    assert node.canonical is not None
                    change.stored.append((node.canonical, node.depth))
                elif node.canonical is not None:
                    change.removed.append(node.canonical)
            if run != node.run:  # a flipped node's always does
                node.run = run
                for c in node.children:
                    child = nodes.get(c)
                    if child is not None and child.mark != mark:
                        child.mark = mark
                        seq += 1
                        self.visits += 1
                        heapq.heappush(heap, (child.depth, seq, child))

    def _forget(self, h: int, node: _Node) -> None:
        """Drop an unstored node nobody below needs, and placeholders above it left empty."""
        while not node.stored and not node.children and self._nodes.get(h) is node:
            del self._nodes[h]
            parent = self._nodes.get(node.parent) if node.parent is not None else None
            if parent is None:
                return
            parent.children.remove(h)
            assert node.parent is not None
            h, node = node.parent, parent
