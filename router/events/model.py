"""Engine KV events as vLLM (and SGLang) publish them, as plain values.

Field names and order follow vLLM's ``vllm.distributed.kv_events``: ``BlockStored(
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window)``,
``BlockRemoved(block_hashes, medium, group_idx)``, ``AllBlocksCleared()`` inside
``KVEventBatch(ts, events, data_parallel_rank)``; SGLang's ``cache_salt`` (a map field only,
SGLang >= 0.5.20) is kept too, as is vLLM 0.34's ``ownership`` (a map field: the secondary
offloading tier, e.g. ``"kvcr"``, of a store or removal), and vLLM's ``lookahead_token_ids``
(0.33 on, a map field: the tokens after each block that its engine hash also covers,
present only while the engine hashes with lookahead, which EAGLE / MTP engines with prefix
caching do instead of giving back a block of every hit; SGLang's EAGLE engines say the same
by publishing each position's ``(token, next token)`` pair as its ``token_ids``, read as
tokens and lookahead).
Engine block hashes are normalised to Python ints (bytes are read big-endian).

``kv_cache_spec_kind`` (vLLM >= 0.22, ``vllm.v1.kv_cache_interface.KVCacheSpecKind``): groups
whose blocks hold the KV of the whole prefix are KV (``full_attention``, ``mla_attention``,
``sink_full_attention``: full attention plus a fixed set of sink tokens); ``mamba`` groups hold
recurrent-state checkpoints. Sliding-window groups (``sliding_window``, ``sliding_window_mla``)
keep a recent window: a prefix is usable where the window before its end is cached, which the
re-blocker publishes as checkpoints (router/events/window.py). Groups that keep a chunk
(``chunked_local_attention``) or no decoder prefix at all (``encoder_only_attention``,
``cross_attention``) are ignored, as are kinds this list does not know (logged once by the
re-blocker).
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

# The media of vLLM's KV offloading connector (``MEDIUM_CPU`` / ``MEDIUM_STORAGE``): a cache of
# its own, which ``AllBlocksCleared`` (vLLM: ``BlockPool.reset_prefix_cache``, the GPU prefix
# cache only) does not clear. SGLang's host tier (``CPU_PINNED``) is a copy held by its radix
# tree and is cleared with it, as is everything else.
OFFLOAD_MEDIA = frozenset({"CPU", "STORAGE"})

# kv_cache_spec_kind values: full attention (prefix KV), recurrent state, or ignored.
# vLLM's own names, then the short names our mock engine and older tools use.
KV_KINDS = frozenset(
    {"", "full_attention", "mla_attention", "sink_full_attention"} | {"full", "attention", "mla"}
)
STATE_KINDS = frozenset({"mamba"} | {"mamba2", "linear_attention", "kda", "gdn", "state"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"} | {"swa"})
IGNORED_KINDS = frozenset(
    {"chunked_local_attention", "encoder_only_attention", "cross_attention", "unknown"}
)


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
    cache_salt: str | None = None  # SGLang: the salt of the request that stored them
    # vLLM: the tokens after each block its hash covers, one tuple a block (None: no lookahead)
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    # vLLM 0.34: the secondary offloading tier that holds them (None: the medium's primary)
    ownership: str | None = None

    @property
    def lookahead_tokens(self) -> int:
        """How many tokens after each block the engine's hash covers (0: none)."""
        ids = self.lookahead_token_ids
        return max(map(len, ids)) if ids else 0


@dataclass(slots=True, frozen=True)
class EngineBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    ownership: str | None = None  # as ``EngineBlockStored.ownership``


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
    ``errors`` lists every problem found (events with problems are left out).
    ``unknown_until``: the events of ``batch`` before this position came before one left
    out that was not a store (a removal, a clear, or an event of unknown type): what it did
    to the cache is unknown (None: none such)."""

    batch: EngineBatch | None
    errors: tuple[str, ...] = ()
    unknown_until: int | None = None
