"""The engine's cache bookkeeping (refcounts, the stamped run LRU, checkpoints, host tier) and
the prefix index's bulk event ingestion, checked against their contracts on random runs.

Both were rewritten from per-block loops to per-run / C-level bulk operations for speed; these
tests pin down that the results are those of the per-block definitions."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.index import PrefixIndex
from router.core.load import CostModel
from router.core.types import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    Kind,
    ReplicaKey,
    Tier,
)
from sim.engine import (
    STATE_TAG,
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    Rejected,
    TokensEmitted,
)
from sim.profiles import EngineProfile

B = 10
COST = CostModel(
    step_overhead_s=0.01,
    prefill_s_per_token=1e-4,
    prefill_s_per_token_ctx=0.0,
    decode_s_per_seq=0.001,
    decode_s_per_ctx_token=0.0,
    chunk_tokens=60,
)


def engine(**kw: object) -> EngineModel:
    profile = EngineProfile("t", cost=COST, block_size=B, **kw)  # type: ignore[arg-type]
    return EngineModel(profile, ReplicaKey("r"), B, emit_tokens=False)


def drain(e: EngineModel) -> list[object]:
    outs: list[object] = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
    return outs


# ---------------------------------------------------------------------------- host tier


def test_host_reload_survives_eviction_into_a_full_host_tier() -> None:
    """Reloading host blocks while evicting GPU blocks into a full host tier: the reloaded
    blocks are taken first, so the offload cannot push them out (this used to KeyError)."""
    e = engine(kv_blocks=2, cpu_blocks=2, cpu_load_s_per_token=1e-3)
    e.submit(EngineRequest("a", [1, 2], 20, 1), 0.0)
    drain(e)
    e.submit(EngineRequest("b", [3, 4], 20, 1), 1.0)  # evicts 2, 1 into the host tier
    drain(e)
    assert e.has_block(1, Tier.CPU) and e.has_block(2, Tier.CPU)
    e.take_index_events()
    e.submit(EngineRequest("c", [1, 2], 20, 1), 2.0)  # reload 1, 2; evict 4, 3 to host
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.kv_hit_tokens == 20 and first.cached_tokens == 10
    ev = e.take_index_events()
    moved = [x for x in ev if isinstance(x, BlocksRemoved) and x.tier is Tier.CPU]
    assert moved[0].hashes == (1, 2)
    assert e.has_block(1) and e.has_block(2)
    assert e.has_block(3, Tier.CPU) and e.has_block(4, Tier.CPU)


# ---------------------------------------------------------------------------- invariants


def _audit(e: EngineModel, events: list[object], gpu_seen: set[int], states: set[int]) -> None:
    """Cross-check the engine's cache against its own contracts and its event stream (with
    the events of the step in progress, published at its end)."""

    def apply(evs: list[object], kv: set[int], st: set[int]) -> None:
        for ev in evs:
            if isinstance(ev, BlocksStored) and ev.tier is Tier.GPU:
                (st if ev.kind is Kind.STATE else kv).update(ev.hashes)
            elif isinstance(ev, BlocksRemoved) and ev.tier is Tier.GPU:
                (st if ev.kind is Kind.STATE else kv).difference_update(ev.hashes)

    apply(events, gpu_seen, states)
    kv_now, states_now = set(gpu_seen), set(states)
    apply(list(e._seg.events) if e._seg is not None else [], kv_now, states_now)
    gpu = e._gpu
    assert set(gpu) == kv_now  # the index events describe the cache exactly
    assert {k ^ STATE_TAG for k in e._state_at} == states_now
    # refcounts are the number of pins by running requests; unpinned blocks are in the LRU
    pins: Counter[int] = Counter()
    for seq in [*e._prefilling, *e._decoding]:
        pins.update(k for k in seq.pinned if k < STATE_TAG)
    for h, value in gpu.items():
        assert value == pins[h] if value > 0 else (value < 0 and pins[h] == 0)
    live: list[int] = []
    size = 0
    for stamp, keys, off, _mixed in e._lru:
        size += len(keys) - off
        for k in keys[off:]:
            if (e._state_at.get(k) if k >= STATE_TAG else gpu.get(k)) == ~stamp:
                live.append(k)
    assert size == e._lru_len
    assert len(live) == len(set(live))  # each entry live once
    unpinned = {h for h, v in gpu.items() if v < 0}
    assert set(live) == unpinned | set(e._state_at)
    cost = len(unpinned) + len(e._state_at) * e._state_cost
    assert e._free_cost == pytest.approx(cost)
    assert e._states == len(e._state_at)


def _chains(rng: random.Random, n: int) -> list[list[int]]:
    """Paths of a random tree of blocks (chained hashes share prefixes)."""
    parent = [-1] + [
        rng.choice([-1, *range(i)]) if rng.random() < 0.85 else -1 for i in range(1, n)
    ]
    paths: list[list[int]] = []
    for i in range(n):
        paths.append((paths[parent[i]] if parent[i] >= 0 else []) + [1000 + i])
    return paths


@pytest.mark.parametrize(
    "profile",
    [
        {"kv_blocks": 24},
        {"kv_blocks": 400},
        {"kv_blocks": 16, "cpu_blocks": 12},
        {
            "kv_blocks": 30,
            "hybrid": True,
            "checkpoint": "every_n",
            "checkpoint_interval_tokens": 20,
            "state_checkpoint_blocks": 0.5,
        },
        {
            "kv_blocks": 30,
            "hybrid": True,
            "checkpoint": "every_block",
            "state_checkpoint_blocks": 1.0,
            "cpu_blocks": 20,
        },
        {"kv_blocks": 16, "max_out": 80},
        {
            "kv_blocks": 30,
            "hybrid": True,
            "checkpoint": "every_block",
            "state_checkpoint_blocks": 1.0,
            "max_out": 80,
        },
    ],
    ids=["lru", "no-eviction", "host-tier", "hybrid", "hybrid-host", "preempt", "hybrid-preempt"],
)
@pytest.mark.parametrize("seed", range(12))
def test_cache_bookkeeping_invariants_on_random_runs(profile: dict[str, object], seed: int) -> None:
    rng = random.Random(seed)
    profile = dict(profile)
    max_out = int(profile.pop("max_out", 15))  # type: ignore[call-overload]
    e = engine(**profile)
    paths = [p for p in _chains(rng, 40) if len(p) <= 8]
    gpu_seen: set[int] = set()
    states: set[int] = set()
    now = 0.0
    live: list[str] = []
    for i in range(120):
        now += rng.expovariate(20.0)
        r = rng.random()
        if r < 0.7:
            blocks = list(rng.choice(paths))
            if rng.random() < 0.1:  # a repeated hash: only the blocks before it are cached
                blocks = blocks + blocks[:1] + [rng.randrange(1 << 20)]
            tokens = len(blocks) * B - rng.choice([0, 0, 3])
            rid = f"q{i}"
            outs: list[int] = []
            if tokens % B == 0 and rng.random() < 0.3:  # names of the answer's full blocks
                outs = [blocks[-1] * 7 + j for j in range(2)]
            e.submit(EngineRequest(rid, blocks, tokens, rng.randint(1, max_out), outs), now)
            live.append(rid)
        elif r < 0.8 and live:
            e.cancel(live.pop(rng.randrange(len(live))), now)
        else:
            e.advance(now)
        _audit(e, e.take_index_events(), gpu_seen, states)
    drain(e)
    _audit(e, e.take_index_events(), gpu_seen, states)
    assert e.pending() == 0 and e.kv_usage() == pytest.approx(0.0)
    assert e._reserved == 0
    if max_out > 15:  # decoders outgrew the cache: preempted sequences resumed and finished
        assert e.preemptions > 0


def test_lru_order_is_release_order_with_repinned_blocks_skipped() -> None:
    e = engine(kv_blocks=12)
    for rid, blocks, t in (("a", [1, 2, 3], 0.0), ("b", [4, 5, 6], 1.0), ("c", [1, 2], 2.0)):
        e.submit(EngineRequest(rid, blocks, len(blocks) * B, 1), t)
        drain(e)
    e.take_index_events()
    # LRU, oldest first: 3 (a's tail; 2, 1 were re-pinned by c), 6, 5, 4, then c's 2, 1.
    e.submit(EngineRequest("d", list(range(7, 19)), 120, 1), 3.0)  # needs all 12 blocks
    drain(e)
    ev = e.take_index_events()
    gone = [h for x in ev if isinstance(x, BlocksRemoved) for h in x.hashes]
    assert gone == [3, 6, 5, 4, 2, 1]


# ---------------------------------------------------------------------------- index ingest


def _ref_store(table: dict[int, int], slot: int, blocks: list[int]) -> int:
    """The per-block definition: add ``slot`` to each block's holder set."""
    added = 0
    for b in blocks:
        v = table.get(b)
        mask = 0 if v is None else (v if v >= 0 else 1 << ~v)
        if not mask & (1 << slot):
            mask |= 1 << slot
            table[b] = ~slot if mask == 1 << slot else mask
            added += 1
    return added


def _ref_remove(table: dict[int, int], slot: int, blocks: list[int]) -> int:
    removed = 0
    for b in blocks:
        v = table.get(b)
        if v is None:
            continue
        mask = v if v >= 0 else 1 << ~v
        if mask & (1 << slot):
            mask ^= 1 << slot
            if not mask:
                del table[b]
            else:
                table[b] = ~(mask.bit_length() - 1) if mask & (mask - 1) == 0 else mask
            removed += 1
    return removed


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),
            st.integers(0, 5),
            st.lists(st.integers(0, 30), max_size=12),
            st.sampled_from([Kind.KV, Kind.STATE]),
        ),
        max_size=40,
    )
)
def test_bulk_ingest_matches_the_per_block_definition(
    ops: list[tuple[bool, int, list[int], Kind]],
) -> None:
    idx = PrefixIndex()
    keys = [ReplicaKey(f"r{i}") for i in range(6)]
    for k in keys:
        idx.add_replica(k)
    ref: dict[Kind, dict[int, int]] = {Kind.KV: {}, Kind.STATE: {}}
    counts = {k: [0, 0] for k in keys}
    for store, who, blocks, kind in ops:
        key = keys[who]
        slot = who  # slots are given out in registration order
        table = ref[kind]
        col = 0 if kind is Kind.KV else 1
        if store:
            counts[key][col] += _ref_store(table, slot, blocks)
            ev: BlocksStored | BlocksRemoved = BlocksStored(tuple(blocks), kind=kind)
        else:
            counts[key][col] -= _ref_remove(table, slot, blocks)
            ev = BlocksRemoved(tuple(blocks), kind=kind)
        # alternate the batch form and the iterator form of the API
        if len(blocks) % 2:
            idx.apply(EventBatch(key, (ev,)))
        elif store:
            idx.store(key, iter(blocks), kind=kind)
        else:
            idx.remove(key, iter(blocks), kind=kind)
        assert idx._kv[Tier.GPU] == ref[Kind.KV] and idx._state == ref[Kind.STATE]
        assert list(idx._kv[Tier.GPU]) == list(ref[Kind.KV])  # same insertion order
        for k in keys:
            assert idx.replica_size(k) == tuple(counts[k])
    idx.apply(EventBatch(keys[0], (AllCleared(),)))
    assert idx.replica_size(keys[0]) == (0, 0)


# ---------------------------------------------------------------------------- preemption


def _used(e: EngineModel) -> float:
    return len(e._gpu) + e._states * e._state_cost + e._windows * e._window_cost + e._reserved


@pytest.mark.parametrize(
    "profile",
    [
        {"kv_blocks": 16},
        {"kv_blocks": 24, "cpu_blocks": 10},
        {
            "kv_blocks": 30,
            "hybrid": True,
            "checkpoint": "every_n",
            "checkpoint_interval_tokens": 30,
            "state_checkpoint_blocks": 0.5,
        },
        {
            "kv_blocks": 30,
            "hybrid": True,
            "checkpoint": "step_end",
            "eagle": True,
            "state_checkpoint_blocks": 1.0,
        },
        {"kv_blocks": 14, "sliding_window_tokens": 25, "window_block_cost": 1.0},
        {"kv_blocks": 12, "max_running": 3},
    ],
    ids=["lru", "host-tier", "hybrid", "eagle", "window", "max-running"],
)
@pytest.mark.parametrize("seed", range(8))
def test_preempting_engine_streams_every_token_within_its_memory(
    profile: dict[str, object], seed: int
) -> None:
    """Random arrivals (some P/D decode legs), cancels and reads at any time (splitting
    decode runs, as the mock's driver does) on an engine that preempts: memory in use never
    exceeds the cache, the allocated-unnamed count is the running sequences', a preempted
    (waiting) one holds nothing, and every request that finishes streamed exactly its
    max_tokens with one first token."""
    rng = random.Random(seed)
    profile = EngineProfile("t", cost=COST, block_size=B, **profile)  # type: ignore[arg-type]
    # odd seeds: vLLM's priority scheduling, each request a random priority
    scheduling = "priority" if seed % 2 else "fcfs"
    e = EngineModel(profile, ReplicaKey("r"), B, emit_tokens=True, scheduling=scheduling)
    paths = [p for p in _chains(rng, 40) if len(p) <= 8]
    tokens: Counter[str] = Counter()
    firsts: Counter[str] = Counter()
    finished: dict[str, object] = {}
    wanted: dict[str, int] = {}
    live: list[str] = []
    now = 0.0

    def take(outs: list[object]) -> None:
        for o in outs:
            if isinstance(o, FirstToken):
                firsts[o.request_id] += 1
                tokens[o.request_id] += 1
            elif isinstance(o, TokensEmitted):
                tokens[o.request_id] += o.count
            elif isinstance(o, (Finished, Rejected)):
                assert o.request_id not in finished
                finished[o.request_id] = o

    def check() -> None:
        assert _used(e) <= e.capacity + 1e-9
        running = [*e._prefilling, *e._decoding]
        assert e._reserved == sum(s.unnamed for s in running)
        assert all(s.unnamed >= 0 for s in running)
        assert all(s.unnamed == 0 and not s.pinned and not s.window for s in e._waiting)
        for s in e._decoding:  # a block for every token whose KV was written
            assert s.blocks == -(-(s.prompt + s.out - 1) // B)

    for i in range(150):
        now += rng.expovariate(30.0)
        r = rng.random()
        if r < 0.6:
            blocks = list(rng.choice(paths))
            n = len(blocks) * B - rng.choice([0, 0, 3])
            outs = [blocks[-1] * 7 + j for j in range(8)] if n % B == 0 else []
            rid = f"q{i}"
            wanted[rid] = rng.randint(1, 60)
            remote = rng.random() < 0.15
            prio = rng.randint(-1, 1) if scheduling == "priority" else 0
            e.submit(EngineRequest(rid, blocks, n, wanted[rid], outs, remote, priority=prio), now)
            live.append(rid)
        elif r < 0.7 and live:
            rid = live.pop(rng.randrange(len(live)))
            e.cancel(rid, now)
            for seen in (wanted, finished, tokens, firsts):
                seen.pop(rid, None)
        else:
            take(e.advance(now))
        check()
    while (t := e.next_time()) is not None:
        if rng.random() < 0.5:  # a read inside the step or run in progress
            now += (t - now) * rng.random()
            take(e.advance(now))
            check()
        now = t
        take(e.advance(t))
        check()
    assert e.pending() == 0 and e._reserved == 0 and e.kv_usage() == pytest.approx(0.0)
    assert e.preemptions > 0
    for rid, n in wanted.items():
        end = finished[rid]
        if isinstance(end, Finished):
            assert (end.output_tokens, tokens[rid], firsts[rid]) == (n, n, 1)
