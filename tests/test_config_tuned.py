"""The simulator's tuned-settings file carries the model's routing grid (block size, hybrid,
recurrent-state interval) as well as the policy, and the router takes all of it through
``load_settings(policy_file=...)``."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.core.errors import ConfigError
from router.service.config import load_settings
from router.service.settings import ModelSettings
from sim.cluster import ClusterConfig
from sim.profiles import load_profile
from sim.runner import build_workload
from sim.tune import GRID, tune
from sim.tuned import TunedPolicy, dump_tuned, load_tuned
from tests.inprocess import kvrouter

MODEL = "kimi/k3"
BLOCK = 64


def _tiny_tune(profile: str) -> tuple[ClusterConfig, dict[str, object]]:
    """The real tuner on 40 bundled-trace requests, two settings, one speed-up."""
    config = ClusterConfig(
        profile=load_profile(profile), replicas=2, block_size=BLOCK, kv_blocks=4096
    )
    workload = build_workload("mooncake", block_size=BLOCK, limit=40, model=MODEL)
    best, _ = tune(workload, config, speedups=(1.0,), budget=2, jobs=1)
    return config, best


def _router_model(tuned_file: Path) -> ModelSettings:
    s = load_settings(environ={"KVROUTER_REPLICAS": f"{MODEL}=http://h:1"}, policy_file=tuned_file)
    return s.model(MODEL)


def test_tuned_hybrid_grid_and_params_reach_the_router(tmp_path: Path) -> None:
    config, best = _tiny_tune("kimi-k3")
    expected_interval = load_profile("kimi-k3").checkpoint_interval_tokens // BLOCK
    tuned = TunedPolicy.for_cluster(MODEL, "ours", best, config)
    assert (tuned.block_size, tuned.hybrid) == (BLOCK, True)
    assert tuned.state_interval_blocks == expected_interval
    out = tmp_path / "tuned.toml"
    out.write_text(dump_tuned({MODEL: tuned}))
    assert load_tuned(out) == tuned  # the file round-trips

    model = _router_model(out)
    assert model.policy == "ours"
    routing = model.routing
    assert routing.block_size == BLOCK and routing.hybrid is True
    assert routing.state_interval_blocks == expected_interval
    params = model.policy_params
    tuned_keys = (*GRID, "tpot_target_s")
    assert {k: params[k] for k in tuned_keys} == {k: best[k] for k in tuned_keys}
    assert params["cost"] == best["cost"]


def test_a_dense_profile_writes_an_explicit_non_hybrid_grid(tmp_path: Path) -> None:
    config, best = _tiny_tune("dense-70b")
    out = tmp_path / "tuned.toml"
    out.write_text(dump_tuned({MODEL: TunedPolicy.for_cluster(MODEL, "ours", best, config)}))
    text = out.read_text()
    assert "hybrid = false" in text and "state_interval_blocks = 0" in text
    # over a main file that wrongly says hybrid, the tuned file (later) wins
    main = tmp_path / "main.toml"
    main.write_text(f'[models."{MODEL}"]\nhybrid = true\nstate_interval_blocks = 8\n')
    s = load_settings(main, environ={}, policy_file=out)
    assert s.model(MODEL).routing.hybrid is False
    assert s.model(MODEL).routing.state_interval_blocks == 0


def test_old_files_without_the_grid_still_load(tmp_path: Path) -> None:
    out = tmp_path / "tuned.toml"
    out.write_text(f'[models."{MODEL}"]\npolicy = "ours"\nblock_size = 64\n')
    tuned = load_tuned(out)
    assert tuned.hybrid is None and tuned.state_interval_blocks is None
    assert "hybrid" not in dump_tuned({MODEL: tuned})


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("hybrid = 1\n", "hybrid must be true or false"),
        ("state_interval_blocks = -1\n", "state_interval_blocks must be a non-negative integer"),
        ("state_interval_blocks = 2.0\n", "state_interval_blocks must be a non-negative integer"),
        ("hybrid = true\nstate_interval_blocks = 0\n", "hybrid model needs state_interval_blocks"),
        ("hybrid = false\nstate_interval_blocks = 4\n", "only for hybrid = true"),
    ],
)
def test_bad_grid_values_are_config_errors(tmp_path: Path, extra: str, needle: str) -> None:
    out = tmp_path / "tuned.toml"
    out.write_text(f'[models."{MODEL}"]\npolicy = "ours"\n{extra}')
    with pytest.raises(ConfigError, match=needle):
        load_tuned(out)


def test_sim_tune_command_writes_the_grid(tmp_path: Path) -> None:
    out = tmp_path / "tuned.toml"
    p = kvrouter(
        *["sim", "tune", "mooncake", "--profile", "kimi-k3"],
        *["--replicas", "2", "--kv-blocks", "4096", "--limit", "40", "--budget", "2"],
        *["--speedups", "1", "--jobs", "1", "--model", MODEL, "--out", str(out)],
    )
    assert p.returncode == 0, p.stderr
    routing = _router_model(out).routing
    assert routing.hybrid is True and routing.state_interval_blocks == 16384 // BLOCK


def test_a_tuned_model_the_configuration_does_not_serve_is_refused(tmp_path: Path) -> None:
    """``sim tune`` names its model ``sim-model`` unless given ``--model``: merged over a
    configuration serving another model, the tuned settings would apply to nothing. The
    start is refused naming the file, the model and the flag that names it."""
    tuned = tmp_path / "tuned.toml"
    tuned.write_text('[models.sim-model]\npolicy = "ours"\nblock_size = 64\n')
    env = {"KVROUTER_REPLICAS": f"{MODEL}=http://h:1"}
    with pytest.raises(ConfigError) as info:
        load_settings(environ=env, policy_file=tuned)
    assert f"{tuned}: models.sim-model: no replica or [models] table" in str(info.value)
    assert "--model" in str(info.value)
    # a model the configuration names in a [models] table only (Redis discovery) is served
    main = tmp_path / "main.toml"
    main.write_text("[models.sim-model]\n")
    assert load_settings(main, environ={}, policy_file=tuned).model("sim-model").policy == "ours"
    # where replicas are discovered in Redis the file may be the first to name a model
    # (logged, not refused): its replicas register it later
    redis = tmp_path / "redis.toml"
    redis.write_text('[server]\nredis_url = "redis://127.0.0.1:1/0"\n')
    discovered = load_settings(redis, environ={}, policy_file=tuned).models["sim-model"]
    assert discovered.routing.block_size == 64
