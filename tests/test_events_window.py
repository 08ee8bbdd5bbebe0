"""Sliding-window groups: the usable prefix the index predicts against vLLM's own rule.

vLLM 0.34's ``SlidingWindowManager.find_longest_cache_hit`` (an unmodified copy of the wheel's
module, tests/engines) decides how much of a prompt a full + sliding-window model serves
from its cache; the router sees only the engine's events (vLLM's own event classes, msgpack,
our decoder, the re-blocker, the index). Random caches with holes in the window group (the
blocks a request frees early are evicted first) must give the same usable prefix.
"""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import EventBatch, ReplicaKey
from router.events.decode import decode_payload
from router.events.reblock import Reblocker
from router.events.window import WindowChange, WindowGroup, blocks_needed
from tests.engines import _module, load, load_file

MODEL = "swa-model"
BE = 16  # engine block
KEY = ReplicaKey("r0")


def _vllm_window_manager() -> Any:
    """vLLM 0.34's ``SlidingWindowManager`` and its spec class, loaded with stand-ins for the
    engine parts it imports (its hit search only asks the block pool for cached blocks)."""
    for name in ("vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_metrics"):
        _module(name)
    _module("vllm.v1.hisparse.block_pool")
    _module("vllm.distributed.kv_events", MEDIUM_CPU="CPU")
    _module("vllm.utils.gc_utils", untracked_list=list, gc_untrack=lambda x: x)

    def resolve(hashes: Any, hash_block_size: int, block_size: int, **_: Any) -> Any:
        assert hash_block_size == block_size
        return hashes

    _module("vllm.v1.core.kv_cache_utils", resolve_block_hashes=resolve)
    return load_file("vllm_0_34_0_single_type_kv_cache_manager.py")


class _Pool:
    """The block pool as the hit search sees it: which hashes the group holds."""

    null_block = None
    hash_block_size = BE

    def __init__(self, cached: set[int]) -> None:
        self.cached = cached

    def get_cached_block(self, block_hash: int, group_ids: list[int]) -> Any:
        return [object()] * len(group_ids) if block_hash in self.cached else None


def vllm_hit(window: int, hashes: list[int], full: set[int], swa: set[int], align: int) -> int:
    """Tokens of the prefix vLLM serves: the full-attention prefix, then the window group's
    hit within it (``HybridKVCacheCoordinator``; with prefix-closed full KV one pass)."""
    mod = _vllm_window_manager()
    full_hit = next((i for i, h in enumerate(hashes) if h not in full), len(hashes))
    spec = mod.SlidingWindowSpec()
    spec.sliding_window, spec.block_size = window, BE
    _, hit = mod.SlidingWindowManager.find_longest_cache_hit(
        hashes, full_hit * BE, [1], _Pool(swa), spec, False, align
    )
    return int(hit)


def _encode(mod: Any, events: list[Any]) -> bytes:
    return msgspec.msgpack.encode(mod.KVEventBatch(ts=1.0, events=events))


class Engine:
    """A full + sliding-window engine's events for a set of sequences (vLLM's shapes: the
    window group's store lists its kept blocks only, over the whole token range)."""

    def __init__(self, window: int, router_block: int) -> None:
        self.mod = load("vllm-0.33.0")  # byte-identical to 0.34.0's kv_events.py
        self.window = window
        self.rb = Reblocker(router_block, MODEL)
        self.index = PrefixIndex()
        self.index.add_replica(KEY)
        self.full: set[int] = set()
        self.swa: set[int] = set()

    def publish(self, events: list[Any]) -> None:
        result = decode_payload(_encode(self.mod, events))
        assert result.batch is not None
        self.index.apply(EventBatch(KEY, tuple(self.rb.convert(result.batch.events))))

    def store(self, tokens: list[int], hashes: list[int], keep_swa: list[bool]) -> None:
        n = len(hashes)
        common: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None}
        full = self.mod.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens[: n * BE],
            block_size=BE, group_idx=0, kv_cache_spec_kind="full_attention", **common,
        )  # fmt: skip
        kept = [h for h, k in zip(hashes, keep_swa, strict=True) if k]
        swa = self.mod.BlockStored(
            block_hashes=kept, parent_block_hash=None, token_ids=tokens[: n * BE],
            block_size=BE, group_idx=1, kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=self.window, **common,
        )  # fmt: skip
        self.publish([full, swa])
        self.full.update(hashes)
        self.swa.update(kept)

    def evict_swa(self, hashes: list[int]) -> None:
        gone = [h for h in hashes if h in self.swa]
        self.publish([self.mod.BlockRemoved(block_hashes=gone, medium="GPU", group_idx=1)])
        self.swa.difference_update(gone)

    def usable_tokens(self, tokens: list[int], router_block: int) -> int:
        hashes = hash_prompt(tokens, router_block, root_hash(MODEL)).hashes
        found = self.index.match(hashes, hybrid=True).get(KEY)
        return found.usable_blocks * router_block


def _engine_hashes(tokens: list[int]) -> list[int]:
    return [hash(tuple(tokens[: (i + 1) * BE])) & (2**63 - 1) for i in range(len(tokens) // BE)]


@pytest.mark.parametrize(("window", "router_block"), [(128, 16), (128, 64), (500, 64), (33, 16)])
def test_usable_prefix_matches_vllms_sliding_window_rule(window: int, router_block: int) -> None:
    rng = random.Random(window * 1000 + router_block)
    base = [rng.randrange(1, 50_000) for _ in range(40 * BE)]
    checked = shorter = 0
    for _trial in range(60):
        eng = Engine(window, router_block)
        # a few sequences sharing prefixes of the base (branches at random blocks)
        seqs = []
        for _ in range(3):
            cut = rng.randrange(1, 40) * BE
            seqs.append(
                base[:cut] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 12) * BE)]
            )
        for seq in seqs:
            hashes = _engine_hashes(seq)
            mode = rng.random()
            if mode < 0.3:  # dense: every window block cached
                keep = [True] * len(hashes)
            else:  # holes: some window blocks never cached, or evicted later
                keep = [rng.random() < 0.7 for _ in hashes]
            eng.store(seq, hashes, keep)
        for seq in seqs:  # evictions of window blocks (freed first by the engine)
            hashes = _engine_hashes(seq)
            eng.evict_swa([h for h in hashes if rng.random() < 0.15])
        for seq in [*seqs, base]:
            hashes = _engine_hashes(seq)
            expected = vllm_hit(window, hashes, eng.full, eng.swa, router_block)
            got = eng.usable_tokens(seq, router_block)
            assert got == expected, (window, router_block, len(seq), got, expected)
            full_hit = next((i for i, h in enumerate(hashes) if h not in eng.full), len(hashes))
            shorter += expected < full_hit * BE // router_block * router_block
            checked += 1
    # the rule mattered: many prefixes are shorter than their full-attention KV
    assert shorter > checked // 5


def test_window_group_runs_placeholders_and_removals() -> None:
    need = blocks_needed(window=64, block_size=16)  # cdiv(63, 16) = 4
    assert need == 4 and blocks_needed(1, 16) == 1 and blocks_needed(17, 16) == 1
    w = WindowGroup(need)

    def block(d: int) -> tuple[int, int | None, int, int]:
        """Block ``d`` of one chain; the canonical checkpoint there is named 100 + d."""
        return (d, d - 1 if d > 1 else None, d, 100 + d)

    change = WindowChange()
    # stored out of order: 5..8 first (their parent 4 unknown: a placeholder)
    w.stored([block(d) for d in (5, 6, 7, 8)], change)
    assert change.stored == [(108, 8)]  # only 8 has 4 stored blocks ending at it
    change = WindowChange()
    w.stored([block(d) for d in (1, 2, 3, 4)], change)
    # short prefixes from the start count (1..3), then every depth >= 4
    assert sorted(change.stored) == [(100 + d, d) for d in (1, 2, 3, 4, 5, 6, 7)]
    change = WindowChange()
    assert w.removed([2], change) == 1
    # depths 2..5 lose it (5's window is 2..5), 6 onwards keep 4 stored blocks
    assert sorted(change.removed) == [102, 103, 104, 105]
    assert w.removed([2], WindowChange()) == 0  # not stored any more
    change = WindowChange()
    w.stored([block(2)], change)
    assert sorted(change.stored) == [(102 + i, 2 + i) for i in range(4)]
    # ancestors first in one batch, as an engine evicts what the window slid past
    change = WindowChange()
    assert w.removed([1, 2, 3], change) == 3
    assert sorted(change.removed) == [101, 102, 103, 104, 105, 106]
    change = WindowChange()
    w.stored([block(d) for d in (3, 1, 2)], change)  # in any order within a batch
    assert sorted(change.stored) == [(100 + d, d) for d in range(1, 7)]
    # removing everything forgets every node, placeholders included, in either order
    w.removed(list(range(8, 0, -1)), WindowChange())
    assert len(w) == 0
    w.stored([block(d) for d in range(1, 9)], WindowChange())
    w.removed([4, 3, 8, 1, 2, 7, 6, 5], WindowChange())
    assert len(w) == 0


def test_window_cost_is_linear_in_the_chain() -> None:
    """Evicting a long chain's early blocks in one event visits each node about once, not
    ``need`` times (a 4,096-token window over 16-token blocks needs 256)."""
    w = WindowGroup(256)
    n = 2000
    w.stored([(d, d - 1 if d > 1 else None, d, d) for d in range(1, n + 1)], WindowChange())
    assert w.visits == n
    change = WindowChange()
    w.removed(list(range(1, n - 300)), change)
    # the removed ones and the 255 after them whose window reached back into them
    assert len(change.removed) == n - 301 + 255
    assert w.visits == n + (n - 301) + 256  # each removed node, then the ones below it once


def _continuations(n: int) -> float:
    """CPU seconds to store, then remove, ``n`` one-block continuations of one cached
    4-block prefix (a shared system prompt's last block and the sessions after it)."""
    w = WindowGroup(4)
    w.stored([(d, d - 1 if d > 1 else None, d, 100 + d) for d in range(1, 5)], WindowChange())
    t0 = time.process_time()
    for i in range(n):
        w.stored([(1000 + i, 4, 5, None)], WindowChange())
    for i in range(n):
        w.removed([1000 + i], WindowChange())
    took = time.process_time() - t0
    assert len(w) == 4
    return took


@pytest.mark.benchmark
def test_a_block_with_many_continuations_costs_each_one_the_same() -> None:
    """Prints what storing and removing 1,500 and 15,000 continuations of one block cost (a
    block many cached prompts continue: the last block of a system prompt every session
    shares). Linear is about 10 times; when each one rewrote the whole sibling list
    (marshal bytes) it was ~90 times (~10 s of event loop, 2 ms an event at the end).
    ``pytest -m benchmark tests/test_events_window.py -s``."""
    small = min(_continuations(1_500) for _ in range(3))
    large = _continuations(15_000)
    print(
        f"1,500 continuations: {small * 1e3:.1f} ms, 15,000: {large * 1e3:.1f} ms "
        f"({large / small:.1f}x)"
    )


def test_siblings_keep_their_order_through_removals() -> None:
    """Children of one block, some removed (first, middle, last) and stored again: the
    checkpoints of the ones stored are published, in the order they were named."""
    w = WindowGroup(2)
    w.stored([(1, None, 1, 101), (2, 1, 2, 102)], WindowChange())
    change = WindowChange()
    w.stored([(10 + i, 2, 3, 200 + i) for i in range(6)], change)
    assert change.stored == [(200 + i, 3) for i in range(6)]
    w.removed([10, 13, 15], WindowChange())
    change = WindowChange()
    w.removed([2], change)
    assert change.removed == [102, 201, 202, 204]
    change = WindowChange()
    w.stored([(15, 2, 3, 205), (2, 1, 2, 102), (10, 2, 3, 200)], change)
    assert sorted(change.stored) == [(102, 2)] + [(200 + i, 3) for i in (0, 1, 2, 4, 5)]
    w.removed([1, 2, *range(10, 16)], WindowChange())
    assert len(w) == 0


def test_window_store_before_its_attention_block_waits_for_the_batch() -> None:
    """A window group's store can come before the full-attention store of the same blocks
    in one batch: placed at the end of the batch; with no attention block at all, counted."""
    rb = Reblocker(BE, MODEL)
    tokens = list(range(1, 3 * BE + 1))
    hashes = _engine_hashes(tokens)
    from router.events.model import EngineBlockStored

    swa = EngineBlockStored(
        tuple(hashes), None, tuple(tokens), BE, group_idx=1,
        kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=40,
    )  # fmt: skip
    full = EngineBlockStored(tuple(hashes), None, tuple(tokens), BE, group_idx=0)
    events = rb.convert([swa, full])
    state = [e for e in events if getattr(e, "kind", None) is not None and e.kind.name == "STATE"]
    assert len(state) == 1 and len(state[0].hashes) == 3
    assert Reblocker(BE, MODEL).convert([swa]) == []
    lone = Reblocker(BE, MODEL)
    lone.convert([swa])
    assert lone.stats.unmapped_offload == 3
    # no window size (a group of layers with different windows): not indexed
    odd = Reblocker(BE, MODEL)
    odd.convert(
        [
            full,
            EngineBlockStored(
                tuple(hashes),
                None,
                tuple(tokens),
                BE,
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
            ),
        ]
    )
    assert odd.stats.unknown_window == 3


@pytest.mark.parametrize("window", [128, 33, 16, 1000])
def test_the_simulators_engine_grants_what_vllm_grants(window: int) -> None:
    """The engine model behind the simulator and the mock replica (sim/block_cache.py) finds
    a sliding-window hit as vLLM 0.34's own search does, on random window caches."""
    from router.core.types import ReplicaKey as Key
    from sim.block_cache import WINDOW_TAG
    from sim.engine import EngineModel
    from sim.profiles import load_profile

    profile = load_profile("gpt-oss-120b").with_overrides(sliding_window_tokens=window)
    engine = EngineModel(profile, Key("r"), BE)
    rng = random.Random(window)
    for _ in range(300):
        n = rng.randrange(1, 120)
        hashes = [rng.getrandbits(62) for _ in range(n)]
        present = {h for h in hashes if rng.random() < rng.choice((0.5, 0.8, 0.95))}
        engine._win = {h | WINDOW_TAG: 1 for h in present}
        full = set(hashes)
        assert engine._window_hit(hashes, n) * BE == vllm_hit(window, hashes, full, present, BE)
