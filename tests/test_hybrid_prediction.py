"""The router's usable-hit prediction against a hybrid engine, request by request.

The simulator's engine model (KV LRU, recurrent-state checkpoints on a grid plus the prompt
end, each costing KV memory, evictions of both) serves multi-turn sessions one request at a
time. Its index events go the way a live engine's do: the mock's vLLM-format encoder
(engine blocks of 16 tokens, checkpoints as group 1 ``kv_cache_spec_kind="mamba"``), msgpack
on the wire, ``EngineIngest`` (decode + re-block) into the router's ``PrefixIndex``. The
router is told nothing about the model: hybrid-ness and the grid are learned from the events.
With one request at a time the index is exact when a request is routed, so the predicted
usable hit must equal the engine's reported hit for every request.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.state_layout import SOURCE_ENGINE, CheckpointGrid
from router.core.types import (
    BlocksRemoved,
    EventBatch,
    IndexEvent,
    Kind,
    ReplicaKey,
    RouteRequest,
)
from router.events.encode import encode_batch
from router.events.ingest import EngineIngest
from router.events.model import EngineBatch
from router.mock.kv_events import EngineEventEncoder
from sim.engine import EngineModel, EngineRequest, Finished, FirstToken
from sim.profiles import EngineProfile, load_profile

B = 64
MODEL = "hybrid-model"
GRID_TOKENS = 1024  # the engine checkpoints every 16 router blocks (and at prompt ends)
KEYS = (ReplicaKey("r0"), ReplicaKey("r1"))


@dataclass
class Replica:
    """One engine model with the event path of a live replica behind it."""

    key: ReplicaKey
    engine: EngineModel
    encoder: EngineEventEncoder
    ingest: EngineIngest
    state_removals: int = 0


@dataclass
class Fleet:
    index: PrefixIndex
    router: RoutingEngine
    grid: CheckpointGrid
    replicas: dict[ReplicaKey, Replica] = field(default_factory=dict)
    now: float = 0.0

    def publish(self, rep: Replica) -> None:
        events = rep.engine.take_index_events()
        rep.state_removals += sum(
            len(e.hashes) for e in events if isinstance(e, BlocksRemoved) and e.kind is Kind.STATE
        )
        engine_events = rep.encoder.convert(events)
        if engine_events:
            payload = encode_batch(EngineBatch(self.now, tuple(engine_events), None))
            rep.ingest.handle_payload(payload)

    def serve(self, tokens: list[int], output: int, rng: random.Random) -> tuple[int, int, int]:
        """Route and serve one request to completion; (predicted usable, engine cached,
        engine KV-only hit) in tokens."""
        hashes = hash_prompt(tokens, B, root_hash(MODEL)).hashes
        request = RouteRequest(f"q{self.now:.0f}", MODEL, len(tokens), hashes, B)
        decision = self.router.route(request, KEYS, self.now, rng)
        self.router.dispatched(request, decision, self.now)
        rep = self.replicas[decision.replica]
        rep.encoder.learn(list(hashes), tokens)
        rep.engine.submit(EngineRequest(request.request_id, hashes, len(tokens), output), self.now)
        cached = kv_hit = -1
        while True:
            when = rep.engine.next_time()
            assert when is not None, "the engine stopped before finishing the request"
            self.now = max(self.now, when)
            outputs = rep.engine.advance(self.now)
            self.publish(rep)
            for out in outputs:
                if isinstance(out, FirstToken):
                    cached, kv_hit = out.cached_tokens, out.kv_hit_tokens
            if any(isinstance(out, Finished) for out in outputs):
                break
        self.router.load.complete(request.request_id)
        self.now += 1.0
        return decision.usable_tokens, cached, kv_hit


def _fleet(
    settings: RoutingSettings,
    kv_blocks: int,
    engine_block: int,
    profile: EngineProfile | None = None,
) -> Fleet:
    if profile is None:
        profile = load_profile("kimi-k3").with_overrides(
            checkpoint_interval_tokens=GRID_TOKENS, cpu_blocks=0
        )
    window = profile.sliding_window_tokens
    index, load = PrefixIndex(), LoadTracker()
    grid = CheckpointGrid(B)
    router = RoutingEngine(index, load, make_policy("longest_prefix"), settings)
    fleet = Fleet(index, router, grid)
    for key in KEYS:
        load.add_replica(key)
        index.add_replica(key)

        def sink(k: ReplicaKey, events: list[IndexEvent], index: PrefixIndex = index) -> None:
            index.apply(EventBatch(k, tuple(events)))

        fleet.replicas[key] = Replica(
            key,
            EngineModel(profile, key, B, kv_blocks=kv_blocks, publish_window_blocks=True),
            EngineEventEncoder(B, engine_block, sliding_window=window),
            EngineIngest(key.replica, MODEL, B, sink, on_checkpoint=grid.observe_end),
        )
    return fleet


def _sessions(rng: random.Random, n: int) -> list[list[list[int]]]:
    """``n`` sessions of growing prompts: a shared system prompt (one of two, shorter than
    the grid), then turns that append an answer and a tool output of random lengths (partial
    last blocks); now and then a turn branches off an earlier point of the context (an agent
    retrying a step), so hits end between checkpoints."""

    def fresh(count: int) -> list[int]:
        return [rng.randrange(1, 90_000) for _ in range(count)]

    systems = [fresh(rng.randrange(560, 1000)) for _ in "ab"]
    out = []
    for _ in range(n):
        context = list(rng.choice(systems)) + fresh(200)
        turns = []
        for _ in range(rng.randrange(2, 7)):
            turns.append(list(context))
            if rng.random() < 0.3:
                turns.append(context[: rng.randrange(len(context) // 2, len(context))] + fresh(300))
            context += fresh(rng.randrange(100, 1800))
        out.append(turns)
    return out


def _interleaved(sessions: list[list[list[int]]], rng: random.Random) -> list[list[int]]:
    """Turns of all sessions in a random interleaving (each session's in order)."""
    cursors = [0] * len(sessions)
    order = []
    while any(c < len(s) for c, s in zip(cursors, sessions, strict=True)):
        i = rng.choice([i for i, s in enumerate(sessions) if cursors[i] < len(s)])
        order.append(sessions[i][cursors[i]])
        cursors[i] += 1
    return order


def _serve_sessions(fleet: Fleet, rng: random.Random) -> list[tuple[int, int, int, int]]:
    """14 interleaved sessions through ``fleet``: (prompt tokens, predicted, cached, KV hit)
    per request."""
    rows = []
    for tokens in _interleaved(_sessions(rng, 14), rng):
        predicted, cached, kv_hit = fleet.serve(tokens, rng.randrange(1, 40), rng)
        rows.append((len(tokens), predicted, cached, kv_hit))
    return rows


def _assert_predicted(rows: list[tuple[int, int, int, int]]) -> None:
    """Every request's predicted hit is what the engine cached (engines always compute the
    prompt's last token: a whole cached prompt reports n - 1)."""
    wrong = [r for r in rows if min(r[1], r[0] - 1) != r[2]]
    assert not wrong, f"{len(wrong)} of {len(rows)} requests mispredicted: {wrong[:5]}"


@pytest.mark.parametrize("engine_block", [16, 64])
def test_predicted_usable_hit_equals_the_engines_hit_for_every_request(engine_block: int) -> None:
    rng = random.Random(24)
    # no hybrid flag, no grid: learned from the events; memory tight enough that KV blocks
    # and checkpoints (40 blocks of memory each) are evicted along the way
    fleet = _fleet(RoutingSettings(block_size=B), kv_blocks=900, engine_block=engine_block)
    assert not fleet.router.layout.hybrid
    rows = _serve_sessions(fleet, rng)
    _assert_predicted(rows)
    assert fleet.router.layout.hybrid and fleet.router.layout.hybrid_source == SOURCE_ENGINE
    # the run exercised what the hybrid rule is about: KV beyond the last checkpoint (usable
    # < KV hit), hits at grid checkpoints and at prompt ends, evicted checkpoints
    assert sum(r[3] - r[2] for r in rows) > 0
    usable_at = {r[2] // B for r in rows if r[2] > 0}
    assert any(b % (GRID_TOKENS // B) == 0 for b in usable_at)
    assert any(b % (GRID_TOKENS // B) for b in usable_at)
    assert sum(rep.state_removals for rep in fleet.replicas.values()) > 0
    # the grid, from the checkpoints' positions alone
    assert fleet.grid.interval() == GRID_TOKENS // B
    assert fleet.grid.unaligned == 0


def test_speculating_on_a_wrong_grid_over_predicts_and_the_learned_one_does_not() -> None:
    """The failure the live demo showed: speculative checkpoints on a hand-configured grid
    (8 blocks) that is not the engine's (16) stay for the speculative TTL and make the router
    promise hits at depths where the engine has no checkpoint. Ample memory here, so only the
    grid differs between the two runs."""

    def run(settings: RoutingSettings) -> tuple[int, int]:
        rng = random.Random(5)
        fleet = _fleet(settings, kv_blocks=200_000, engine_block=16)
        predicted = engine = 0
        for tokens in _interleaved(_sessions(rng, 10), rng):
            p, cached, _ = fleet.serve(tokens, 8, rng)
            predicted += min(p, len(tokens) - 1)
            engine += cached
        return predicted, engine

    wrong_predicted, wrong_engine = run(
        RoutingSettings(block_size=B, hybrid=True, state_interval_blocks=8, speculative_ttl_s=600)
    )
    assert wrong_predicted > wrong_engine * 1.05
    learned_predicted, learned_engine = run(RoutingSettings(block_size=B, speculative_ttl_s=600))
    assert learned_predicted == learned_engine


@pytest.mark.parametrize(("window", "engine_block"), [(128, 16), (128, 64), (300, 16)])
def test_sliding_window_model_predicted_hit_equals_the_engines(
    window: int, engine_block: int
) -> None:
    """A full + sliding-window model (the gpt-oss profile): the engine model publishes its
    window blocks as a vLLM window group (mock encoder, engine blocks of 16 or 64), the
    router derives where windows are complete (router/events/window.py) and learns that the
    model needs them; memory tight enough that windows the engine freed early are evicted
    while the full-attention KV stays, so branches inside shared prefixes lose their hit."""
    profile = load_profile("gpt-oss-120b").with_overrides(sliding_window_tokens=window)
    rng = random.Random(window + engine_block)
    fleet = _fleet(RoutingSettings(block_size=B), 250, engine_block, profile)
    assert not fleet.router.layout.hybrid
    rows = _serve_sessions(fleet, rng)
    _assert_predicted(rows)
    assert fleet.router.layout.hybrid  # learned from the window checkpoints
    # the window rule cut hits: KV cached beyond the usable prefix, and windows evicted
    assert sum(1 for r in rows if r[3] - r[2] >= B) >= 3
    assert sum(rep.state_removals for rep in fleet.replicas.values()) > 0
    for rep in fleet.replicas.values():  # all done: nothing pinned, nothing lost
        e = rep.engine
        assert e.kv_usage() == 0.0 and e._windows == len(e._win)
        assert e._free_cost == pytest.approx(len(e._gpu) + e._windows * e._window_cost)


@pytest.mark.parametrize(("mode", "cpu_blocks"), [("step_end", 0), ("every_block", 1500)])
def test_engine_blocks_coarser_than_the_routers_keep_prediction_exact(
    mode: str, cpu_blocks: int
) -> None:
    """Engine blocks of 2 router blocks, checkpoints at steps' ends or every block: the
    engine's checkpoints (hence its hits) are on its block grid, which is all its events can
    name. The simulated engine took them at router blocks off that grid and granted hits
    there that the router, fed the same engine's events, could not predict."""
    rng = random.Random(7)
    profile = load_profile("kimi-k3").with_overrides(
        checkpoint=mode, checkpoint_interval_tokens=GRID_TOKENS, cpu_blocks=cpu_blocks
    )
    settings = RoutingSettings(block_size=B, engine_block_size=2 * B)
    fleet = _fleet(settings, kv_blocks=900, engine_block=2 * B, profile=profile)
    for rep in fleet.replicas.values():
        rep.engine = EngineModel(
            profile, rep.key, B, kv_blocks=900, publish_window_blocks=True,
            engine_block_size=2 * B,
        )  # fmt: skip
    _assert_predicted(_serve_sessions(fleet, rng))


@pytest.mark.parametrize(
    ("profile_name", "mode"),
    [("kimi-k3", "every_n"), ("kimi-k3", "every_block"), ("kimi-k3", "step_end"),
     ("gpt-oss-120b", "")],
)  # fmt: skip
def test_the_simulated_router_routes_on_the_layout_the_service_learns(
    profile_name: str, mode: str
) -> None:
    """The simulator's routers are given the state layout a live router, told nothing of
    the model (as the demo's), learns from the same engine's events (router/service/
    layout.py: ``CheckpointGrid`` over the checkpoints' positions): hybrid, and a grid only
    where the engine checkpoints on one. A checkpoint at every block (a sliding window, or
    ``every_block``) or only where prefill steps end shows no grid; the simulator routed
    those on one (every block; the profile's interval), speculating checkpoints the live
    router never speculates."""
    from router.core.state_layout import effective_layout
    from sim.cluster import ClusterConfig, Simulation
    from sim.workload import Workload

    profile = load_profile(profile_name).with_overrides(cpu_blocks=0)
    if mode:
        profile = profile.with_overrides(checkpoint=mode, checkpoint_interval_tokens=GRID_TOKENS)
    fleet = _fleet(RoutingSettings(block_size=B), 20_000, B, profile)
    _serve_sessions(fleet, random.Random(3))
    interval = fleet.grid.interval()
    assert interval is not None  # enough checkpoints seen to tell
    learned = effective_layout(None, 0, SOURCE_ENGINE, (interval, SOURCE_ENGINE))
    sim = Simulation(Workload("none", [], B, MODEL), ClusterConfig(profile), "ours")
    layout = sim.routers[0].engine.layout
    assert (layout.hybrid, layout.interval_blocks) == (learned.hybrid, learned.interval_blocks)
