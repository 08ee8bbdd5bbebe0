"""Engine KV events as vLLM (and SGLang) publish them, as plain values.

Field names and order follow vLLM's ``vllm.distributed.kv_events``: ``BlockStored(
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)``,
``BlockRemoved(block_hashes, medium, group_idx)``, ``AllBlocksCleared()`` inside
``KVEventBatch(ts, events, data_parallel_rank)``. Engine block hashes are normalised to
Python ints (bytes are read big-endian).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")

# kv_cache_spec_kind values: full attention (prefix KV), recurrent state, or ignored.
KV_KINDS = frozenset({"", "full", "full_attention", "attention", "mla", "mla_attention"})
STATE_KINDS = frozenset({"mamba", "mamba2", "linear_attention", "kda", "gdn", "state"})


@dataclass(slots=True, frozen=True)
class EngineBlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(slots=True, frozen=True)
class EngineBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True, frozen=True)
class EngineAllCleared:
    pass


EngineEvent = EngineBlockStored | EngineBlockRemoved | EngineAllCleared


@dataclass(slots=True, frozen=True)
class EngineBatch:
    ts: float
    events: tuple[EngineEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(slots=True, frozen=True)
class DecodeResult:
    """A decoded payload: ``batch`` is None when the payload as a whole was unusable;
    ``errors`` lists every problem found (events with problems are left out)."""

    batch: EngineBatch | None
    errors: tuple[str, ...] = ()
