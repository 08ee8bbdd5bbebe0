"""Encode KV events the way vLLM does (for the mock replica and tests): msgpack, either as
positional arrays with the tag first (``"array"``: byte-identical to vLLM's msgspec
``array_like=True`` structs, every field present) or as maps with a ``type`` key and
default-valued fields left out (``"map"``, like msgspec's ``omit_defaults``)."""

from __future__ import annotations

from typing import Any, Literal

import msgpack

from router.events.model import (
    BATCH_FIELDS,
    REMOVED_FIELDS,
    STORED_FIELDS,
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)

Encoding = Literal["array", "map"]
_DEFAULTS: dict[str, Any] = {
    "lora_id": None,
    "medium": None,
    "lora_name": None,
    "extra_keys": None,
    "group_idx": None,
    "kv_cache_spec_kind": None,
    "kv_cache_spec_sliding_window": None,
    "data_parallel_rank": None,
}


def _values(obj: Any, names: tuple[str, ...]) -> list[Any]:
    vals = [getattr(obj, n) for n in names]
    return [list(v) if isinstance(v, tuple) else v for v in vals]


def _event(ev: EngineEvent, encoding: Encoding) -> Any:
    names: tuple[str, ...]
    if isinstance(ev, EngineBlockStored):
        tag, names = "BlockStored", STORED_FIELDS
    elif isinstance(ev, EngineBlockRemoved):
        tag, names = "BlockRemoved", REMOVED_FIELDS
    else:
        tag, names = "AllBlocksCleared", ()
    vals = _values(ev, names)
    if encoding == "array":
        return [tag, *vals]
    out: dict[str, Any] = {"type": tag}
    out.update(
        (n, v) for n, v in zip(names, vals, strict=True) if not (n in _DEFAULTS and v is None)
    )
    if isinstance(ev, EngineBlockStored) and ev.cache_salt is not None:
        out["cache_salt"] = ev.cache_salt  # SGLang's field (maps only)
    return out


def encode_batch(batch: EngineBatch, encoding: Encoding = "array") -> bytes:
    events = [_event(e, encoding) for e in batch.events]
    if encoding == "array":
        body: Any = [batch.ts, events]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
    else:
        body = dict(zip(BATCH_FIELDS, (batch.ts, events, batch.data_parallel_rank), strict=True))
        if batch.data_parallel_rank is None:
            del body["data_parallel_rank"]
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


__all__ = ["Encoding", "EngineAllCleared", "encode_batch"]
