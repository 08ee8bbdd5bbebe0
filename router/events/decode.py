"""Total decoder of vLLM/SGLang KV-event payloads: every input yields a ``DecodeResult``;
nothing raises. Accepts both encodings at both levels (positional arrays with trailing
defaults omitted, or maps with a ``type`` key), hashes as ints or bytes, and ignores unknown
extra fields (newer engines append fields)."""

from __future__ import annotations

import array
import itertools
from typing import Any

import msgpack

from router.events.model import (
    BATCH_FIELDS,
    REMOVED_FIELDS,
    STORED_FIELDS,
    DecodeResult,
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)

MAX_PAYLOAD = 64 * 2**20


class _Bad(Exception):
    pass


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise _Bad("block hash is a bool")
    if isinstance(value, int):
        return value
    if isinstance(value, (bytes, bytearray)) and 0 < len(value) <= 64:
        return int.from_bytes(value, "big")
    raise _Bad(f"block hash of type {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _Bad("block_hashes is not a list")
    if len(value) == 1 and type(value[0]) is int:
        return (value[0],)
    if set(map(type, value)) <= _INT:  # all plain ints (checked in C): nothing to convert
        return tuple(value)
    return tuple(_hash(v) for v in value)


_INT = frozenset({int})


def _opt_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise _Bad(f"{name} is not an int")


def _opt_str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise _Bad(f"{name} is not UTF-8") from None
    if isinstance(value, str):
        return value
    raise _Bad(f"{name} is not a string")


def _fields(raw: Any, names: tuple[str, ...], what: str) -> tuple[str, dict[str, Any]]:
    """(tag, field map) from either encoding."""
    if isinstance(raw, (list, tuple)):
        if not raw:
            raise _Bad(f"empty {what}")
        tag = _opt_str(raw[0], "tag") or ""
        return tag, dict(zip(names, raw[1:], strict=False))
    if isinstance(raw, dict):
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        tag = _opt_str(fields.pop("type", None), "type") or ""
        return tag, fields
    raise _Bad(f"{what} is a {type(raw).__name__}")


def _lookahead(value: Any) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``lookahead_token_ids``: a list of token-id lists (one a block). Only their
    presence and length are read, so the ids are taken as they are (a count other than the
    blocks' too); the first list's are checked, which tells a garbled field."""
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(ids, (list, tuple)) for ids in value
    ):
        raise _Bad("lookahead_token_ids is not a list of lists")
    if value:
        try:
            array.array("I", value[0])
        except (OverflowError, TypeError):
            raise _Bad("lookahead_token_ids is not lists of uint32") from None
    return tuple(map(tuple, value))


def _bigrams(pairs: list[Any] | tuple[Any, ...], block_size: Any) -> tuple[list[int], Any]:
    """SGLang's store of an EAGLE engine (``RadixKey.is_bigram``, sglang/srt/mem_cache/
    events.py ``record_store``): ``token_ids`` holds ``(t_j, t_j+1)`` for every position
    ``j`` of the blocks, since its radix tree keys each position's KV by that pair. As
    (tokens, lookahead): each position's own token, and for every block the token after
    it, which its key also covers (vLLM's ``lookahead_token_ids`` of one token). Pairs
    that do not chain are not a bigram key."""
    if not pairs or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise _Bad("token_ids is not a list of uint32 (nor SGLang's bigram pairs)")
    tokens = [p[0] for p in pairs]
    try:
        array.array("I", tokens)
        array.array("I", [pairs[-1][1]])
    except (OverflowError, TypeError):
        raise _Bad("token_ids is not a list of uint32 (nor SGLang's bigram pairs)") from None
    if any(a[1] != b[0] for a, b in itertools.pairwise(pairs)):
        raise _Bad("token_ids: SGLang's bigram pairs do not chain")
    size = block_size if isinstance(block_size, int) and block_size > 0 else len(pairs)
    ends = range(size - 1, len(pairs), size)
    return tokens, [[pairs[i][1]] for i in ends]


# a BlockStored's optional fields but extra_keys, in its field order, with their types
_OPTIONAL = (
    "lora_id",
    "medium",
    "lora_name",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "cache_salt",
)
_OPTIONAL_TYPE = (int, str, str, int, str, int, str)
_OPTIONAL_CHECK = (_opt_int, _opt_str, _opt_str, _opt_int, _opt_str, _opt_int, _opt_str)
# the keys of an event map in vLLM's and SGLang's layouts
_MAP_KEYS = frozenset({"type", *STORED_FIELDS, "cache_salt", "lookahead_token_ids", "ownership"})


def _event(raw: Any) -> EngineEvent:
    f: dict[Any, Any]
    if isinstance(raw, dict) and (_MAP_KEYS.issuperset(raw) or bytes not in set(map(type, raw))):
        # the common map (keys already str): read it in place, its extra "type" key unread
        tag = _opt_str(raw.get("type"), "type") or ""
        f = raw
    else:  # (a tag that is no string: _fields refuses it)
        names = REMOVED_FIELDS if _tag(raw) == "BlockRemoved" else STORED_FIELDS
        tag, f = _fields(raw, names, "event")
    if tag == "BlockStored":
        token_ids = f.get("token_ids")
        if not isinstance(token_ids, (list, tuple)):
            raise _Bad("token_ids is not a list")
        lookahead = f.get("lookahead_token_ids")
        try:  # range- and type-checks every id in C (a msgpack true/false passes as 1/0)
            array.array("I", token_ids)
        except (OverflowError, TypeError):
            token_ids, lookahead = _bigrams(token_ids, f.get("block_size"))
        block_size = f.get("block_size")
        # vLLM's offloading connector stores blocks by hash alone: no tokens, block_size 0
        if (
            not isinstance(block_size, int)
            or isinstance(block_size, bool)
            or block_size < (1 if token_ids else 0)
        ):
            raise _Bad("block_size is not a positive int")
        hashes = _hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        if parent is not None:
            parent = _hash(parent)
        # the optional fields, checked in this order (the first problem is the one reported);
        # a plain str or int, or None, passes as is
        opt: list[Any] = [f.get(name) for name in _OPTIONAL]
        for i, value in enumerate(opt):
            if value is not None and type(value) is not _OPTIONAL_TYPE[i]:
                opt[i] = _OPTIONAL_CHECK[i](value, _OPTIONAL[i])
        return EngineBlockStored(
            hashes, parent, tuple(token_ids), block_size, opt[0], opt[1], opt[2],
            f.get("extra_keys"), opt[3], opt[4], opt[5], opt[6],
            None if lookahead is None else _lookahead(lookahead),
            _opt_str(f.get("ownership"), "ownership"),
        )  # fmt: skip
    if tag == "BlockRemoved":
        return EngineBlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_opt_str(f.get("medium"), "medium"),
            group_idx=_opt_int(f.get("group_idx"), "group_idx"),
            ownership=_opt_str(f.get("ownership"), "ownership"),
        )
    if tag == "AllBlocksCleared":
        return EngineAllCleared()
    raise _Bad(f"unknown event type {tag!r:.40}")


def decode_payload(payload: bytes) -> DecodeResult:
    """Decode one ``KVEventBatch`` payload. Never raises."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        return DecodeResult(None, ("payload is not bytes",))
    if len(payload) > MAX_PAYLOAD:
        return DecodeResult(None, (f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}",))
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types (ExtraData, ValueError, ...)
        return DecodeResult(None, (f"not msgpack: {type(exc).__name__}",))
    try:
        if isinstance(raw, (list, tuple)):
            f = dict(zip(BATCH_FIELDS, raw, strict=False))
        elif isinstance(raw, dict):
            f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
        else:
            raise _Bad(f"batch is a {type(raw).__name__}")
        ts = f.get("ts", 0.0)
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            raise _Bad("ts is not a number")
        events_raw = f.get("events")
        if not isinstance(events_raw, (list, tuple)):
            raise _Bad("events is not a list")
        rank = _opt_int(f.get("data_parallel_rank"), "data_parallel_rank")
        if rank is not None and not 0 <= rank < 65536:
            raise _Bad("data_parallel_rank out of range")
    except _Bad as exc:
        return DecodeResult(None, (str(exc),))
    except Exception as exc:  # belt and braces: the decoder is total
        return DecodeResult(None, (f"bad batch: {type(exc).__name__}",))
    events: list[EngineEvent] = []
    errors: list[str] = []
    unknown_until: int | None = None
    for i, ev in enumerate(events_raw):
        try:
            events.append(_event(ev))
            continue
        except _Bad as exc:
            errors.append(f"event {i}: {exc}")
        except Exception as exc:
            errors.append(f"event {i}: {type(exc).__name__}")
        if _tag(ev) != "BlockStored":  # a store left out is only missing; not so the rest
            unknown_until = len(events)
    batch = EngineBatch(float(ts), tuple(events), rank)
    return DecodeResult(batch, tuple(errors), unknown_until)


def _tag(raw: Any) -> str | None:
    """The type an event names (array layout: its first item; map: its ``type``), if any."""
    try:
        if isinstance(raw, (list, tuple)) and raw:
            tag = raw[0]
        elif isinstance(raw, dict):
            tag = raw.get("type", raw.get(b"type"))
        else:
            return None
        return _opt_str(tag, "tag")
    except (_Bad, TypeError):
        return None
