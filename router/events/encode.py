"""Encode KV events the way the engines do (for the mock replica and tests), msgpack in one
of three layouts:

* ``"vllm"`` (the default): current vLLM (0.24 on), the msgpack values its msgspec structs
  write (msgspec may use wider map headers; the values are the same): the
  batch a positional array (``[ts, events, rank]``, the rank nil when unset), each event a map
  led by its ``type`` tag, the fields without defaults (``lora_id``, ``medium``,
  ``lora_name``, ...) always present, defaulted ones left out while at their default
  (``omit_defaults``). What vllm-router's ``kv_aware`` and current vLLM tools decode.
* ``"array"``: vLLM before 0.24: events as positional arrays with the tag first, every field
  present.
* ``"map"``: batch and events as maps, default-valued fields left out (SGLang's maps).
"""

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

Encoding = Literal["vllm", "array", "map"]
ENCODINGS: tuple[Encoding, ...] = ("vllm", "array", "map")
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


_VLLM_DEFAULTS = frozenset(_DEFAULTS) - {"lora_id", "medium", "lora_name"}


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
    # vLLM's structs give only these fields defaults; SGLang's maps default the rest too
    defaults = _VLLM_DEFAULTS if encoding == "vllm" else _DEFAULTS
    out: dict[str, Any] = {"type": tag}
    out.update(
        (n, v) for n, v in zip(names, vals, strict=True) if not (n in defaults and v is None)
    )
    if isinstance(ev, EngineBlockStored) and ev.cache_salt is not None:
        out["cache_salt"] = ev.cache_salt  # SGLang's field (maps only)
    if isinstance(ev, (EngineBlockStored, EngineBlockRemoved)) and ev.ownership is not None:
        out["ownership"] = ev.ownership  # vLLM 0.34's (maps only)
    if isinstance(ev, EngineBlockStored) and ev.lookahead_token_ids is not None:
        out["lookahead_token_ids"] = [list(ids) for ids in ev.lookahead_token_ids]  # vLLM 0.33+
    return out


def encode_batch(batch: EngineBatch, encoding: Encoding = "vllm") -> bytes:
    events = [_event(e, encoding) for e in batch.events]
    if encoding == "vllm":  # msgspec writes the rank's slot even when it is None
        body: Any = [batch.ts, events, batch.data_parallel_rank]
    elif encoding == "array":
        body = [batch.ts, events]
        if batch.data_parallel_rank is not None:
            body.append(batch.data_parallel_rank)
    else:
        body = dict(zip(BATCH_FIELDS, (batch.ts, events, batch.data_parallel_rank), strict=True))
        if batch.data_parallel_rank is None:
            del body["data_parallel_rank"]
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


__all__ = ["ENCODINGS", "Encoding", "EngineAllCleared", "encode_batch"]
