"""The engine model on exact hand-computed cases: batching, chunked prefill, LRU eviction
children before parents, the hybrid state checkpoint grid, the host tier, streaming."""

from __future__ import annotations

from dataclasses import replace

import pytest

from router.core.load import CostModel
from router.core.types import BlocksRemoved, BlocksStored, Kind, ReplicaKey, Tier
from sim.engine import (
    EngineModel,
    EngineRequest,
    Finished,
    FirstToken,
    Rejected,
    TokensEmitted,
)
from sim.profiles import EngineProfile, load_profile, profile_names

B = 10  # tokens per block in these cases
COST = CostModel(
    step_overhead_s=0.01,
    prefill_s_per_token=1e-4,
    prefill_s_per_token_ctx=0.0,
    decode_s_per_seq=0.001,
    decode_s_per_ctx_token=0.0,
    chunk_tokens=100,
)


def engine(**kw: object) -> EngineModel:
    emit = bool(kw.pop("emit_tokens", True))
    profile = EngineProfile("t", cost=COST, block_size=B, **kw)  # type: ignore[arg-type]
    return EngineModel(profile, ReplicaKey("r"), B, emit_tokens=emit)


def req(rid: str, blocks: list[int], tokens: int | None = None, out: int = 1) -> EngineRequest:
    return EngineRequest(rid, blocks, tokens if tokens is not None else len(blocks) * B, out)


def drain(e: EngineModel) -> list[object]:
    outs: list[object] = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
    return outs


def stored(events: list[object], kind: Kind = Kind.KV, tier: Tier = Tier.GPU) -> list[int]:
    return [
        h
        for ev in events
        if isinstance(ev, BlocksStored) and ev.kind is kind and ev.tier is tier
        for h in ev.hashes
    ]


def removed(events: list[object], kind: Kind = Kind.KV, tier: Tier = Tier.GPU) -> list[int]:
    return [
        h
        for ev in events
        if isinstance(ev, BlocksRemoved) and ev.kind is kind and ev.tier is tier
        for h in ev.hashes
    ]


def test_chunked_prefill_and_decode_times() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("a", list(range(1, 26)), 250, out=5), 0.0)
    outs = drain(e)
    # 3 prefill steps: 100, 100, 50 tokens -> 0.02 + 0.02 + 0.015; first token at 0.055
    first = next(o for o in outs if isinstance(o, FirstToken))
    assert first.time == pytest.approx(0.055) and first.cached_tokens == 0
    # then 4 decode steps of 0.011 s fast-forwarded as one run
    toks = [o for o in outs if isinstance(o, TokensEmitted)]
    assert len(toks) == 1 and toks[0].count == 4
    assert toks[0].time == pytest.approx(0.066) and toks[0].interval == pytest.approx(0.011)
    fin = next(o for o in outs if isinstance(o, Finished))
    assert fin.time == pytest.approx(0.099) and fin.output_tokens == 5
    assert stored(e.take_index_events()) == list(range(1, 26))


def test_continuous_batching_shares_steps_and_cuts_decode_runs() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("a", [1, 2], 20, out=100), 0.0)
    outs = e.advance(0.012)  # prefill step: 0.01 + 20 * 1e-4 = 0.012 -> first token
    assert [type(o) for o in outs] == [FirstToken]
    # a decode run of 99 steps is now in progress (0.011 s each)...
    assert e.next_time() == pytest.approx(0.012 + 99 * 0.011)
    e.advance(0.012)
    # ...until b arrives mid-step: the run is cut at the end of the step in progress.
    e.submit(req("b", [7, 8, 9], 30, out=2), 0.03)
    assert e.next_time() == pytest.approx(0.012 + 2 * 0.011)
    outs = e.advance(0.034)
    assert [type(o) for o in outs] == [TokensEmitted]
    # next step batches b's 30-token prefill with a's decode: 0.01 + 0.003 + 0.001
    t = e.next_time()
    assert t == pytest.approx(0.034 + 0.014)
    outs = e.advance(t)
    assert any(isinstance(o, FirstToken) and o.request_id == "b" for o in outs)
    rep = e.report(t)
    assert rep.running == 2 and rep.waiting == 0


# vLLM 0.34 (vllm/v1/core/sched/scheduler.py ``schedule``): the running requests take the
# step's token budget first (line 809); a waiting request is scheduled only while budget is
# left (``loads_only``, line 1095) and looks its prefix up then (line 1148,
# ``_get_local_prefix_cache_hit``). ``KVCacheManager.allocate_slots``
# (vllm/v1/core/kv_cache_manager.py lines 642-646) caches a request's full blocks up to the
# tokens scheduled *this* step as it allocates them, so a request scheduled after it in the
# same step, or in any later step, finds them.


def test_waiting_request_admitted_with_budget_left_hits_blocks_of_that_step() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("a", list(range(1, 26)), 250, out=2), 0.0)
    # b shares a's 25 blocks and arrives while a's first chunk is computed
    e.submit(req("b", list(range(1, 31)), 300, out=2), 0.001)
    e.advance(0.03)  # step 2: a's second chunk takes the whole budget, b still waits
    rep = e.report(0.03)
    assert rep.running == 1 and rep.waiting == 1
    # step 3: a's last 50 tokens, then b with the 50 left: it hits all 25 of a's blocks,
    # the 5 being computed in this very step too, and finishes its prompt there
    outs = e.advance(0.06)
    firsts = {o.request_id: o for o in outs if isinstance(o, FirstToken)}
    assert set(firsts) == {"a", "b"}
    assert firsts["b"].time == pytest.approx(0.06) and firsts["b"].cached_tokens == 250


def test_two_waiting_requests_share_a_prefix_first_computes_in_same_step() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("c", [100], 10), 0.0)  # busy: one step of 0.011
    e.submit(req("a", [1, 2, 3, 4, 5], 50), 0.001)
    e.submit(req("b", [1, 2, 3, 4, 5, 6], 60), 0.002)
    # next step: a's 50 tokens; b is scheduled after a in the same step and hits the 5
    # blocks a is computing (vLLM does not compute them twice): 0.01 + 60 * 1e-4
    outs = drain(e)
    firsts = {o.request_id: o for o in outs if isinstance(o, FirstToken)}
    assert firsts["b"].cached_tokens == 50
    assert firsts["a"].time == pytest.approx(0.027) and firsts["b"].time == pytest.approx(0.027)


def test_a_steps_index_events_come_at_its_end() -> None:
    # vLLM publishes the events of a step's scheduling after the step (update_from_output)
    e = engine(kv_blocks=100)
    e.submit(req("a", list(range(1, 26)), 250), 0.0)
    assert e.take_index_events() == []
    e.advance(0.019)
    assert e.take_index_events() == []
    e.advance(0.02)
    assert stored(e.take_index_events()) == list(range(1, 11))


def test_streaming_advance_returns_finished_part_of_a_run() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("a", [1], 10, out=11), 0.0)
    e.advance(0.011)  # prefill 0.01 + 0.001
    outs = e.advance(0.011 + 3 * 0.011 + 0.001)
    assert len(outs) == 1 and isinstance(outs[0], TokensEmitted) and outs[0].count == 3
    outs = drain(e)
    assert sum(o.count for o in outs if isinstance(o, TokensEmitted)) == 7
    assert isinstance(outs[-1], Finished) and outs[-1].output_tokens == 11


def test_prefix_hit_and_last_token_recomputed() -> None:
    e = engine(kv_blocks=100)
    e.submit(req("a", [1, 2, 3, 4], 40), 0.0)
    drain(e)
    e.submit(req("b", [1, 2, 3, 4], 40), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    # vLLM recomputes the last token's whole block: a hit of at most (40 - 1) // 10 blocks
    assert first.cached_tokens == 30 and first.kv_hit_tokens == 40
    e.submit(req("c", [1, 2, 9], 35), 2.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.cached_tokens == 20


def test_lru_evicts_children_before_parents_and_never_pinned() -> None:
    e = engine(kv_blocks=7)
    e.submit(req("a", [1, 2, 3]), 0.0)
    drain(e)
    e.submit(req("b", [4, 5, 6]), 1.0)
    drain(e)
    e.take_index_events()
    # 6 named blocks cached; c's prompt needs 3 of 7 -> evict 2, from a (released before
    # b), tail first
    e.submit(req("c", [7, 8, 9]), 2.0)
    drain(e)
    ev = e.take_index_events()
    assert removed(ev) == [3, 2]
    assert e.has_block(1) and e.has_block(4) and not e.has_block(2)
    # a request holding blocks pins them: d pins its hit (4, 5, 6), e's prompt needs 5 of the
    # 4 evictable -> e waits for d instead of evicting d's blocks
    e.submit(req("d", [4, 5, 6], out=40), 3.0)
    e.submit(req("e", [11, 12, 13, 14, 15]), 3.0)
    e.advance(3.0)
    assert e.report(3.0).waiting == 1 and removed(e.take_index_events()) == []
    outs = drain(e)
    order = [o.request_id for o in outs if isinstance(o, Finished)]
    assert order == ["d", "e"]
    assert e.preemptions == 0 and e.kv_usage() == 0.0


def test_admission_takes_the_prompt_and_decoding_grows_block_by_block() -> None:
    """vLLM admits a request when its prompt fits (not prompt + max_tokens) and gives a
    decoding sequence a block when its context crosses a block boundary."""
    e = engine(kv_blocks=8)
    e.submit(req("a", [1, 2, 3], out=50), 0.0)  # 3 blocks now, 8 by its last token
    e.submit(req("b", [4, 5, 6, 7]), 0.0)  # 4 blocks: fits beside a's prompt
    outs = drain(e)
    first_b = next(o for o in outs if isinstance(o, FirstToken) and o.request_id == "b")
    fin = next(o for o in outs if isinstance(o, Finished) and o.request_id == "a")
    assert first_b.time < 0.05 < fin.time  # admitted at the step after a's, not after a
    # a grows to 8 blocks: b's 4 released blocks are evicted tail first, one by one
    assert removed(e.take_index_events()) == [7, 6, 5, 4]
    assert fin.output_tokens == 50 and e.preemptions == 0


def test_preemption_takes_the_latest_admitted_and_resumes_it_by_recompute() -> None:
    """Two decoders outgrow the cache: the later admitted one is preempted (its computed
    prompt blocks stay cached), waits for room, and resumes by recomputing
    its prompt and answer so far, without a second first token."""
    e = engine(kv_blocks=8)
    e.submit(req("a", [1, 2], out=40), 0.0)  # 6 blocks by its last token
    e.submit(req("b", [3, 4], out=40), 0.0)
    outs = drain(e)
    assert e.preemptions == 1
    assert [o.request_id for o in outs if isinstance(o, Finished)] == ["a", "b"]
    b_out = [o for o in outs if getattr(o, "request_id", "") == "b"]
    assert sum(isinstance(o, FirstToken) for o in b_out) == 1
    # b (admitted a step after a) goes with 20 tokens when the 8 blocks are full; once a is
    # done it recomputes its 20 + 20 tokens, its prompt's 2 blocks a cache hit, and
    # samples its 21st token at the end of that prefill
    resumed = [o for o in b_out if isinstance(o, TokensEmitted) and o.count == 1]
    assert len(resumed) == 1
    emitted = sum(o.count for o in b_out if isinstance(o, TokensEmitted))
    fin = next(o for o in b_out if isinstance(o, Finished))
    assert 1 + emitted == fin.output_tokens == 40
    assert fin.cached_tokens == 0  # what the first admission found
    assert 3 not in removed(e.take_index_events())  # b's prompt blocks were never evicted
    assert e.pending() == 0 and e.kv_usage() == 0.0


def test_request_larger_than_cache_is_rejected() -> None:
    e = engine(kv_blocks=4)
    e.submit(req("big", list(range(1, 10))), 0.0)
    outs = e.advance(0.0)
    assert isinstance(outs[0], Rejected) and "capacity 4" in outs[0].reason
    assert e.next_time() is None and e.pending() == 0


@pytest.mark.parametrize(
    ("mode", "interval", "expected"),
    [
        (
            "every_block",
            10,
            [
                1,
                2,
                3,
                4,
                5,
                6,
                7,
                8,
                9,
                10,
                11,
                12,
                13,
                14,
                15,
                16,
                17,
                18,
                19,
                20,
                21,
                22,
                23,
                24,
                25,
            ],
        ),
        ("step_end", 10, [10, 20, 25]),
        ("every_n", 40, [4, 8, 12, 16, 20, 24, 25]),
    ],
)
def test_hybrid_checkpoint_grid(mode: str, interval: int, expected: list[int]) -> None:
    e = engine(
        kv_blocks=200,
        hybrid=True,
        checkpoint=mode,
        checkpoint_interval_tokens=interval,
        state_checkpoint_blocks=1.0,
    )
    hashes = list(range(1, 26))
    e.submit(req("a", hashes, 255), 0.0)  # 25 full blocks + 5 tokens; chunks of 100 tokens
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == expected


def test_hybrid_usable_hit_stops_at_last_checkpoint() -> None:
    e = engine(
        kv_blocks=200,
        hybrid=True,
        checkpoint="every_n",
        checkpoint_interval_tokens=50,
        state_checkpoint_blocks=2.0,
    )
    e.submit(req("a", list(range(1, 26)), 255), 0.0)
    drain(e)
    # shares 23 blocks: the KV hit is 230 tokens but the last checkpoint inside is at 20 blocks
    e.submit(req("b", [*range(1, 24), 99, 98], 255), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.kv_hit_tokens == 230 and first.cached_tokens == 200
    # checkpoints cost memory: usage counts them while they are in use... and they are evictable
    assert e.has_state(20) and e.has_state(25)


def test_a_block_aligned_prompt_keeps_its_state_before_its_last_token() -> None:
    """vLLM 0.34 keeps a prompt's state at ``(N - 1) // B`` blocks
    (``get_mamba_prefill_checkpoint_position``): a prompt of 25 whole blocks leaves it at 24
    off the grid (the simulated engine kept it at 25, which vLLM never stores), and the
    prompt sent again is granted those 24 blocks (none before: 25 is capped at N - 1)."""
    e = engine(
        kv_blocks=200,
        hybrid=True,
        checkpoint="every_n",
        checkpoint_interval_tokens=100,
        state_checkpoint_blocks=1.0,
    )
    hashes = list(range(1, 26))
    e.submit(req("a", hashes, 250), 0.0)
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == [10, 20, 24]
    e.submit(req("b", hashes, 250), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.cached_tokens == 240
    # on the grid, the state after the whole prompt is kept (and the one before its end)
    e = engine(
        kv_blocks=200,
        hybrid=True,
        checkpoint="every_n",
        checkpoint_interval_tokens=50,
        state_checkpoint_blocks=1.0,
    )
    e.submit(req("a", hashes, 250), 0.0)
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == [5, 10, 15, 20, 24, 25]


@pytest.mark.parametrize("tokens", [205, 210])
def test_the_prompt_end_state_is_kept_when_a_chunk_ends_on_it(tokens: int) -> None:
    """vLLM 0.34 keeps the state at ``(N - 1) // B`` blocks however the prefill is chunked
    (its scheduler stops a chunk there). Chunks of 100 tokens end on block 20, the prompt's
    checkpoint for 205 and 210 tokens; the step completing the prompt starts there, and the
    simulated engine took the prompt-end state only inside that last step, so it kept none
    (and a resend was granted nothing)."""
    e = engine(
        kv_blocks=200,
        hybrid=True,
        checkpoint="every_n",
        checkpoint_interval_tokens=1000,
        state_checkpoint_blocks=1.0,
    )
    hashes = list(range(1, tokens // B + 1))
    e.submit(req("a", hashes, tokens), 0.0)
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == [20]
    e.submit(req("b", hashes, tokens), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.cached_tokens == 200


def test_cpu_tier_offloads_evicted_blocks_and_reloads_them() -> None:
    e = engine(kv_blocks=3, cpu_blocks=10, cpu_load_s_per_token=1e-3)
    e.submit(req("a", [1, 2, 3]), 0.0)
    drain(e)
    e.submit(req("b", [4, 5, 6]), 1.0)
    drain(e)
    ev = e.take_index_events()
    assert removed(ev) == [3, 2, 1] and stored(ev, tier=Tier.CPU) == [3, 2, 1]
    e.submit(req("c", [1, 2, 3]), 2.0)
    outs = drain(e)
    first = next(o for o in outs if isinstance(o, FirstToken))
    assert first.cached_tokens == 20 and first.kv_hit_tokens == 30
    # reload of 30 tokens (0.03 s) + step 0.01 + the last block's 10 tokens of prefill
    assert first.time == pytest.approx(2.0 + 0.03 + 0.01 + 10e-4)
    ev = e.take_index_events()
    assert removed(ev, tier=Tier.CPU) == [1, 2, 3] and e.has_block(1)


def test_cancel_releases_blocks_and_is_idempotent() -> None:
    e = engine(kv_blocks=10)
    e.submit(req("a", [1, 2, 3], out=1000), 0.0)
    e.advance(0.05)
    e.cancel("a", 0.05)
    e.cancel("a", 0.05)
    e.cancel("nope", 0.05)
    assert e.pending() == 0 and e.kv_usage() == 0.0
    assert not any(isinstance(o, Finished) for o in drain(e))
    with pytest.raises(ValueError):
        e.submit(req("x", [1], 0), 1.0)


def test_bundled_profiles_load() -> None:
    assert {"dense-70b", "kimi-k3"} <= set(profile_names())
    kimi = load_profile("kimi-k3")
    assert kimi.hybrid and kimi.state_checkpoint_blocks > 0 and kimi.cpu_blocks > 0
    dense = load_profile("dense-70b")
    assert not dense.hybrid and dense.kv_blocks == 16384
    assert dense.scaled(128).kv_blocks == 8192


def test_sliding_window_blocks_go_first_and_cut_the_hit() -> None:
    """A full + sliding-window engine (window 20 tokens: the 2 blocks before a hit's end):
    the window KV of blocks the window slid past is released during the prefill, so memory
    pressure evicts it before the full-attention KV of the same finished request (and the
    window tail, released after that KV, survives it); a later prompt sharing that KV is
    granted only up to a complete window."""
    e = engine(kv_blocks=47, sliding_window_tokens=20, window_block_cost=1.0)
    a = list(range(1, 11))
    e.submit(req("a", a), 0.0)
    drain(e)
    assert all(e.has_window(h) for h in a)  # all cached, none pinned
    assert stored(e.take_index_events(), Kind.STATE) == a  # every block's window complete
    e.submit(req("b", list(range(100, 116))), 1.0)  # unrelated: its blocks need room
    drain(e)
    events = e.take_index_events()
    assert [h for h in a if not e.has_window(h)] == [1, 2, 3, 4, 5]  # released first
    assert all(e.has_block(h) for h in a)  # the full-attention KV is all there
    assert set(removed(events, Kind.STATE)) == {1, 2, 3, 4, 5, 6}  # 6's window had 5
    # a prompt extending all of a: the window at its end is there
    e.submit(req("d", [*a, 300]), 2.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert (first.kv_hit_tokens, first.cached_tokens) == (100, 100)
    # one sharing a's first 6 blocks: their KV is cached, no complete window in them
    e.submit(req("c", [*a[:6], 200, 201]), 3.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert (first.kv_hit_tokens, first.cached_tokens) == (60, 0)
    # all finished: nothing pinned, every cached block and window evictable, none lost
    assert e.kv_usage() == 0.0 and e._windows == len(e._win)
    assert e._free_cost == len(e._gpu) + e._windows


def test_priority_scheduling_orders_the_queue_and_picks_the_victim() -> None:
    """vLLM's ``--scheduling-policy priority``: waiting requests go in (priority, arrival)
    order, and the running request preempted first is the last in that order."""
    profile = EngineProfile("t", cost=COST, block_size=B, kv_blocks=8, max_running=1)
    e = EngineModel(profile, ReplicaKey("r"), B, scheduling="priority")
    e.submit(req("running", [1]), 0.0)  # runs first: the queue was empty
    e.submit(EngineRequest("late", [2], 10, 1, priority=1), 0.001)
    e.submit(EngineRequest("urgent", [3], 10, 1, priority=-1), 0.002)
    e.submit(EngineRequest("plain", [4], 10, 1), 0.003)
    outs = drain(e)
    order = [o.request_id for o in outs if isinstance(o, Finished)]
    assert order == ["running", "urgent", "plain", "late"]
    fcfs = engine(kv_blocks=8, max_running=1)
    fcfs.submit(req("running", [1]), 0.0)
    fcfs.submit(EngineRequest("late", [2], 10, 1, priority=1), 0.001)
    fcfs.submit(EngineRequest("urgent", [3], 10, 1, priority=-1), 0.002)
    assert [o.request_id for o in drain(fcfs) if isinstance(o, Finished)] == [
        "running",
        "late",
        "urgent",
    ]
    # two decoders outgrow the cache: the lower-priority one goes, though admitted first
    p = EngineModel(EngineProfile("t", cost=COST, block_size=B, kv_blocks=8), ReplicaKey("r"),
                    B, scheduling="priority")  # fmt: skip
    p.submit(EngineRequest("low", [1, 2], 20, 40, priority=5), 0.0)
    p.submit(EngineRequest("high", [3, 4], 20, 40, priority=0), 0.0)
    outs = drain(p)
    assert p.preemptions == 1
    assert [o.request_id for o in outs if isinstance(o, Finished)] == ["high", "low"]
    with pytest.raises(ValueError, match="scheduling"):
        EngineModel(profile, ReplicaKey("r"), B, scheduling="lifo")


def _used(e: EngineModel) -> float:
    """KV memory taken: named blocks, checkpoints, window KV and allocated unnamed blocks."""
    return len(e._gpu) + e._states * e._state_cost + e._windows * e._window_cost + e._reserved


def test_a_remote_prefilled_windows_leave_the_decoders_their_next_block() -> None:
    """A P/D decode leg on a sliding-window engine is admitted beside a decoder that needs a
    block at its next step (kept out of the admission's room). The leg's window KV, named
    at admission, took that block's memory: the decoder's step then wrote into memory the
    engine did not have (13 blocks in use on 12)."""
    e = engine(kv_blocks=12, sliding_window_tokens=25, window_block_cost=1.0)
    e.submit(req("a", [1], 10, out=20), 0.0)  # 1 block; its first decode step needs a 2nd
    remote = EngineRequest("b", list(range(10, 18)), 80, 2, remote_prefilled=True)
    e.submit(remote, 0.005)  # queued behind a's prefill step, admitted after it
    outs: list[object] = []
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
        assert _used(e) <= e.capacity
    fins = {o.request_id: o for o in outs if isinstance(o, Finished)}
    assert fins["a"].output_tokens == 20 and fins["b"].output_tokens == 2


def test_cancelling_the_blocked_head_of_the_queue_admits_the_next_at_once() -> None:
    """A request waits for room behind the queue's head while a decoder runs a long decode
    run. The head's client leaves: vLLM schedules the next one at the next step; the engine
    model left it waiting until the decode run ended (the whole of a's answer)."""
    e = engine(kv_blocks=10)
    e.submit(req("a", [1, 2], out=60), 0.0)  # decodes for 60 steps, up to 7 blocks
    e.advance(0.05)
    e.submit(req("b", list(range(10, 19))), 0.05)  # 9 blocks: no room beside a
    e.submit(req("c", [20]), 0.06)  # 1 block: fits, but FCFS behind b
    e.cancel("b", 0.07)
    outs = drain(e)
    first_c = next(o for o in outs if isinstance(o, FirstToken) and o.request_id == "c")
    fin_a = next(o for o in outs if isinstance(o, Finished) and o.request_id == "a")
    assert first_c.time < 0.1 < fin_a.time


@pytest.mark.parametrize("out", [20, 50])
def test_a_lone_sequence_with_its_window_never_outgrows_the_cache(out: int) -> None:
    """A sequence alone on a sliding-window engine keeps its window KV pinned while it
    decodes (3 blocks here). Its KV alone fitting the cache is not enough: 50 tokens of
    answer took its KV to 10 blocks beside the window's 3 on 10, which no preemption can
    relieve (it is the only one). It is refused at once, as one larger than the cache;
    with 20 tokens (7 blocks + 3) it runs."""
    e = engine(kv_blocks=10, sliding_window_tokens=25, window_block_cost=1.0)
    e.submit(req("a", [1, 2, 3, 4, 5], 50, out=out), 0.0)
    outs = e.advance(0.0)
    while (t := e.next_time()) is not None:
        outs += e.advance(t)
        assert _used(e) <= e.capacity
    (last,) = [o for o in outs if isinstance(o, (Finished, Rejected))]
    assert isinstance(last, Finished if out == 20 else Rejected)


def test_answer_blocks_named_out_of_order_do_not_break_the_hit() -> None:
    """Two requests with the same prompt and answer names, the second answer longer: the
    first names block 50, the second only 51 (50 is cached), so 51 is released after its
    parent and outlives it. The cache is then not prefix-closed, and the hit's bisection
    took a prompt through 1, 50, 51 as a 3-block hit and crashed on the missing 50
    (KeyError: the simulator run, or the mock replica's engine, failed). The hit is the
    blocks before the first missing one."""
    e = engine(kv_blocks=4)
    e.submit(EngineRequest("x", [1], 10, 11, [50, 51]), 0.0)  # names 50
    drain(e)
    e.submit(EngineRequest("y", [1], 10, 21, [50, 51]), 1.0)  # names 51
    drain(e)
    e.submit(req("w", [7, 8]), 2.0)  # evicts the oldest: 50
    drain(e)
    assert not e.has_block(50) and e.has_block(51)
    e.submit(req("z", [1, 50, 51, 9]), 3.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.kv_hit_tokens == 10


def test_a_resumed_sequence_hits_the_answer_blocks_it_left_cached() -> None:
    """vLLM hashes a request's blocks over its prompt and answer, so a preempted request
    resumed finds the answer blocks it freed to the prefix cache and recomputes only the
    rest. b is preempted with 20 tokens of answer (blocks 30, 31 named as it goes; 31 is
    evicted as a grows); resumed once a is done, its prompt and block 30 are a hit, and it
    recomputes 10 tokens, not the 20 of its answer."""
    e = engine(kv_blocks=8)
    e.submit(req("a", [1, 2], out=25), 0.0)
    e.submit(EngineRequest("b", [3, 4], 20, 40, [30, 31, 32, 33, 34]), 0.0)
    outs = drain(e)
    assert e.preemptions == 1
    fin_a = next(o for o in outs if isinstance(o, Finished) and o.request_id == "a")
    (resumed,) = [
        o for o in outs if isinstance(o, TokensEmitted) and o.request_id == "b" and o.count == 1
    ]
    assert resumed.time - fin_a.time == pytest.approx(0.01 + 10 * 1e-4)
    fin_b = next(o for o in outs if isinstance(o, Finished) and o.request_id == "b")
    assert fin_b.output_tokens == 40 and fin_b.cached_tokens == 0  # the first admission's
    assert e.pending() == 0 and e.kv_usage() == 0.0


def test_the_prompt_end_state_is_on_the_engine_block_grid() -> None:
    """With engine blocks of 2 router blocks, vLLM 0.34 keeps a 235-token prompt's state at
    (N - 1) // 20 * 20 = 220 tokens (``get_mamba_prefill_checkpoint_position`` on the
    engine's block; router/core/engine_hits.py ``prompt_end_checkpoint``), and grants the
    prompt sent again those 220. The simulated engine kept it at 23 router blocks, off the
    engine's grid, where no hit of whole engine blocks ends: the resend was granted none."""
    profile = EngineProfile(
        "t",
        cost=COST,
        block_size=B,
        kv_blocks=200,
        hybrid=True,
        checkpoint="every_n",
        checkpoint_interval_tokens=1000,
        state_checkpoint_blocks=1.0,
    )
    e = EngineModel(profile, ReplicaKey("r"), B, engine_block_size=2 * B)
    hashes = list(range(1, 24))
    e.submit(req("a", hashes, 235), 0.0)
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == [22]
    e.submit(req("b", hashes, 235), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.cached_tokens == 220


def test_an_answer_names_only_the_blocks_its_written_kv_fills() -> None:
    """vLLM caches the full blocks of the tokens it computed: the answer's last token is
    sampled, never computed, so an answer ending exactly on a block boundary leaves that
    block unfilled (uncached)."""
    for out, cached in ((10, False), (11, True)):
        e = engine(kv_blocks=20)
        e.submit(EngineRequest("a", [1, 2], 20, out, [3, 4]), 0.0)
        drain(e)
        assert e.has_block(3) is cached, out
        assert not e.has_block(4)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("every_block", list(range(2, 25, 2))), ("step_end", [8, 18, 24])],
)
def test_checkpoints_and_hits_stay_on_a_coarser_engine_block_grid(
    mode: str, expected: list[int]
) -> None:
    """vLLM keeps recurrent state in engine blocks, so a checkpoint ends on an engine block
    boundary and a hit is whole engine blocks. With engine blocks of 2 router blocks and
    prefill steps of 90 tokens, the simulated engine took checkpoints at every router block
    (``every_block``) or at its steps' ends (9, 18 and 25 blocks: ``step_end``), and granted
    a prompt sharing 10 blocks a hit of 90 tokens at the checkpoint at 9 blocks, which vLLM
    never holds (its align mode cuts a step at the engine block boundary below) and the mock
    replica never publishes: the router's prediction and the engine's hit disagreed."""
    profile = EngineProfile(
        "t",
        cost=replace(COST, chunk_tokens=90),
        block_size=B,
        kv_blocks=200,
        hybrid=True,
        checkpoint=mode,
        state_checkpoint_blocks=1.0,
    )
    e = EngineModel(profile, ReplicaKey("r"), B, engine_block_size=2 * B)
    hashes = list(range(1, 26))
    e.submit(req("a", hashes, 255), 0.0)
    drain(e)
    assert stored(e.take_index_events(), Kind.STATE) == expected
    e.submit(req("b", [*hashes[:10], *range(100, 115)], 255), 1.0)
    first = next(o for o in drain(e) if isinstance(o, FirstToken))
    assert first.kv_hit_tokens == 100
    assert first.cached_tokens == (100 if mode == "every_block" else 80)


def test_a_chunked_prefill_reports_the_blocks_of_the_chunks_scheduled_so_far() -> None:
    """vLLM 0.34 checks at admission that the whole prompt fits (``full_sequence_must_fit``)
    but allocates the blocks of the tokens each step schedules (``allocate_slots``:
    ``num_tokens_need_slot = total_computed_tokens + num_new_tokens``), so its KV usage,
    which routers read, grows chunk by chunk. The engine model reported the whole prompt's
    blocks, reserved at admission, from the first chunk on."""
    e = engine(kv_blocks=100)
    e.submit(req("a", list(range(1, 26)), 250, out=5), 0.0)  # chunks of 100, 100, 50
    assert e.report(0.001).kv_usage == pytest.approx(0.10)
    e.advance(0.021)  # the second chunk's step
    assert e.report(0.021).kv_usage == pytest.approx(0.20)
    e.advance(0.041)
    assert e.report(0.041).kv_usage == pytest.approx(0.25)
