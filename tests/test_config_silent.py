"""Settings that would be silently wrong: a value of the wrong type taken as another
(``"false"`` as true), a section that is not a table read as empty, an environment
override naming a model the configuration does not have. Each is a ConfigError naming
the key (or the variable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.core.errors import ConfigError
from router.service.config import build_settings, load_settings


@pytest.mark.parametrize(
    ("policy", "params", "needle"),
    [
        ("vllm_kv_aware", {"speculates": "false"}, "models.m.policy_params.speculates"),
        ("vllm_kv_aware", {"max_sessions": 1.5}, "models.m.policy_params.max_sessions"),
        ("vllm_kv_aware", {"max_sessions": "7"}, "models.m.policy_params.max_sessions"),
        ("sglang", {"balance_abs_threshold": 2.5}, "balance_abs_threshold"),
        ("dynamo", {"temperature": "hot"}, "models.m.policy_params.temperature"),
        ("dynamo", {"temperature": True}, "models.m.policy_params.temperature"),
        ("ours", {"uses_session_hints": "no"}, "models.m.policy_params.uses_session_hints"),
        ("ours", {"cost": 1}, "models.m.policy_params.cost"),
        ("ours", {"cost": {"prefill_s_per_token": "1"}}, "policy_params.cost"),
    ],
)
def test_policy_params_of_the_wrong_type_are_refused(
    policy: str, params: dict[str, Any], needle: str
) -> None:
    """A policy parameter is of its declared type: a string "false" for a boolean would be
    true, a float for an integer count or a string for a weight would reach the routing."""
    with pytest.raises(ConfigError) as info:
        build_settings({"models": {"m": {"policy": policy, "policy_params": params}}})
    assert needle in str(info.value)


def test_policy_params_of_the_right_type_still_load() -> None:
    settings = build_settings(
        {
            "models": {
                "m": {"policy": "vllm_kv_aware", "policy_params": {"speculates": False}},
                "n": {"policy": "dynamo", "policy_params": {"temperature": 1}},
            }
        }
    )
    assert settings.models["m"].policy_params == {"speculates": False}
    assert settings.models["n"].policy_params == {"temperature": 1}


def test_an_environment_model_the_configuration_does_not_name_is_refused(
    tmp_path: Path,
) -> None:
    """Names after KVROUTER_ are lower-cased: KVROUTER_MODELS__KIMI__POLICY meant for the
    file's model "Kimi" would configure a new model "kimi" no replica serves, and leave
    "Kimi" as it was. Refused, naming the variable and the models served."""
    path = tmp_path / "c.toml"
    path.write_text('[[replicas]]\nurl = "http://h:1"\nmodel = "Kimi"\n')
    env = {"KVROUTER_MODELS__KIMI__POLICY": "least_loaded"}
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ=env)
    message = str(info.value)
    assert "KVROUTER_MODELS__KIMI__POLICY" in message and "Kimi" in message
    # the model served by a replica of the environment, a flag or the file: taken
    served = {**env, "KVROUTER_REPLICAS": "kimi=http://h:1"}
    assert load_settings(path, environ=served).model("kimi").policy == "least_loaded"
    flagged = load_settings(
        path, environ=env, overrides={"replicas": [{"model": "kimi", "url": "http://h:2"}]}
    )
    assert flagged.model("kimi").policy == "least_loaded"
    path.write_text(path.read_text() + "[models.kimi]\nblock_size = 32\n")
    assert load_settings(path, environ=env).model("kimi").policy == "least_loaded"


def test_an_environment_model_is_kept_where_replicas_are_discovered(tmp_path: Path) -> None:
    """With server.redis_url replicas register their models: the environment may be the
    first to name one (logged, kept); with no replica or model anywhere else the environment
    is the whole configuration."""
    path = tmp_path / "c.toml"
    path.write_text(
        '[server]\nredis_url = "redis://127.0.0.1:1/0"\n'
        '[[replicas]]\nurl = "http://h:1"\nmodel = "Kimi"\n'
    )
    env = {"KVROUTER_MODELS__KIMI__POLICY": "least_loaded"}
    assert load_settings(path, environ=env).model("kimi").policy == "least_loaded"
    assert load_settings(environ=env).model("kimi").policy == "least_loaded"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"server": []}, "server: must be a table"),
        ({"server": False}, "server: must be a table"),
        ({"server": ""}, "server: must be a table"),
        ({"replicas": {}}, "replicas: must be an array"),
        ({"replicas": ""}, "replicas: must be an array"),
        ({"models": []}, "models: must be a table"),
        ({"models": {"m": {"busy": []}}}, "models.m.busy: must be a table"),
        ({"models": {"m": {"slo": ""}}}, "models.m.slo: must be a table"),
        ({"models": {"m": {"policy_params": []}}}, "models.m.policy_params: must be a table"),
        ({"models": {"m": {"policy_params": False}}}, "models.m.policy_params: must be a table"),
    ],
)
def test_an_empty_value_of_the_wrong_shape_is_no_empty_table(
    data: dict[str, Any], needle: str
) -> None:
    """``server = false``, ``replicas: {}`` (YAML) or ``busy = []`` is a mistake, not an
    empty table: refused like any other value of the wrong shape (an empty YAML key, None,
    is still an empty table)."""
    with pytest.raises(ConfigError) as info:
        build_settings(data)
    assert needle in str(info.value)
    empty = {"server": None, "replicas": None, "models": {"m": {"busy": None, "slo": None}}}
    assert build_settings(empty).replicas == ()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nport = 9001\n", "[server]"),
        ('[[replicas]]\nurl = "http://h:2"\nmodel = "m"\n', "[replicas]"),
        ('[models.m]\npolicy = "ours"\ncontext_length = 8\n', "models.m: 'context_length'"),
        ('[models.m]\npolicy = "ours"\n[models.m.busy]\nmax_in_flight = 1\n', "'busy'"),
        ('[models.m]\npolicy = "ours"\ntokenizer = "/t"\n', "'tokenizer'"),
        ("# nothing tuned\n", "at least one [models.NAME]"),
    ],
)
def test_a_policy_file_holds_only_tuned_settings(tmp_path: Path, text: str, needle: str) -> None:
    """``--policy-file`` reads the tuned settings of ``[models.NAME]`` (policy,
    policy_params, block_size, hybrid, state_interval_blocks) over the main file: a
    [server] table there was ignored without a word, another model key silently overrode
    the main file's. Both are refused, naming the file and the key."""
    main = tmp_path / "main.toml"
    main.write_text('[[replicas]]\nurl = "http://h:1"\nmodel = "m"\n')
    tuned = tmp_path / "tuned.toml"
    tuned.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(main, environ={}, policy_file=tuned)
    message = str(info.value)
    assert str(tuned) in message and needle in message


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("server:\n  pods_exchange: off\n", "server.pods_exchange: expected str, got False (YAML"),
        ("server:\n  log_level: on\n", "quote it"),
        ("server:\n  max_body_mb: 1e3\n", "server.max_body_mb: expected float, got '1e3' (YAML"),
        ("server:\n  port: 8e3\n", "8e3 as text: write 8000"),
    ],
)
def test_yaml_traps_are_explained(tmp_path: Path, text: str, needle: str) -> None:
    """YAML 1.1 reads ``off``/``on``/``no``/``yes`` as booleans and ``1e3`` (no dot) as
    text: refused as of the wrong type (never coerced), with the way to write it."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)


def test_a_negative_num_reserved_is_refused() -> None:
    """A negative count of reserved special tokens appended nothing (range(base, base - 1)):
    the tokenizer silently lacked the tokens the operator meant to add."""
    with pytest.raises(ConfigError) as info:
        build_settings({"models": {"m": {"num_reserved": -1}}})
    assert "models.m.num_reserved: must be >= 0" in str(info.value)
    assert build_settings({"models": {"m": {"num_reserved": 0}}}).models["m"].num_reserved == 0


def test_an_empty_replica_name_is_refused() -> None:
    """``name = ""`` was replaced by host:port without a word; omitting the key does that."""
    with pytest.raises(ConfigError) as info:
        build_settings({"replicas": [{"url": "http://h:1", "model": "m", "name": ""}]})
    assert "replicas[0].name: must be a non-empty string" in str(info.value)
    with pytest.raises(ConfigError) as info:  # YAML's name: no
        build_settings({"replicas": [{"url": "http://h:1", "model": "m", "name": False}]})
    assert "replicas[0].name: expected str, got False" in str(info.value)
    assert build_settings({"replicas": [{"url": "http://h:1", "model": "m"}]}).replicas[0].name


def test_a_flat_ttft_target_beside_a_tier_table_is_refused() -> None:
    """``ttft_s`` replaced ``ttft_tiers`` without a word: an operator who wrote both (or set
    one through the environment over a file holding the other) got one of them silently."""
    slo = {"ttft_tiers": "8192:1,*:10", "ttft_s": 3.0}
    with pytest.raises(ConfigError) as info:
        build_settings({"models": {"m": {"slo": slo}}})
    assert "models.m.slo" in str(info.value)
    assert "ttft_s and ttft_tiers" in str(info.value)
    flat = build_settings({"models": {"m": {"slo": {"ttft_s": 3.0}}}}).models["m"].slo
    assert flat.ttft_target_s(100_000) == 3.0


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_render_timeout_that_never_ends_is_refused(value: float) -> None:
    """An infinite timeout would let a hung render route hold a request for ever."""
    with pytest.raises(ConfigError, match=r"models\.m\.render_timeout_s"):
        build_settings({"models": {"m": {"render_timeout_s": value}}})


def test_one_engine_listed_twice_is_named_in_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The same url and model under two names is one engine taking two replicas' share of
    the traffic; the same url serving another model (a LoRA adapter) is not."""
    reps = [
        {"name": "a", "url": "http://10.0.0.1:8000", "model": "m"},
        {"name": "b", "url": "http://10.0.0.1:8000/", "model": "m"},
        {"name": "c", "url": "http://10.0.0.1:8000", "model": "m-lora"},
        {"name": "d", "url": "http://10.0.0.2:8000", "model": "m"},
    ]
    with caplog.at_level("WARNING", logger="kvrouter.config"):
        build_settings({"replicas": reps})
    warned = [r.getMessage() for r in caplog.records if "same engine" in r.getMessage()]
    assert len(warned) == 1
    assert "'a' and 'b'" in warned[0]
