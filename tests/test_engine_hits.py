"""The engines' hit rule as the router predicts it (router/core/engine_hits.py): where a
hybrid engine keeps a prompt's last checkpoint, what an engine block coarser than the router's
does to speculation, what EAGLE / MTP speculative decoding gives back of every hit, and how
the router learns the engine block from the checkpoints it sees. Expected figures follow vLLM
0.34 (``get_mamba_prefill_checkpoint_position``, ``_mamba_block_aligned_split``,
``FullAttentionManager.find_longest_cache_hit``: ``hit_length -= block``)."""

from __future__ import annotations

import random

import pytest

from router.core.engine_hits import engine_holds, peeked, prompt_end_checkpoint
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.state_layout import SOURCE_ENGINE, CheckpointGrid, StateLayout
from router.core.types import Kind, PrefixMatch, ReplicaKey, RouteRequest
from tests.test_events_window import _vllm_window_manager

A, B = ReplicaKey("a"), ReplicaKey("b")
BS = 64


def req(tokens: int, hashes: list[int], session: str | None = None) -> RouteRequest:
    return RouteRequest("r", "m", tokens, hashes[: tokens // BS], BS, session_id=session)


def test_speculated_checkpoints_follow_the_grid_and_stop_at_the_prompt_end() -> None:
    hashes = list(range(100, 110))
    grid4 = StateLayout(hybrid=True, interval_blocks=4)
    # the prompt's own checkpoint ends before its last token: block 9 of a 10-block prompt
    assert engine_holds(req(10 * BS, hashes), grid4, False).state_hashes == (103, 107, 108)
    assert engine_holds(req(10 * BS + 1, hashes), grid4, False).state_hashes == (103, 107, 109)
    # a grid point on the prompt's end is kept too (the state after the whole prompt)
    on_grid = engine_holds(req(8 * BS, hashes), grid4, False)
    assert on_grid.state_hashes == (103, 106, 107) and on_grid.next_hit_blocks == 8
    assert engine_holds(req(3 * BS + 5, hashes), grid4, False).state_hashes == (102,)
    assert engine_holds(req(BS - 1, hashes), grid4, False).state_hashes == ()
    no_grid = StateLayout(hybrid=True, interval_blocks=0)
    assert engine_holds(req(5 * BS, hashes), no_grid, False).state_hashes == (103,)
    kv_only = engine_holds(req(5 * BS, hashes), StateLayout(False, 0), False)
    assert kv_only.state_hashes == () and kv_only.kv_blocks == kv_only.next_hit_blocks == 5


def test_an_engine_block_coarser_than_the_routers_holds_back_the_partial_one() -> None:
    """A 1,024-token engine block over 64-token router blocks (16 router blocks): a 2,100-
    token prompt leaves KV and its last checkpoint at 2,048 tokens, not at 2,048 + 0 router
    blocks past it (2,048 is also where the router's own 64-token grid ends: use 2,500)."""
    hashes = list(range(1000, 1100))
    layout = StateLayout(hybrid=True, interval_blocks=0, alignment_blocks=16)
    held = engine_holds(req(2500, hashes), layout, eagle=False)  # 39 router blocks
    assert held.kv_blocks == 32 and held.state_hashes == (hashes[31],)
    assert held.next_hit_blocks == 32
    # grid checkpoints beyond the last engine block are not taken either
    gridded = StateLayout(hybrid=True, interval_blocks=16, alignment_blocks=16)
    assert engine_holds(req(2500, hashes), gridded, False).state_hashes == (
        hashes[15],
        hashes[31],
    )


def test_eagle_keeps_the_last_checkpoint_one_engine_block_lower() -> None:
    # vLLM: checkpoint = N // a * a - a with EAGLE (a = 1,024 tokens): 2,500 -> 1,024
    assert prompt_end_checkpoint(2500, BS, 16, eagle=True) == 16
    assert prompt_end_checkpoint(2500, BS, 16, eagle=False) == 32
    assert prompt_end_checkpoint(2048, BS, 16, eagle=True) == 16
    assert prompt_end_checkpoint(2048, BS, 16, eagle=False) == 16  # (N - 1) // a * a
    assert prompt_end_checkpoint(1000, BS, 16, eagle=True) == 0
    hashes = list(range(1000, 1100))
    layout = StateLayout(hybrid=True, interval_blocks=0, alignment_blocks=16)
    held = engine_holds(req(2500, hashes), layout, eagle=True)
    assert held.state_hashes == (hashes[15],) and held.next_hit_blocks == 16
    kv_only = engine_holds(req(2500, hashes), StateLayout(False, 0, alignment_blocks=1), True)
    assert kv_only.kv_blocks == 39 and kv_only.next_hit_blocks == 38


def test_peeked_groups() -> None:
    kv = [(40, 0b01), (20, 0b10)]
    assert peeked(kv, 39, 16, 16) == [(16, 0b01)]  # 40 -> cap 39 -> 32 -> 16; 20 -> 16 -> 0
    assert peeked(kv, 100, 1, 1) == [(39, 0b01), (19, 0b10)]


def test_index_with_eagle_gives_back_one_engine_block_of_every_hit() -> None:
    idx = PrefixIndex()
    h = list(range(500, 540))
    idx.store(A, h[:40])
    idx.store(B, h[:20])
    # KV-only model, engine block = router block
    m = idx.match(h[:40], prompt_tokens=40 * BS + 7, block_size=BS, peek_blocks=1)
    assert m.get(A).usable_blocks == 39 and m.get(A).kv_blocks == 40
    assert m.get(B).usable_blocks == 19
    # hybrid: a checkpoint at L serves only where the KV runs on to L + the engine block
    idx.store(A, [h[15], h[31]], kind=Kind.STATE)
    idx.store(B, [h[15]], kind=Kind.STATE)
    m = idx.match(
        h[:40],
        hybrid=True,
        prompt_tokens=40 * BS + 7,
        block_size=BS,
        align_blocks=16,
        peek_blocks=16,
    )
    assert m.get(A).usable_blocks == 16  # 40 -> 32 -> peek 16: the checkpoint at 32 waits
    assert m.get(B).usable_blocks == 0  # 20 -> 16 -> peek 0
    plain = idx.match(h[:40], hybrid=True, prompt_tokens=40 * BS + 7, block_size=BS)
    assert plain.get(A).usable_blocks == 32 and plain.get(B).usable_blocks == 16
    cols = m.columns(idx.slots([A, B]))
    assert list(cols[3]) == [16, 0]


def _engine(settings: RoutingSettings) -> RoutingEngine:
    return RoutingEngine(PrefixIndex(), LoadTracker(), make_policy("ours"), settings)


def test_dispatch_speculates_what_the_engine_will_hold() -> None:
    """The next turn of a 2,500-token hybrid prompt on 1,024-token engine blocks is predicted
    to reuse 2,048 tokens there (it reused 2,496 before: the state at 39 router blocks, which
    the engine never keeps), and 1,024 with EAGLE."""
    hashes = list(range(7000, 7100))
    for eagle, expect in ((False, 2048), (True, 1024)):
        engine = _engine(
            RoutingSettings(block_size=BS, hybrid=True, engine_block_size=1024, eagle=eagle)
        )
        first = req(2500, hashes)
        decision = engine.route(first, [A, B], 0.0, random.Random(0))
        engine.dispatched(first, decision, 0.0)
        nxt = req(4000, hashes)
        match = engine.matches(nxt, [A, B], 0.1).get(decision.replica)
        assert match.usable_blocks * BS == expect, eagle
        assert match.kv_blocks * BS == 2048


def test_the_session_hint_reaches_no_further_than_the_engine_holds() -> None:
    hashes = list(range(9000, 9100))
    engine = _engine(RoutingSettings(block_size=BS, hybrid=True, engine_block_size=1024))
    assert engine.sessions is not None
    first = req(2500, hashes, session="s1")
    decision = engine.route(first, [A, B], 0.0, random.Random(0))
    engine.dispatched(first, decision, 0.0)
    hint = engine.sessions.get("s1", 0.1)
    assert hint is not None and hint.covers(hashes[:62]) == 32


def _spec_match(settings: RoutingSettings, first: RouteRequest, nxt: RouteRequest) -> PrefixMatch:
    """What the router predicts of ``nxt`` where it sent ``first`` (speculated entries)."""
    engine = _engine(settings)
    decision = engine.route(first, [A, B], 0.0, random.Random(0))
    engine.dispatched(first, decision, 0.0)
    return engine.matches(nxt, [A, B], 0.1).get(decision.replica)


def test_a_block_aligned_prompt_keeps_its_last_checkpoint_one_engine_block_lower() -> None:
    """vLLM 0.34 keeps a prompt's last checkpoint at ``(N - 1) // a * a`` tokens
    (``get_mamba_prefill_checkpoint_position``; the default ``prefix_cache_retention_interval``
    0 retains only the replay boundary ``N - 1``): a 2,048-token prompt on 1,024-token engine
    blocks leaves its state at 1,024, so its next turn is granted 1,024 tokens there, not
    2,048. Both the speculated checkpoint and the session hint stop there (they said 2,048:
    a state the engine never stores, so the hint never settled)."""
    hashes = list(range(7000, 7100))
    settings = RoutingSettings(block_size=BS, hybrid=True, engine_block_size=1024)
    match = _spec_match(settings, req(2048, hashes), req(4000, hashes))
    assert match.kv_blocks * BS == 2048
    assert match.usable_blocks * BS == 1024
    engine = _engine(settings)
    first = req(2048, hashes, session="s1")
    engine.dispatched(first, engine.route(first, [A, B], 0.0, random.Random(0)), 0.0)
    assert engine.sessions is not None
    hint = engine.sessions.get("s1", 0.1)
    assert hint is not None and hint.covers(hashes[:62]) * BS == 1024
    # lookahead hashes (EAGLE without the block drop): the checkpoint leaves them room too
    layout = StateLayout(hybrid=True, interval_blocks=0, alignment_blocks=16)
    assert engine_holds(req(2049, hashes), layout, False, lookahead=2).next_hit_blocks == 16
    assert engine_holds(req(2050, hashes), layout, False, lookahead=2).next_hit_blocks == 32


def test_checkpoint_grid_learns_the_engine_block_from_checkpoint_positions() -> None:
    """vLLM 0.34 prompt-end checkpoints on 1,024-token engine blocks, seen in 64-token router
    blocks: every position is a multiple of 16."""
    rng = random.Random(3)
    grid = CheckpointGrid(BS)
    for _ in range(200):
        n = rng.randrange(1100, 200_000)
        grid.observe_end(n // 1024 * 1024)
    assert grid.alignment() == 16
    every_block = CheckpointGrid(BS)
    for _ in range(200):
        every_block.observe(rng.randrange(1, 3000))
    assert every_block.alignment() == 1
    assert CheckpointGrid(BS).alignment() is None  # nothing seen yet


def test_a_learned_alignment_moves_the_layout_and_configuration_wins() -> None:
    engine = _engine(RoutingSettings(block_size=BS, hybrid=True))
    assert engine.layout.alignment_blocks == 1
    assert engine.learn(alignment=(16, SOURCE_ENGINE))
    assert engine.layout.alignment_blocks == 16 and engine.layout.alignment_source == "engine"
    configured = _engine(RoutingSettings(block_size=BS, hybrid=True, engine_block_size=512))
    configured.learn(alignment=(16, SOURCE_ENGINE))
    assert configured.layout.alignment_blocks == 8
    assert configured.layout.alignment_source == "config"
    # a KV-only model learns nothing from checkpoints
    kv_only = _engine(RoutingSettings(block_size=BS, hybrid=False))
    kv_only.learn(alignment=(16, SOURCE_ENGINE))
    assert kv_only.layout.alignment_blocks == 1


def test_a_request_reading_no_cache_matches_nothing_and_takes_no_hint() -> None:
    """vLLM reads no prefix cache for a request asking prompt logprobs: no replica is
    predicted to shorten it, its session's hint included; it is still speculated where sent
    (the engine caches the blocks it computes), here as its session's hint."""
    hashes = list(range(3000, 3040))
    engine = _engine(RoutingSettings(block_size=BS))
    first = req(30 * BS, hashes, session="s")
    decision = engine.route(first, [A, B], 0.0, random.Random(0))
    engine.dispatched(first, decision, 0.0)
    blind = req(30 * BS, hashes, session="s")._replace(reads_cache=False)
    assert not engine.matches(blind, [A, B], 0.1)
    cands = engine.candidates(blind, [A, B], 0.1)
    assert isinstance(cands, list) and all(c.match.usable_blocks == 0 for c in cands)
    other = engine.route(blind, [A, B], 0.1, random.Random(0))
    assert other.usable_tokens == 0
    engine.dispatched(blind, other, 0.1)
    # it computed the whole prompt there: the session's next turn follows it
    assert engine.sessions is not None
    hint = engine.sessions.get("s", 0.2)
    assert hint is not None and hint.replica == other.replica and hint.covers(hashes[:30]) == 30


def test_a_match_ending_inside_an_engine_block_is_granted_to_the_block_before() -> None:
    """A KV-only model on 1,024-token engine blocks (16 router blocks): a prompt sharing 20
    router blocks with a cached chain diverges inside the engine's second block, whose hash
    covers tokens it does not share: the engine grants 16 (vLLM's hit lands on its blocks)."""
    idx = PrefixIndex()
    h = list(range(800, 840))
    idx.store(A, h[:32])
    branch = [*h[:20], *range(9000, 9012)]
    m = idx.match(branch, prompt_tokens=32 * BS + 5, block_size=BS, align_blocks=16)
    assert m.get(A).kv_blocks == 20 and m.get(A).usable_blocks == 16
    whole = idx.match(h[:32], prompt_tokens=32 * BS + 5, block_size=BS, align_blocks=16)
    assert whole.get(A).usable_blocks == 32
    assert idx.match(branch).get(A).usable_blocks == 20  # router blocks = engine blocks


def test_a_hint_credits_no_more_than_the_next_request_is_granted() -> None:
    """The session's prompt resent whole (a retry, a regenerate) on an engine block boundary
    (2,048 tokens on 1,024-token engine blocks): the engine recomputes the last token, so it
    grants the first engine block only (none with EAGLE on a model of one KV cache group;
    a hybrid model's draft group matches both blocks before giving one back,
    ``eagle_proof_margin``; a hybrid model only where a
    checkpoint is kept there: the prompt's own, which vLLM 0.34 keeps at ``(N - 1) // a * a``
    for this very case, or on a grid), as it would once the events came, whatever the
    previous turn's hint says it holds."""
    hashes = list(range(9500, 9600))
    for hybrid, grid, eagle, expect in (
        (False, 0, False, 16),
        (False, 0, True, 0),
        (True, 0, False, 16),
        (True, 16, False, 16),
        (True, 16, True, 16),
    ):
        settings = RoutingSettings(
            block_size=BS,
            hybrid=hybrid,
            state_interval_blocks=grid,
            engine_block_size=1024,
            eagle=eagle,
        )
        engine = _engine(settings)
        first = req(2048, hashes, session="s1")
        decision = engine.route(first, [A, B], 0.0, random.Random(0))
        engine.dispatched(first, decision, 0.0)
        again = req(2048, hashes, session="s1")
        got = engine.candidates(again, [A, B], 0.1)
        assert isinstance(got, list)
        credit = next(c.match.usable_blocks for c in got if c.replica == decision.replica)
        # what the index grants once the engine's events report the previous turn
        events = _engine(settings)
        held = engine_holds(first, events.layout, events.drops_eagle_block)
        events.index.store(decision.replica, hashes[: held.kv_blocks])
        if hybrid:
            events.index.store(decision.replica, held.state_hashes, kind=Kind.STATE)
        indexed = events.matches(again, [A, B], 0.1).get(decision.replica).usable_blocks
        assert credit == indexed == expect, (hybrid, grid, eagle)


def test_a_kv_only_prompt_cached_whole_is_a_hit_one_block_short() -> None:
    """vLLM recomputes a prompt's last token, so a prompt of whole blocks cached whole is
    granted one engine block less (``(N - 1) // B`` blocks): the router predicted all of
    it. Engine blocks finer than the router's give back less than a router block, which
    the grid cannot show: the match stays whole there (``engine_block_size`` 16, and not
    configured: the engines' defaults are finer)."""
    hashes = list(range(300, 310))
    for engine_block, aligned, unaligned in ((0, 10, 10), (BS, 9, 10), (16, 10, 10)):
        engine = _engine(RoutingSettings(block_size=BS, engine_block_size=engine_block))
        engine.index.store(A, hashes)
        for tokens, expect in ((10 * BS, aligned), (10 * BS + 1, unaligned)):
            got = engine.matches(req(tokens, hashes), [A, B], 0.0).get(A).usable_blocks
            assert got == expect, (engine_block, tokens)
        # a session's hint reaches as far (the previous turn resent whole, before its events)
        hinted = _engine(RoutingSettings(block_size=BS, engine_block_size=engine_block))
        first = req(10 * BS, hashes, session="s")
        hinted.dispatched(first, hinted.route(first, [A], 0.0, random.Random(0)), 0.0)
        credit = hinted.candidates(req(10 * BS, hashes, session="s"), [A], 0.1)
        assert isinstance(credit, list) and credit[0].match.usable_blocks == aligned


def _vllm_grant(prompt: int, full: int, states: set[int], eagle: bool, hybrid: bool) -> int:
    """Tokens vLLM 0.34 grants a prompt of ``prompt`` tokens on ``ENGINE``-token blocks (the
    attention and mamba groups' one block size in "align" mode) where its full-attention
    group caches the first ``full`` blocks and its mamba group the states ending at the
    blocks in ``states``: its own ``FullAttentionManager`` / ``MambaManager`` hit searches
    (tests/engines, unmodified), called as ``HybridKVCacheCoordinator.find_longest_cache_hit``
    calls them (one pass for full attention + mamba; an EAGLE group looks
    ``eagle_proof_margin`` = one block past the ``num_tokens - 1`` cap of
    ``Request.get_max_cache_hit_length``, within the request's hashed blocks, then drops
    one), or, KV-only (one group), as ``UnitaryKVCacheCoordinator`` calls the first (the
    cap as it is, no margin)."""
    mod = _vllm_window_manager()
    hashes = [f"b{i}" for i in range(prompt // ENGINE)]  # full blocks only, no lookahead

    class Pool:
        null_block = None
        hash_block_size = ENGINE

        def __init__(self, cached: set[str]) -> None:
            self.cached = cached

        def get_cached_block(self, h: str, ids: list[int]) -> list[object] | None:
            return [object()] * len(ids) if h in self.cached else None

    cap = prompt - 1
    if eagle and hybrid:
        cap = min(cap + ENGINE, len(hashes) * ENGINE)
    spec = mod.FullAttentionSpec()
    spec.block_size = ENGINE
    pool = Pool({f"b{i}" for i in range(full)})
    _, hit = mod.FullAttentionManager.find_longest_cache_hit(
        hashes, cap, [0], pool, spec, eagle, ENGINE
    )
    if hybrid:
        spec = mod.MambaSpec()
        spec.block_size = ENGINE
        pool = Pool({f"b{i - 1}" for i in states})
        _, hit = mod.MambaManager.find_longest_cache_hit(
            hashes, hit, [1], pool, spec, eagle, ENGINE
        )
    return int(hit)


ENGINE = 1024  # vLLM's hybrid block: attention and mamba alike ("align" mode)


@pytest.mark.parametrize("eagle", [False, True])
@pytest.mark.parametrize("hybrid", [False, True])
def test_the_usable_prefix_is_what_vllms_coordinator_grants(eagle: bool, hybrid: bool) -> None:
    """Prompts on, one token before and one past engine block boundaries, against every
    cache of up to 4 full-attention blocks and any states on them: the router's usable
    prefix (engine block = 16 router blocks) is vLLM's grant. A block-aligned prompt with
    EAGLE on a hybrid model was predicted one engine block short: the router capped the hit
    at ``N - 1`` before giving back the draft head's block, while the hybrid coordinator's
    EAGLE group matches up to the prompt's last whole block first; so the state at the
    prompt's end less one block (where vLLM keeps it) was predicted unusable and the hit
    lost whole. A KV-only model's one group gets no such margin."""
    align = ENGINE // BS
    h = list(range(9000, 9000 + 5 * align))
    for prompt in (1023, 1024, 1025, 2047, 2048, 2049, 3072, 3073, 4096, 4097):
        hashes = h[: prompt // BS]
        for full in range(5):
            for n_states in range(1 << full if hybrid else 1):
                states = {i + 1 for i in range(full) if n_states >> i & 1}
                idx = PrefixIndex()
                idx.add_replica(A)
                if full:
                    idx.store(A, h[: full * align])
                if states:
                    idx.store(A, [h[s * align - 1] for s in states], kind=Kind.STATE)
                got = idx.match(
                    hashes,
                    hybrid=hybrid,
                    prompt_tokens=prompt,
                    block_size=BS,
                    align_blocks=align,
                    peek_blocks=align if eagle else 0,
                ).get(A)
                want = _vllm_grant(prompt, full, states, eagle, hybrid)
                assert got.usable_blocks * BS == want, (prompt, full, sorted(states))
