"""What ``PrefixIndex.match`` finds: replicas grouped by match length as slot bitmasks, the
depth bisection that builds those groups, and the per-replica values read from them.

A group is ``(length, mask)``: every replica whose slot bit is in ``mask`` holds the first
``length`` blocks of the request. Groups of one query are disjoint (each replica has one match
length), so a lookup costs a few operations per distinct length, whatever the number of
replicas that share the prefix (router/core/index_tables.py states the layout behind the
slots).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from router.core.types import NO_MATCH, PrefixMatch, ReplicaKey


def iter_slots(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixMatches:
    """Result of ``PrefixIndex.match``: replicas grouped by match length (bitmasks), so a
    lookup costs the same whether 1 or 1,000 replicas share the prefix. Per-replica values
    are produced on demand by ``get``."""

    __slots__ = ("_gpu", "_host", "_key_of", "_kv", "_slot_of", "_usable")

    def __init__(
        self,
        slot_of: dict[ReplicaKey, int],
        key_of: list[ReplicaKey | None],
        kv: list[tuple[int, int]],
        gpu: list[tuple[int, int]] | None,
        host: list[tuple[int, int]] | None,
        usable: list[tuple[int, int]] | None,
    ) -> None:
        self._slot_of = slot_of
        self._key_of = key_of
        self._kv = kv
        self._gpu = gpu
        self._host = host
        self._usable = usable

    @classmethod
    def empty(cls) -> PrefixMatches:
        return cls({}, [], [], None, None, None)

    def __len__(self) -> int:
        return sum(mask.bit_count() for _, mask in self._kv)

    def __bool__(self) -> bool:
        return bool(self._kv)

    def longest(self) -> int:
        """Longest KV match over all replicas, in blocks."""
        return max((length for length, _ in self._kv), default=0)

    def get(self, key: ReplicaKey, default: PrefixMatch = NO_MATCH) -> PrefixMatch:
        slot = self._slot_of.get(key)
        if slot is None:
            return default
        return self._at(slot) or default

    def _at(self, slot: int) -> PrefixMatch | None:
        bit = 1 << slot
        kv = length_of(self._kv, bit)
        if not kv:
            return None
        gpu = kv if self._gpu is None else min(length_of(self._gpu, bit), kv)
        host = kv if self._host is None else max(gpu, min(length_of(self._host, bit), kv))
        usable = kv if self._usable is None else length_of(self._usable, bit)
        return PrefixMatch(kv_blocks=kv, gpu_blocks=gpu, host_blocks=host, usable_blocks=usable)

    def items(self) -> Iterator[tuple[ReplicaKey, PrefixMatch]]:
        key_of = self._key_of
        if self._gpu is None and self._host is None and self._usable is None:
            # Common case (GPU-only, non-hybrid): one shared value per length group.
            for length, mask in self._kv:
                match = PrefixMatch(length, length, length, length)
                for slot in iter_slots(mask):
                    key = key_of[slot]
                    if key is not None:
                        yield key, match
            return
        for slot in iter_slots(union_of(self._kv)):
            key = self._key_of[slot]
            found = self._at(slot)
            if key is not None and found is not None:
                yield key, found

    def as_dict(self) -> dict[ReplicaKey, PrefixMatch]:
        return dict(self.items())

    def columns(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``get`` for many replicas at once, as arrays: (kv, gpu, host, usable) blocks of the
        replica in each of ``slots`` (PrefixIndex.slots; -1 and unmatched slots give 0s).
        A few array operations per match-length group, whatever the number of replicas."""
        kv = lengths_at(self._kv, slots)
        gpu = kv if self._gpu is None else np.minimum(lengths_at(self._gpu, slots), kv)
        host = (
            kv
            if self._host is None
            else np.maximum(gpu, np.minimum(lengths_at(self._host, slots), kv))
        )
        usable = kv if self._usable is None else lengths_at(self._usable, slots)
        return kv, gpu, host, usable


def lengths_at(groups: list[tuple[int, int]], slots: np.ndarray) -> np.ndarray:
    """Per element of ``slots``: the length of the group whose mask holds that slot, else 0
    (groups are disjoint: each replica has one match length)."""
    out = np.zeros(len(slots), dtype=np.int64)
    if not groups or not len(slots):
        return out
    top = int(slots.max())
    if top < 0:
        return out
    nbytes = top // 8 + 1
    safe = np.maximum(slots, 0)
    known = slots >= 0
    for length, mask in groups:
        if mask & (mask - 1) == 0:  # one replica (a session's own chain): one comparison
            out[slots == mask.bit_length() - 1] = length
            continue
        mask &= (1 << (nbytes * 8)) - 1  # slots above the ones asked for do not matter
        bits = np.unpackbits(
            np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little"
        )
        out[bits[safe].astype(bool) & known] = length
    return out


def length_of(groups: list[tuple[int, int]], bit: int) -> int:
    for length, mask in groups:
        if mask & bit:
            return length
    return 0


def union_of(groups: list[tuple[int, int]]) -> int:
    mask = 0
    for _, group in groups:
        mask |= group
    return mask


def bisect_lengths(
    hashes: Sequence[int], holders: Callable[[int], int], within: int
) -> list[tuple[int, int]]:
    """Group replicas (bitmask) by KV match length in blocks; zero-length ones are omitted.

    Invariant of each segment (lo, hi, mlo, mhi): replicas in ``mlo`` hold depth ``lo``,
    those in ``mhi`` (a subset) hold depth ``hi``; the ones in ``mlo ^ mhi`` stop in (lo, hi].
    """
    n = len(hashes)
    m0 = holders(hashes[0]) & within
    if not m0:
        return []
    out: list[tuple[int, int]] = []
    mn = holders(hashes[n - 1]) & m0 if n > 1 else m0
    if mn:
        out.append((n, mn))
    if m0 == mn:
        return out
    stack = [(0, n - 1, m0, mn)]
    while stack:
        lo, hi, mlo, mhi = stack.pop()
        if hi - lo == 1:
            out.append((hi, mlo ^ mhi))
            continue
        mid = (lo + hi) // 2
        mmid = (holders(hashes[mid]) & mlo) | mhi
        if mmid != mlo:
            stack.append((lo, mid, mlo, mmid))
        if mmid != mhi:
            stack.append((mid, hi, mmid, mhi))
    return out


def usable_lengths(
    hashes: Sequence[int],
    kv_groups: list[tuple[int, int]],
    state_holders: Callable[[int], int],
    candidates: int,
    limit: int | None = None,
) -> list[tuple[int, int]]:
    """Largest L <= min(kv length, ``limit``) with a state checkpoint at L, grouped like the
    KV lengths; replicas without one are left out (their usable length is 0).

    Walks depth downward from the longest KV match; each replica stops at its first
    checkpoint. Replicas with no checkpoints at all are never probed.
    """
    groups = sorted(kv_groups, key=lambda g: g[0], reverse=True)
    found: list[tuple[int, int]] = []
    active = 0
    i = 0
    depth = groups[0][0] if limit is None else min(groups[0][0], limit)
    while depth > 0:
        while i < len(groups) and groups[i][0] >= depth:
            active |= groups[i][1] & candidates
            i += 1
        if not active:
            if i == len(groups):
                break
            depth = groups[i][0]
            continue
        hit = state_holders(hashes[depth - 1]) & active
        if hit:
            found.append((depth, hit))
            active ^= hit
        depth -= 1
    return found
