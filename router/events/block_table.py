"""One group's engine blocks as the re-blocker remembers them (router/events/reblock.py).

A full (generation-2) collection walks every entry of every GC-tracked dict, holding the
router's event loop meanwhile, and a dict becomes tracked again whenever a tracked key or
value goes in (a fresh tuple is tracked until a collection). An engine's cache holds
10^5-10^6 blocks, and in direct mode the router keeps one re-blocker per engine rank, so
these tables map an engine block's hash (an int) to ints and bytes only: they are never
tracked (tests/test_events_gc.py). A record's fields live in parallel dicts; the optional
ones (parent, covers, tail, multimodal items, chunk) are absent when empty.

Contract: ``word`` holds every block of the table; the other dicts hold only hashes that
``word`` holds.
"""

from __future__ import annotations

import marshal
import sys
from array import array
from collections.abc import Sequence
from typing import Any, Final

from router.core.hashing import MmItem, as_u32_array
from router.core.types import Kind

# ``word``: end << 4 | kind << 3 | media (tier bits, one per Tier: 3 of them)
MEDIA_BITS: Final = 7
_KIND_SHIFT: Final = 3
END_SHIFT: Final = 4
STATE_BIT: Final = int(Kind.STATE) << _KIND_SHIFT


def word(end: int, kind: Kind, media: int) -> int:
    return end << END_SHIFT | int(kind) << _KIND_SHIFT | media


def kind_of(w: int) -> Kind:
    return Kind.STATE if w & STATE_BIT else Kind.KV


class BlockTable:
    """One group's engine blocks, keyed by engine block hash."""

    __slots__ = ("chain", "chunk", "covers", "mm", "parent", "tail", "word")

    def __init__(self) -> None:
        self.word: dict[int, int] = {}  # see ``word``
        self.parent: dict[int, int] = {}  # the parent engine block's hash (absent: none)
        # canonical hash of the last complete router block at or before the block's end
        self.chain: dict[int, int] = {}
        # the canonical blocks it overlaps (complete ones): one as an int, several as
        # ``marshal`` bytes of their tuple
        self.covers: dict[int, int | bytes] = {}
        # the tokens after CHAIN's router block, < block_size of them (little-endian u32)
        self.tail: dict[int, bytes] = {}
        self.mm: dict[int, bytes] = {}  # MmItems starting in the tail (``pack_mm``)
        # ancestors offloaded with it in one chunk that a token-less store keyed (marshal)
        self.chunk: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self.word)

    def clear(self) -> None:
        for table in self._tables():
            table.clear()

    def add(
        self,
        h: int,
        parent: int | None,
        w: int,
        chain: int,
        covers: tuple[int, ...] | list[int],
        tail: bytes,
        mm: bytes,
    ) -> None:
        """A new block ``h`` (not in the table)."""
        self.word[h] = w
        self.chain[h] = chain
        if parent is not None:
            self.parent[h] = parent
        if len(covers) == 1:
            self.covers[h] = covers[0]
        elif covers:
            self.covers[h] = marshal.dumps(tuple(covers))
        if tail:
            self.tail[h] = tail
        if mm:
            self.mm[h] = mm

    def covers_of(self, h: int) -> tuple[int, ...]:
        c = self.covers.get(h)
        if c is None:
            return ()
        if type(c) is int:
            return (c,)
        return marshal.loads(c)  # type: ignore[no-any-return,arg-type]

    def set_covers(self, h: int, covers: tuple[int, ...]) -> None:
        self.covers[h] = covers[0] if len(covers) == 1 else marshal.dumps(covers)

    def chunk_of(self, h: int) -> tuple[int, ...]:
        c = self.chunk.get(h)
        return () if c is None else marshal.loads(c)

    def set_chunk(self, h: int, chunk: tuple[int, ...]) -> None:
        self.chunk[h] = marshal.dumps(chunk)

    def remove(self, h: int) -> None:
        """Forget block ``h`` (in the table)."""
        del self.word[h]
        del self.chain[h]
        self.parent.pop(h, None)
        self.covers.pop(h, None)
        if self.tail:
            self.tail.pop(h, None)
        if self.mm:
            self.mm.pop(h, None)
        if self.chunk:
            self.chunk.pop(h, None)

    def _tables(self) -> tuple[dict[int, Any], ...]:
        return (self.word, self.parent, self.chain, self.covers, self.tail, self.mm, self.chunk)


_NATIVE_U32: Final = sys.byteorder == "little" and array("I").itemsize == 4


def u32_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes, as ``hash_prompt`` reads them (ValueError
    for ids outside [0, 2**32), as there)."""
    if _NATIVE_U32:
        try:
            return array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            pass  # as_u32_array raises the error
    return as_u32_array(tokens).tobytes()


def pack_mm(items: tuple[MmItem, ...]) -> bytes:
    """Multimodal items as bytes (``unpack_mm``; empty: none)."""
    if not items:
        return b""
    return marshal.dumps(tuple(x for it in items for x in (it.start, it.identifier)))


def unpack_mm(raw: bytes | None) -> tuple[MmItem, ...]:
    if not raw:
        return ()
    flat = marshal.loads(raw)
    return tuple(MmItem(flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
