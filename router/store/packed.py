"""``PackedTable``: one replica's set of block hashes with a tier mask each, kept in the
exact byte layout Redis stores, so a write sends bytes that already exist.

Records are 9 bytes: the 64-bit hash big-endian, then a mask byte (bit ``t`` set when the
block is cached in tier ``t``; state checkpoints use bit 0). Records live in buckets chosen
by the hash's top ``bits`` bits; a bucket is a ``bytearray`` of records in no order. The
table doubles its bucket count when the average bucket passes ``MAX_FILL`` records, which
keeps a bucket (and the bytes rewritten when it changes) small: memory in Redis stays close
to 9 bytes a record plus per-field overhead shared by ~16-32 records.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

RECORD = 9
RECORD_DTYPE = np.dtype([("h", ">u8"), ("m", "u1")])
MAX_FILL = 32
MAX_BITS = 24
_KEY = struct.Struct(">Q")


class PackedTable:
    """hash -> tier mask, bucketed. ``dirty``/``rebuilt`` record what changed since the last
    ``take_changes``. Not thread-safe."""

    __slots__ = ("bits", "buckets", "count", "dirty", "rebuilt")

    def __init__(self) -> None:
        self.bits = 0
        self.buckets: dict[int, bytearray] = {}
        self.count = 0
        self.dirty: set[int] = set()
        self.rebuilt = False

    @classmethod
    def from_arrays(
        cls, hashes: npt.NDArray[np.uint64], masks: npt.NDArray[np.uint8]
    ) -> PackedTable:
        """A table holding these (unique) hashes with their masks, built in bulk."""
        table = cls()
        records = np.empty(len(hashes), dtype=RECORD_DTYPE)
        records["h"] = hashes
        records["m"] = masks
        table.count = len(records)
        bits = 0
        while bits < MAX_BITS and table.count > MAX_FILL << bits:
            bits += 1
        table.bits = bits
        table.buckets = _split(records, bits)
        table.rebuilt = True
        return table

    def bucket_of(self, block: int) -> int:
        return block >> (64 - self.bits) if self.bits else 0

    def _find(self, buf: bytearray, key: bytes) -> int:
        pos = buf.find(key)
        while pos >= 0 and pos % RECORD:
            pos = buf.find(key, pos + 1)
        return pos

    def get(self, block: int) -> int:
        """The tier mask of ``block`` (0 when absent)."""
        buf = self.buckets.get(self.bucket_of(block))
        if buf is None:
            return 0
        pos = self._find(buf, _KEY.pack(block))
        return buf[pos + 8] if pos >= 0 else 0

    def add(self, block: int, bit: int) -> bool:
        """Set ``bit`` in the mask of ``block``; False when it was already set."""
        b = self.bucket_of(block)
        buf = self.buckets.get(b)
        key = _KEY.pack(block)
        if buf is None:
            self.buckets[b] = bytearray(key + bytes((bit,)))
        else:
            pos = self._find(buf, key)
            if pos >= 0:
                mask = buf[pos + 8]
                if mask & bit:
                    return False
                buf[pos + 8] = mask | bit
                self.dirty.add(b)
                return True
            buf += key
            buf.append(bit)
        self.count += 1
        self.dirty.add(b)
        return True

    def discard(self, block: int, bit: int) -> bool:
        """Clear ``bit`` in the mask of ``block`` (dropping it at mask 0); False if unset."""
        b = self.bucket_of(block)
        buf = self.buckets.get(b)
        if buf is None:
            return False
        pos = self._find(buf, _KEY.pack(block))
        if pos < 0 or not buf[pos + 8] & bit:
            return False
        mask = buf[pos + 8] & ~bit
        if mask:
            buf[pos + 8] = mask
        else:
            del buf[pos : pos + RECORD]
            self.count -= 1
            if not buf:
                del self.buckets[b]
        self.dirty.add(b)
        return True

    def clear(self) -> None:
        self.buckets.clear()
        self.count = 0
        self.bits = 0
        self.dirty.clear()
        self.rebuilt = True

    def maybe_grow(self) -> None:
        """Double the bucket count (re-split everything) while buckets are over-full."""
        bits = self.bits
        while bits < MAX_BITS and self.count > MAX_FILL << bits:
            bits += 1
        if bits == self.bits:
            return
        records = self.records()
        self.bits = bits
        self.buckets = _split(records, bits)
        self.dirty.clear()
        self.rebuilt = True

    def records(self) -> npt.NDArray[np.void]:
        """Every record as a structured array (fields ``h`` >u8 and ``m`` u1)."""
        return np.frombuffer(b"".join(self.buckets.values()), dtype=RECORD_DTYPE)

    def take_changes(self) -> tuple[bool, dict[int, bytes]]:
        """(rebuilt, changed buckets) since the last call. When rebuilt, the dict holds every
        bucket and the stored copy must be replaced whole; an empty value means delete."""
        if self.rebuilt:
            out = {b: bytes(buf) for b, buf in self.buckets.items()}
        else:
            out = {b: bytes(self.buckets.get(b, b"")) for b in self.dirty}
        rebuilt = self.rebuilt
        self.rebuilt = False
        self.dirty.clear()
        return rebuilt, out

    def all_buckets(self) -> dict[int, bytes]:
        return {b: bytes(buf) for b, buf in self.buckets.items()}


def _split(records: npt.NDArray[np.void], bits: int) -> dict[int, bytearray]:
    if not len(records):
        return {}
    hashes = records["h"].astype(np.uint64)
    ids = hashes >> np.uint64(64 - bits) if bits else np.zeros(len(hashes), dtype=np.uint64)
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    data = records[order].tobytes()
    cuts = np.flatnonzero(np.diff(ids)) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), len(ids)]
    return {
        int(ids[s]): bytearray(data[s * RECORD : e * RECORD])
        for s, e in zip(starts, ends, strict=True)
    }


def parse_records(values: Iterable[bytes]) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8]]:
    """Hashes and masks of stored bucket values. Raises ValueError on a torn record: checked
    per value (a bucket holds whole records), as two torn ones can join into whole ones."""
    values = list(values)
    for value in values:
        if len(value) % RECORD:
            raise ValueError(f"a bucket of {len(value)} bytes is not whole {RECORD}-byte records")
    arr = np.frombuffer(b"".join(values), dtype=RECORD_DTYPE)
    return arr["h"].astype(np.uint64), arr["m"].astype(np.uint8)


def hashes_by_bit(
    hashes: npt.NDArray[np.uint64], masks: npt.NDArray[np.uint8], bit: int
) -> list[int]:
    """Python ints of the hashes whose mask has ``bit`` set."""
    return hashes[(masks & bit) != 0].tolist()  # type: ignore[no-any-return]
