"""Wire encoding of change-stream entries (shared by both stores).

An entry is a flat map of byte fields: ``t`` type (``B`` batch, ``R`` reset, ``L`` load,
``U`` replica up, ``D`` replica down), ``r`` replica name, ``d`` dp rank, ``s`` seq, and a
body: ``e`` msgpack list of ``[op, tier, kind, packed hashes]`` (op 0 stored, 1 removed,
2 cleared; hashes as consecutive big-endian u64), ``l`` a load sample (JSON), ``i`` a
replica info (JSON). Decoding is total: a bad entry raises ``ValueError`` only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

import msgpack
import numpy as np

from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    IndexEvent,
    Kind,
    ReplicaKey,
    Tier,
)
from router.store.base import (
    BatchChange,
    Change,
    LoadChange,
    LoadSample,
    ReplicaDown,
    ReplicaInfo,
    ReplicaUp,
    ResetChange,
)

_STORED, _REMOVED, _CLEARED = 0, 1, 2


def encode_events(events: tuple[IndexEvent, ...]) -> bytes:
    rows: list[list[object]] = []
    for ev in events:
        if isinstance(ev, AllCleared):
            rows.append([_CLEARED, 0, 0, b""])
        else:
            op = _STORED if isinstance(ev, BlocksStored) else _REMOVED
            packed = np.array(ev.hashes, dtype=">u8").tobytes()
            rows.append([op, int(ev.tier), int(ev.kind), packed])
    return msgpack.packb(rows)  # type: ignore[no-any-return]


def decode_events(body: bytes) -> tuple[IndexEvent, ...]:
    try:
        rows = msgpack.unpackb(body)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"bad events body: {exc}") from None
    if not isinstance(rows, list):
        raise ValueError("events body is not a list")
    out: list[IndexEvent] = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[3], bytes)):
            raise ValueError(f"bad event row {row!r:.80}")
        op, tier, kind, packed = row
        if op == _CLEARED:
            out.append(AllCleared())
            continue
        if op not in (_STORED, _REMOVED) or len(packed) % 8:
            raise ValueError(f"bad event row op={op!r} bytes={len(packed)}")
        hashes = tuple(np.frombuffer(packed, dtype=">u8").tolist())
        cls = BlocksStored if op == _STORED else BlocksRemoved
        out.append(cls(hashes, Tier(tier), Kind(kind)))
    return tuple(out)


def encode_change(change: Change) -> dict[bytes, bytes]:
    if isinstance(change, BatchChange):
        return {
            b"t": b"B",
            b"r": change.key.replica.encode(),
            b"d": str(change.key.dp_rank).encode(),
            b"s": str(change.seq).encode(),
            b"e": encode_events(change.events),
        }
    if isinstance(change, ResetChange):
        return {
            b"t": b"R",
            b"r": change.key.replica.encode(),
            b"d": str(change.key.dp_rank).encode(),
            b"s": str(change.seq).encode(),
        }
    if isinstance(change, LoadChange):
        return {
            b"t": b"L",
            b"r": change.key.replica.encode(),
            b"d": str(change.key.dp_rank).encode(),
            b"l": change.sample.to_json().encode(),
        }
    if isinstance(change, ReplicaUp):
        return {
            b"t": b"U",
            b"r": change.info.replica.encode(),
            b"i": change.info.to_json().encode(),
        }
    return {b"t": b"D", b"r": change.replica.encode()}


def decode_change(fields: Mapping[bytes, bytes]) -> Change:
    """Inverse of ``encode_change``; raises ValueError on anything malformed."""
    try:
        kind = fields[b"t"]
        replica = fields[b"r"].decode()
        if kind == b"U":
            info = ReplicaInfo.from_json(fields[b"i"])
            if info.replica != replica:  # ``r`` is what a signature vouches for
                raise ValueError(f"registration of {info.replica!r} in an entry of {replica!r}")
            return ReplicaUp(info)
        if kind == b"D":
            return ReplicaDown(replica)
        key = ReplicaKey(replica, int(fields[b"d"]))
        if kind == b"B":
            return BatchChange(key, int(fields[b"s"]), decode_events(fields[b"e"]))
        if kind == b"R":
            return ResetChange(key, int(fields[b"s"]))
        if kind == b"L":
            return LoadChange(key, LoadSample.from_json(fields[b"l"]))
    except (KeyError, UnicodeDecodeError, TypeError) as exc:
        raise ValueError(f"bad change entry: {exc!r}") from None
    raise ValueError(f"unknown change type {kind!r}")


# ---------------------------------------------------------------------------- signatures
#
# The change streams are shared by the replicas of a shard, so Redis ACLs alone cannot stop
# one publisher appending entries in another replica's name. With signing on, every entry
# carries ``m`` = HMAC-SHA256 (truncated to 16 bytes) of its other fields under the
# replica's own key, derived from a master secret only routers hold:
# ``key(replica) = HMAC-SHA256(master, "kvrouter-replica-key\0" + replica)``. A publisher
# holds just its derived key, so it can sign only for itself.

SIGNATURE_FIELD = b"m"


MIN_MASTER_BYTES = 16


def master_secret(text: str) -> bytes:
    """The routers' master secret (server.redis_signing_master) from its hex text; ValueError
    when it is not hex or shorter than :data:`MIN_MASTER_BYTES`."""
    master = bytes.fromhex(text)
    if len(master) < MIN_MASTER_BYTES:
        raise ValueError(f"shorter than {MIN_MASTER_BYTES} bytes")
    return master


def replica_signing_key(master: bytes, replica: str) -> bytes:
    return hmac.new(master, b"kvrouter-replica-key\0" + replica.encode(), hashlib.sha256).digest()


def _mac(fields: Mapping[bytes, bytes], key: bytes) -> bytes:
    body = b"\0".join(k + b"\1" + v for k, v in sorted(fields.items()) if k != SIGNATURE_FIELD)
    return hmac.new(key, body, hashlib.sha256).digest()[:16]


def sign_fields(fields: dict[bytes, bytes], key: bytes) -> dict[bytes, bytes]:
    """Add the signature field to an encoded change (in place; returned for chaining)."""
    fields[SIGNATURE_FIELD] = _mac(fields, key)
    return fields


def verify_fields(fields: Mapping[bytes, bytes], master: bytes) -> bool:
    """True when the entry is signed with the key of the replica it names."""
    given = fields.get(SIGNATURE_FIELD)
    replica = fields.get(b"r")
    if not given or replica is None:
        return False
    try:
        key = replica_signing_key(master, replica.decode())
    except UnicodeDecodeError:
        return False
    return hmac.compare_digest(given, _mac(fields, key))
