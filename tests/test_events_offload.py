"""Offloaded tiers against the engines' own semantics, through the publisher's ingest into a
real index; the events are encoded by vLLM 0.33.0's own structs (0.34.0's kv_events module is
byte-identical) and SGLang 0.5.23's.

* vLLM's ``AllBlocksCleared`` comes only from the GPU ``BlockPool.reset_prefix_cache``; the
  KV offloading connector's CPU / STORAGE cache is another cache that it does not reach
  (``reset_prefix_cache(reset_connector=False)`` is the default). SGLang's comes from its
  radix tree's ``reset``, which drops the host (``CPU_PINNED``) copies with the tree.
* vLLM's offloading connector publishes, by default, *placeholder* stores: the hash of the
  last engine block of each offloaded chunk, no parent, no ``token_ids``, and a
  ``block_size`` of 0 (vLLM 0.25-0.34) or the chunk's token count (vLLM 0.18).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import EventBatch, IndexEvent, PrefixMatch, ReplicaKey
from router.events.ingest import EngineIngest
from tests.engines import load

VLLM = load("vllm-0.33.0")
SGLANG = load("sglang-0.5.23")
B = 32  # router block
BE = 16  # engine block
MODEL = "m"
KEY = ReplicaKey("r0")


class Pipeline:
    """One engine's payloads -> ``EngineIngest`` -> a ``PrefixIndex``, as the service does."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.ingest = EngineIngest(KEY.replica, MODEL, B, self._sink)

    def _sink(self, key: ReplicaKey, events: list[IndexEvent]) -> None:
        self.index.apply(EventBatch(key, tuple(events)))

    def vllm(self, *events: Any) -> None:
        self.ingest.handle_payload(msgspec.msgpack.encode(VLLM.KVEventBatch(1.0, list(events))))

    def sglang(self, *events: Any) -> None:
        batch = SGLANG.KVEventBatch(ts=1.0, events=list(events))
        self.ingest.handle_payload(msgspec.msgpack.encode(batch))

    def match(self, canonical: list[int]) -> PrefixMatch:
        return self.index.match(canonical).get(KEY)

    @property
    def stats(self) -> Any:
        return self.ingest.reblockers[0].stats


def _prompt(n_engine_blocks: int, seed: int = 1) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n_engine_blocks * BE)]
    hashes = [rng.getrandbits(63) for _ in range(n_engine_blocks)]
    return tokens, hashes, hash_prompt(tokens, B, root_hash(MODEL)).hashes


def _gpu_store(tokens: list[int], hashes: list[int]) -> Any:
    return VLLM.BlockStored(hashes, None, tokens, BE, None, "GPU", None, group_idx=0)


def _placeholder(h: int, block_size: int = 0, medium: str = "CPU", **kw: Any) -> Any:
    """What ``OffloadingEventsTracker._placeholder_stored`` (vLLM 0.25-0.34) publishes for
    one offloaded chunk; vLLM 0.18 sent the chunk's token count as ``block_size``."""
    return VLLM.BlockStored([h], None, [], block_size, None, medium, None, group_idx=0, **kw)


# ----------------------------------------------------------------- AllBlocksCleared, tiers


def test_vllm_gpu_reset_keeps_what_the_offloading_connector_holds() -> None:
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    # the connector offloads the first 4 engine blocks (self-describing payload: tokens)
    p.vllm(VLLM.BlockStored(hashes[:4], None, tokens[: 4 * BE], BE, None, "CPU", None, group_idx=0))
    assert p.match(canonical) == PrefixMatch(4, 4, 4, 4)
    p.vllm(VLLM.AllBlocksCleared())
    # GPU prefix cache gone, the CPU copies of blocks 0-1 (canonical) are still loadable
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    # a GPU store after the reset continues the chain from the CPU-held blocks
    p.vllm(VLLM.BlockStored(hashes[4:6], hashes[3], tokens[4 * BE : 6 * BE], BE, None, "GPU", None))
    assert p.match(canonical) == PrefixMatch(3, 0, 3, 3)
    p.vllm(VLLM.BlockRemoved(hashes[4:6], "GPU", group_idx=0))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    # and the later eviction of an offloaded block from CPU is still understood
    p.vllm(VLLM.BlockRemoved([hashes[3]], "CPU", group_idx=0))
    assert p.match(canonical) == PrefixMatch(1, 0, 1, 1)
    assert p.ingest.stats.malformed_events == 0


def test_vllm_gpu_reset_without_offloaded_blocks_clears_the_replica() -> None:
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    p.vllm(VLLM.AllBlocksCleared())
    assert p.match(canonical) == PrefixMatch()
    assert len(p.ingest.reblockers[0]) == 0


def test_a_second_reset_in_a_batch_is_the_offload_pools_and_keeps_the_gpu_stores() -> None:
    """vLLM 0.34's ``reset_prefix_cache(reset_connector=True)`` (``pause_generation(
    clear_cache=True)``, the RLHF weight-update path) with the simple CPU offload: the GPU
    pool's ``AllBlocksCleared`` goes into the KV cache manager's queue, the CPU pool's
    (``SimpleCPUOffloadScheduler.reset`` -> its ``BlockPool.reset_prefix_cache``, no medium)
    into the connector's, and ``Scheduler.update_from_output`` publishes the manager's events
    and then the connector's in one batch: the GPU stores of the step after the reset come
    between the two resets. The second clears the CPU tier, not those GPU stores."""
    tokens, hashes, canonical = _prompt(8)
    b_tokens, b_hashes, b_canonical = _prompt(8, seed=2)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    p.vllm(VLLM.BlockStored(hashes[:4], None, tokens[: 4 * BE], BE, None, "CPU", None, group_idx=0))
    assert p.match(canonical) == PrefixMatch(4, 4, 4, 4)
    p.vllm(
        VLLM.AllBlocksCleared(),
        VLLM.BlockStored(b_hashes[:4], None, b_tokens[: 4 * BE], BE, None, "GPU", None),
        VLLM.AllBlocksCleared(),
    )
    assert p.match(canonical) == PrefixMatch()  # both pools were emptied
    assert p.match(b_canonical) == PrefixMatch(2, 2, 2, 2)
    # the next step's store continuing that chain is read (its parent is still known)
    p.vllm(VLLM.BlockStored(b_hashes[4:], b_hashes[3], b_tokens[4 * BE :], BE, None, "GPU", None))
    assert p.match(b_canonical) == PrefixMatch(4, 4, 4, 4)
    assert p.stats.unknown_parent == 0
    # a single reset in a later batch is the GPU pool's again: the CPU tier survives it
    p.vllm(VLLM.BlockStored(b_hashes[:2], None, b_tokens[: 2 * BE], BE, None, "CPU", None))
    p.vllm(VLLM.AllBlocksCleared())
    assert p.match(b_canonical) == PrefixMatch(1, 0, 1, 1)
    assert p.ingest.stats.malformed_events == 0


def test_two_resets_in_a_row_empty_the_hisparse_host_pool_too() -> None:
    """vLLM 0.34's HiSparse host pool (``SharedEventQueueBlockPool``, medium ``CPU``) shares
    the GPU pool's event queue, and ``KVCacheCoordinator.reset_prefix_cache`` resets each
    pool: two ``AllBlocksCleared`` in a row, which leave nothing on any tier."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    p.vllm(VLLM.BlockStored(hashes, None, tokens, BE, None, "CPU", None, group_idx=0))
    p.vllm(VLLM.AllBlocksCleared(), VLLM.AllBlocksCleared())
    assert p.match(canonical) == PrefixMatch()
    assert p.index.replica_size(KEY) == (0, 0)


def test_sglang_reset_drops_its_host_tier_with_the_tree() -> None:
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.sglang(SGLANG.BlockStored(hashes, None, tokens, BE, None, medium="GPU"))
    p.sglang(SGLANG.BlockStored(hashes, None, tokens, BE, None, medium="CPU_PINNED"))
    assert p.match(canonical) == PrefixMatch(2, 2, 2, 2)
    p.sglang(SGLANG.AllBlocksCleared())
    assert p.match(canonical) == PrefixMatch()
    assert len(p.ingest.reblockers[0]) == 0


# ----------------------------------------------------------- placeholder (token-less) stores


def test_vllm_034_placeholders_map_to_the_gpu_blocks_router_blocks() -> None:
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    p.vllm(*(_placeholder(h) for h in hashes))  # blocks_per_chunk=1 (the default)
    assert p.ingest.stats.malformed_events == 0
    assert p.stats.unmapped_offload == 0
    p.vllm(VLLM.BlockRemoved(hashes, "GPU", group_idx=0))  # GPU evicts them all
    assert p.match(canonical) == PrefixMatch(4, 0, 4, 4)
    p.vllm(VLLM.BlockRemoved([hashes[7]], "CPU", group_idx=0))  # the connector evicts one
    assert p.match(canonical) == PrefixMatch(3, 0, 3, 3)


def test_placeholders_for_blocks_never_seen_with_tokens_are_counted() -> None:
    p = Pipeline()
    p.vllm(_placeholder(12345), _placeholder(678, medium="STORAGE"))
    assert p.ingest.stats.malformed_events == 0
    assert p.stats.unmapped_offload == 2
    assert p.index.replica_size(KEY) == (0, 0)


@pytest.mark.parametrize("chunk_blocks", [2, 4])
def test_older_placeholders_cover_their_whole_chunk(chunk_blocks: int) -> None:
    """vLLM 0.18: one hash per chunk (its last engine block), ``block_size`` = the chunk's
    tokens (``offloaded_block_size``)."""
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    chunk = chunk_blocks * BE
    keys = hashes[chunk_blocks - 1 :: chunk_blocks]
    p.vllm(VLLM.BlockStored(keys, None, [], chunk, None, "CPU", None))
    assert p.ingest.stats.malformed_events == 0
    p.vllm(VLLM.BlockRemoved(hashes, "GPU"))
    assert p.match(canonical) == PrefixMatch(4, 0, 4, 4)
    # evicting the last chunk from CPU removes every router block it overlaps
    p.vllm(VLLM.BlockRemoved([keys[-1]], "CPU"))
    left = len(canonical) - chunk_blocks * BE // B
    assert p.match(canonical) == PrefixMatch(left, 0, left, left)


def test_token_less_state_checkpoint_aligns_with_the_attention_block() -> None:
    """vLLM 0.34 self-describing payload of an offloaded mamba chunk: its last hash, its
    parent, no tokens; the consumer aligns it with the attention group's block."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    state = VLLM.BlockStored(
        [hashes[3]], hashes[2], [], BE, None, "CPU", None, group_idx=1, kv_cache_spec_kind="mamba"
    )
    p.vllm(state)
    assert p.ingest.stats.malformed_events == 0
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 2
    # one off the router's block grid (engine block 2 ends mid router block) is not a checkpoint
    state = VLLM.BlockStored(
        [hashes[2]], hashes[1], [], BE, None, "CPU", None, group_idx=1, kv_cache_spec_kind="mamba"
    )
    p.vllm(state)
    assert p.ingest.stats.malformed_events == 0 and p.stats.unaligned_state == 1


def test_a_state_checkpoint_held_on_another_tier_survives_one_tiers_eviction() -> None:
    """The index keeps one state set per replica, whatever the tier: a checkpoint the
    offloading connector copied to CPU (vLLM 0.34's self-describing mamba payload) stays
    loadable when the GPU evicts its copy, and the other way round."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    gpu_state = VLLM.BlockStored(
        [hashes[3]], hashes[2], tokens[3 * BE :], BE, None, "GPU", None,
        group_idx=1, kv_cache_spec_kind="mamba",
    )  # fmt: skip
    p.vllm(gpu_state)
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 2
    # the connector offloads the KV and the checkpoint
    p.vllm(VLLM.BlockStored(hashes, None, tokens, BE, None, "CPU", None, group_idx=0))
    cpu_state = VLLM.BlockStored(
        [hashes[3]], hashes[2], [], BE, None, "CPU", None,
        group_idx=1, kv_cache_spec_kind="mamba",
    )  # fmt: skip
    p.vllm(cpu_state)
    # the GPU evicts both groups' blocks: the CPU copies are what the engine loads
    p.vllm(VLLM.BlockRemoved(hashes, "GPU", group_idx=0))
    p.vllm(VLLM.BlockRemoved([hashes[3]], "GPU", group_idx=1))
    assert p.index.match(canonical, hybrid=True).get(KEY) == PrefixMatch(2, 0, 2, 2)
    # stored on GPU again, then evicted from CPU: the GPU copy is still there
    p.vllm(_gpu_store(tokens, hashes), gpu_state)
    p.vllm(VLLM.BlockRemoved([hashes[3]], "CPU", group_idx=1))
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 2
    # gone from both tiers: no checkpoint
    p.vllm(VLLM.BlockRemoved([hashes[3]], "GPU", group_idx=1))
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 0
    assert p.ingest.stats.malformed_events == 0


def test_a_state_checkpoint_placed_at_the_end_of_a_batch_survives_another_tiers_eviction() -> None:
    """vLLM 0.34's mamba "align" mode store can come before its attention blocks' in one
    batch (it is placed by hash at the batch's end). With copies counted (lookahead hashes),
    the checkpoint it placed on GPU stays when the CPU copy the connector made is evicted."""
    tokens, hashes, canonical = _prompt(4)
    look = [[1]] * 4  # lookahead hashes: copies at one position are counted
    p = Pipeline()
    sparse = VLLM.BlockStored(
        [hashes[3]], None, tokens, BE, None, "GPU", None, group_idx=1, kv_cache_spec_kind="mamba"
    )
    gpu_kv = VLLM.BlockStored(
        hashes, None, tokens, BE, None, "GPU", None, group_idx=0, lookahead_token_ids=look
    )
    p.vllm(sparse, gpu_kv)
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 2
    # the connector offloads the checkpoint, then evicts it from CPU: the GPU still holds it
    p.vllm(
        VLLM.BlockStored(
            [hashes[3]], hashes[2], [], BE, None, "CPU", None,
            group_idx=1, kv_cache_spec_kind="mamba",
        )
    )  # fmt: skip
    p.vllm(VLLM.BlockRemoved([hashes[3]], "CPU", group_idx=1))
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 2
    p.vllm(VLLM.BlockRemoved([hashes[3]], "GPU", group_idx=1))
    assert p.index.match(canonical, hybrid=True).get(KEY).usable_blocks == 0
    assert p.ingest.stats.malformed_events == 0


def test_a_state_store_waiting_for_its_attention_blocks_is_cleared_by_a_reset_after_it() -> None:
    """A mamba "align" mode store placed at the batch's end (its attention blocks came
    later in the batch) that an ``AllBlocksCleared`` later in the same batch reset: the
    engine no longer holds that checkpoint, though the attention blocks it is placed by
    stay offloaded on CPU."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    sparse = VLLM.BlockStored(
        [hashes[3]], None, tokens, BE, None, "GPU", None, group_idx=1, kv_cache_spec_kind="mamba"
    )
    cpu_kv = VLLM.BlockStored(hashes, None, tokens, BE, None, "CPU", None, group_idx=0)
    p.vllm(sparse, _gpu_store(tokens, hashes), cpu_kv, VLLM.AllBlocksCleared())
    assert p.index.match(canonical, hybrid=True).get(KEY) == PrefixMatch(2, 0, 2, 0)
    assert p.ingest.stats.malformed_events == 0


# ------------------------------------------------------- residencies sharing one medium


def test_a_block_two_residencies_of_one_medium_hold_stays_until_both_remove_it() -> None:
    """vLLM 0.34's tiered offloading: the primary tier publishes ``CPU`` (no ``ownership``),
    the KVCR secondary tier its local DRAM as ``CPU`` too with ``ownership="kvcr"``
    (``KVCRTier._record_inventory``); ``OffloadingEventsTracker`` keeps each chunk's payload
    until every (medium, ownership) residency has removed it. The router's CPU tier holds a
    block while either residency does."""
    tokens, hashes, canonical = _prompt(8)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    primary = VLLM.BlockStored(hashes[:4], None, tokens[: 4 * BE], BE, None, "CPU", None)
    kvcr = VLLM.BlockStored(
        hashes[:4], None, tokens[: 4 * BE], BE, None, "CPU", None, ownership="kvcr"
    )
    p.vllm(primary, kvcr)
    p.vllm(VLLM.BlockRemoved(hashes, "GPU", group_idx=0))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    # the primary tier evicts its copies: KVCR's DRAM still holds them (it promotes on lookup)
    p.vllm(VLLM.BlockRemoved(hashes[2:4], "CPU", group_idx=0))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    # a residency that never held a block removing it changes nothing
    p.vllm(VLLM.BlockRemoved(hashes[2:4], "CPU", group_idx=0, ownership="other"))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    p.vllm(VLLM.BlockRemoved(hashes[3:4], "CPU", group_idx=0, ownership="kvcr"))
    assert p.match(canonical) == PrefixMatch(1, 0, 1, 1)
    # the primary tier stores one again, KVCR drops its copy: the primary's is left
    p.vllm(VLLM.BlockStored(hashes[2:4], hashes[1], tokens[2 * BE : 4 * BE], BE, None, "CPU", None))
    p.vllm(VLLM.BlockRemoved(hashes[2:4], "CPU", group_idx=0, ownership="kvcr"))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    p.vllm(VLLM.BlockRemoved(hashes[:4], "CPU", group_idx=0))  # KVCR still holds 0 and 1
    assert p.match(canonical) == PrefixMatch(1, 0, 1, 1)
    p.vllm(VLLM.BlockRemoved(hashes[:2], "CPU", group_idx=0, ownership="kvcr"))
    assert p.match(canonical) == PrefixMatch()
    assert p.ingest.stats.malformed_events == 0


def test_a_residency_first_seen_on_a_tier_alone_is_removed_alone() -> None:
    """KVCR's inventory may report a block before the primary tier ever held it: that
    residency alone holds it, and its removal takes it off the tier."""
    tokens, hashes, canonical = _prompt(4)
    p = Pipeline()
    p.vllm(_gpu_store(tokens, hashes))
    p.vllm(VLLM.BlockStored(hashes, None, tokens, BE, None, "CPU", None))  # primary: default
    p.vllm(VLLM.BlockRemoved(hashes, "CPU", group_idx=0))
    p.vllm(VLLM.BlockStored(hashes, None, tokens, BE, None, "CPU", None, ownership="kvcr"))
    p.vllm(VLLM.BlockRemoved(hashes, "GPU", group_idx=0))
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    p.vllm(VLLM.BlockRemoved(hashes, "CPU", group_idx=0))  # the primary holds none of them
    assert p.match(canonical) == PrefixMatch(2, 0, 2, 2)
    p.vllm(VLLM.BlockRemoved(hashes, "CPU", group_idx=0, ownership="kvcr"))
    assert p.match(canonical) == PrefixMatch()
