"""Settings from TOML / YAML, environment and flags; validation messages; tuned-policy files."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.core.errors import ConfigError
from router.service.cli import _overrides
from router.service.config import load_settings
from router.service.state import RouterState

TOML = """
[server]
port = 9001
admin_token = "t"

[[replicas]]
url = "http://10.0.0.1:8000"
model = "kimi"
rack = "r1"
region = "eu"
dp_ranks = 2

[[replicas]]
url = "http://10.0.0.2:8000"
model = "kimi"
name = "second"

[models.kimi]
policy = "ours"
block_size = 64
hybrid = true
state_interval_blocks = 8
engine_block_size = 1024
eagle = true
speculative_ttl_s = 30.0
context_length = 1048576

[models.kimi.policy_params]
w_queue = 2.0
cost = { prefill_s_per_token = 3e-5 }

[models.kimi.busy]
max_in_flight = 128
"""


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    s = load_settings(path, environ={})
    assert s.server.port == 9001 and s.server.admin_token == "t"
    assert [r.name for r in s.replicas] == ["10.0.0.1:8000", "second"]
    assert s.replicas[0].dp_ranks == 2 and s.replicas[0].rack == "r1"
    m = s.model("kimi")
    assert m.routing.block_size == 64 and m.routing.hybrid and m.routing.state_interval_blocks == 8
    assert m.routing.alignment_blocks == 16 and m.routing.eagle
    assert m.routing.busy.max_in_flight == 128
    assert m.policy_params["w_queue"] == 2.0
    state = RouterState(s)
    assert len(state.registry.keys_for("kimi")) == 3  # two DP ranks + one
    assert state.engines["kimi"].policy.w_queue == 2.0  # type: ignore[attr-defined]
    assert not state.processors["kimi"].exact  # no tokenizer configured: approximate


def test_yaml_file_env_and_flags_precedence(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "server:\n  port: 9100\n  host: 0.0.0.0\nreplicas:\n  - {url: 'http://h:1', model: m}\n"
    )
    env = {
        "KVROUTER_SERVER__PORT": "9200",
        "KVROUTER_SERVER__DEBUG_HEADER": "true",
        "KVROUTER_ADMIN_TOKEN": "123",
    }
    s = load_settings(path, environ=env)
    assert s.server.port == 9200 and s.server.debug_header is True
    assert s.server.host == "0.0.0.0" and s.server.admin_token == "123"

    class Args:
        host = None
        port = 9300
        workers = None
        admin_token = None
        max_body_mb = None
        log_level = None
        debug_header = False
        replica = ["m=http://other:2"]
        policy = "round_robin"

    s = load_settings(
        path,
        environ=env,
        overrides=_overrides(Args()),  # type: ignore[arg-type]
        policy=Args.policy,
    )
    assert s.server.port == 9300
    assert [r.url for r in s.replicas] == ["http://other:2"]
    assert s.model("m").policy == "round_robin"


def test_serve_policy_flag_names_every_models_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve --policy`` is every model's policy: a model configured only in the file (its
    replicas discovered from Redis) gets it beside ``--replica``'s, and an unknown name is
    refused as a file's would be."""
    from router.cli import build_parser
    from router.service.cli import settings_from_args

    monkeypatch.delenv("KVROUTER_CONFIG", raising=False)
    path = tmp_path / "c.toml"
    path.write_text('[models.found]\npolicy = "dynamo"\n')
    argv = ["serve", "--config", str(path), "--replica", "given=http://h:1"]
    s = settings_from_args(build_parser().parse_args([*argv, "--policy", "round_robin"]))
    assert s.model("found").policy == "round_robin"
    assert s.model("given").policy == "round_robin"
    # without --replica: the file's models
    s = settings_from_args(
        build_parser().parse_args(["serve", "--config", str(path), "--policy", "round_robin"])
    )
    assert s.model("found").policy == "round_robin"
    # the file's parameters tune its own policy: kept for it, dropped for another
    path.write_text(
        '[models.found]\npolicy = "dynamo"\n'
        "[models.found.policy_params]\nprefill_load_scale = 2.0\n"
    )
    s = settings_from_args(build_parser().parse_args([*argv, "--policy", "dynamo"]))
    assert s.model("found").policy_params == {"prefill_load_scale": 2.0}
    s = settings_from_args(build_parser().parse_args([*argv, "--policy", "round_robin"]))
    assert s.model("found").policy == "round_robin" and s.model("found").policy_params == {}
    with pytest.raises(ConfigError, match="unknown policy 'best'"):
        settings_from_args(build_parser().parse_args([*argv, "--policy", "best"]))


def test_env_replicas_and_config_path(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\nport = 8123\n")
    s = load_settings(
        environ={"KVROUTER_CONFIG": str(path), "KVROUTER_REPLICAS": "a=http://x:1,b=http://y:2"}
    )
    assert s.server.port == 8123
    assert [(r.model, r.url) for r in s.replicas] == [("a", "http://x:1"), ("b", "http://y:2")]


def test_tuned_policy_file_is_merged(tmp_path: Path) -> None:
    tuned = tmp_path / "tuned.toml"
    tuned.write_text(
        '[models.kimi]\npolicy = "dynamo"\nblock_size = 512\n'
        "[models.kimi.policy_params]\nprefill_load_scale = 2.0\n"
    )
    s = load_settings(environ={"KVROUTER_REPLICAS": "kimi=http://x:1"}, policy_file=tuned)
    assert s.model("kimi").policy == "dynamo" and s.model("kimi").routing.block_size == 512


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[server]\nport = 'x'\n", "server.port"),
        ("[server]\nprot = 1\n", "unknown key 'prot'"),
        ("[[replicas]]\nmodel = 'm'\n", "'url' is required"),
        ("[[replicas]]\nurl = 'ftp://x'\nmodel = 'm'\n", "not an http URL"),
        ("[models.m]\npolicy = 'best'\n", "unknown policy 'best'"),
        ("[models.m]\nblock_size = 0\n", "block_size"),
        ("[models.m.policy_params]\nnope = 1\n", "policy_params"),
        ("[models.m.busy]\nmax_cats = 1\n", "models.m"),
        ("[whatever]\n", "unknown top-level"),
        ("[server]\nworkers = 0\n", "server.workers: must be >= 1, got 0"),
        ("[server]\nmax_retries = -1\n", "server.max_retries: must be >= 0, got -1"),
        ("[server]\nmax_body_mb = 0\n", "server.max_body_mb: must be > 0, got 0"),
        (
            "[server]\nredis_url = 'http://127.0.0.1:6379/0'\n",
            "server.redis_url: scheme 'http' is not one of redis://",
        ),
        (
            "[[replicas]]\nurl='http://a:1'\nmodel='m'\nname='x'\n"
            "[[replicas]]\nurl='http://b:1'\nmodel='m'\nname='x'\n",
            "duplicate",
        ),
        ("not toml at all [", "cannot parse"),
        ("[server]\nbody_memo_mb = -1\n", "server.body_memo_mb"),
        ("[server]\nbody_memo_mb = inf\n", "server.body_memo_mb"),
        ("[server]\nbody_memo_mb = nan\n", "server.body_memo_mb"),
        ("[server]\nmax_body_mb = inf\n", "server.max_body_mb"),
        ("[server]\nload_share_interval_s = -0.1\n", "server.load_share_interval_s"),
        ("[server]\nload_share_interval_s = nan\n", "server.load_share_interval_s"),
        ("[server]\napi_keys = 'k'\nredis_lost_grace_s = 0\n", "server.redis_lost_grace_s"),
        # a member would heartbeat less often than its peers drop it as silent: its load
        # would drop out of the other pods' view while its requests are still in flight
        (
            "[server]\npods_exchange_interval_s = 0.5\npods_stale_s = 1.0\n",
            "server.pods_exchange_interval_s: 0.5 is more than a quarter of server.pods_stale_s",
        ),
        ("[models.m]\nengine_block_size = 96\n", "models.m.engine_block_size: 96 is neither"),
        ("[models.m]\nengine_block_size = -64\n", "models.m.engine_block_size: expected"),
        ("[models.m]\neagle = 'yes'\n", "models.m.eagle"),
        (
            "[models.m]\nanthropic_disabled_thinking_effort = 'minimal'\n",
            "models.m.anthropic_disabled_thinking_effort: 'minimal' is not one of auto, none, "
            "low, medium, high, xhigh, max",
        ),
    ],
)
def test_errors_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)


@pytest.mark.parametrize("key", ["blok_size", "routing", "name"])
def test_model_table_unknown_key_lists_the_table_keys(tmp_path: Path, key: str) -> None:
    """A ``[models.NAME]`` key that is not a setting is refused by name, with the keys the
    table takes (routing ones such as block_size included), not the internal fields."""
    path = tmp_path / "c.toml"
    path.write_text(f"[models.m]\n{key} = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    message = str(info.value)
    assert message.startswith(f"models.m: unknown key {key!r} (known: ")
    known = message.split("(known: ", 1)[1].rstrip(")").split(", ")
    assert {"block_size", "busy", "hybrid", "policy", "slo", "tokenizer"} <= set(known)
    assert "routing" not in known and "name" not in known


def test_tokenizer_dir_without_vocabulary_names_bpe_file(tmp_path: Path) -> None:
    """A directory with a tokenizer_config.json and no vocabulary (the bundled kimi_style
    one) is refused with the setting that supplies the vocabulary."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    path = tmp_path / "c.toml"
    path.write_text(f"[models.m]\ntokenizer = '{tmp_path / 'tok'}'\n")
    with pytest.raises(ConfigError) as info:
        RouterState(load_settings(path, environ={}))
    assert "models.m: " in str(info.value) and "bpe_file" in str(info.value)


def test_anthropic_disabled_thinking_effort_reaches_the_processor(tmp_path: Path) -> None:
    """vLLM's ``--anthropic-disabled-thinking-effort`` per model: "auto" by default (as
    vLLM), from the file or the environment, handed to the model's prompt processor."""
    from router.service.prompts import build_processor

    path = tmp_path / "c.toml"
    path.write_text("[models.m]\nanthropic_disabled_thinking_effort = 'low'\n[models.n]\n")
    settings = load_settings(path, environ={})
    assert settings.model("m").anthropic_disabled_thinking_effort == "low"
    assert settings.model("n").anthropic_disabled_thinking_effort == "auto"
    assert build_processor(settings.model("m"), {}).disabled_thinking_effort == "low"
    assert build_processor(settings.model("n"), {}).disabled_thinking_effort == "auto"
    env = {"KVROUTER_MODELS__N__ANTHROPIC_DISABLED_THINKING_EFFORT": "max"}
    assert load_settings(path, environ=env).model("n").anthropic_disabled_thinking_effort == "max"


def test_missing_tokenizer_dir_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[models.m]\ntokenizer = '{tmp_path / 'nope'}'\n")
    with pytest.raises(ConfigError, match="does not exist"):
        RouterState(load_settings(path, environ={}))


def test_client_keys_with_grpc_need_no_grpc_token(tmp_path: Path) -> None:
    """The gRPC Router service takes the client keys (tests/test_grpc_auth.py), so api_keys
    with grpc_port and no grpc_token is a valid configuration (it was refused while the keys
    guarded HTTP only); a grpc_token equal to a client key is refused when the app is built."""
    from router.service.app import create_app

    path = tmp_path / "c.toml"
    path.write_text("[server]\napi_keys = 'k1,k2'\ngrpc_port = 0\n")
    settings = load_settings(path, environ={})
    assert settings.server.grpc_token is None and settings.server.api_keys == "k1,k2"
    create_app(settings)  # builds
    keys = tmp_path / "keys.txt"
    keys.write_text("k3  # a client\n")
    path.write_text(f"[server]\napi_keys_file = '{keys}'\ngrpc_port = 0\ngrpc_token = 'k3'\n")
    with pytest.raises(ConfigError, match="grpc_token: must differ from every client key"):
        create_app(load_settings(path, environ={}))


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("connect_timeout_s = -1.0", "server.connect_timeout_s: must be a finite number > 0"),
        ("request_timeout_s = 0", "server.request_timeout_s: must be a finite number > 0"),
        ("first_byte_timeout_s = nan", "server.first_byte_timeout_s: must be a finite"),
        ("health_timeout_s = 0", "server.health_timeout_s"),
        ("engine_metrics_interval_s = nan", "server.engine_metrics_interval_s"),
        ("health_interval_s = -1.0", "server.health_interval_s: must be a finite number >= 0"),
        ("unhealthy_cooldown_s = -5", "server.unhealthy_cooldown_s"),
        ("header_timeout_s = -1", "server.header_timeout_s"),
        ("shutdown_timeout_s = -30", "server.shutdown_timeout_s"),
        ("retry_after_s = -1", "server.retry_after_s: must be a finite number >= 0"),
        ("decisions_kept = -1", "server.decisions_kept"),
        ("max_prompt_tokens = -1", "server.max_prompt_tokens"),
        ("max_connections = -5", "server.max_connections"),
        ("pool_per_replica = 0", "server.pool_per_replica: must be >= 1"),
        ("redis_stream_shards = 0", "server.redis_stream_shards: must be in [1, 1024]"),
        ("outlier_consecutive_failures = 0", "server.outlier_consecutive_failures"),
        ("retry_budget_ratio = 2.0", "server.retry_budget_ratio: must be in [0, 1]"),
        ("retry_budget_ratio = -0.5", "server.retry_budget_ratio"),
        ("outlier_max_ejected_share = 1.5", "server.outlier_max_ejected_share: must be in"),
        ("grpc_port = 70000", "server.grpc_port: 70000 is not a TCP port"),
        ("grpc_port = -1", "server.grpc_port"),
        ("log_level = 'verbose'", "server.log_level: 'verbose' is not one of"),
        # refused only when the app was built, without the key (nan), with a traceback (inf)
        ("max_header_kb = inf", "server.max_header_kb: must be a finite number >= 0"),
        ("max_header_kb = nan", "server.max_header_kb: must be a finite number >= 0"),
        ("max_header_kb = -1.0", "server.max_header_kb: must be a finite number >= 0"),
        ("max_concurrent_per_key = -1", "server.max_concurrent_per_key: must be a finite"),
    ],
)
def test_out_of_range_server_settings_name_the_key(tmp_path: Path, line: str, needle: str) -> None:
    """A negative timeout, a share above 1, a port out of range or an unknown log level is
    refused at load (``serve --check`` too), naming the key, not carried into the service."""
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_pd_margin_is_refused(tmp_path: Path, value: str) -> None:
    """``margin_s`` may be negative (favouring the remote prefill) but not NaN, which made
    every comparison false: P/D configured and silently never used (inf alike; -inf: always)."""
    path = tmp_path / "c.toml"
    path.write_text(f'[models.m.pd]\nmode = "auto"\nmargin_s = {value}\n')
    with pytest.raises(ConfigError, match=r"models\.m\.pd\.margin_s: must be a finite number"):
        load_settings(path, environ={})


def test_admission_and_pd_tables_of_the_right_types_load(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[models.m.admission]\nenabled = true\nmax_queue = 10\nheadroom = [1, 0.5, 0.3]\n"
        'max_hold_s = 1\n[models.m.pd]\nmode = "auto"\nmargin_s = -0.5\n'
        "min_uncached_tokens = 2048\nrack_penalty_s = 0\n"
    )
    model = load_settings(path, environ={}).models["m"]
    assert model.admission is not None and model.admission.max_queue == 10
    assert model.admission.max_hold_s == 1.0 and model.admission.headroom == (1.0, 0.5, 0.3)
    assert model.pd is not None and model.pd.knobs.margin_s == -0.5


def test_in_range_edge_values_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[server]\nhealth_interval_s = 0\nheader_timeout_s = 0\nretry_budget_ratio = 0\n"
        "outlier_max_ejected_share = 1\ngrpc_port = 0\nlog_level = 'DEBUG'\nretry_after_s = 0\n"
    )
    s = load_settings(path, environ={})
    assert s.server.grpc_port == 0 and s.server.log_level == "DEBUG"


def test_serve_check_reports_what_the_start_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --check`` validates what ``serve`` would: a model whose tokenizer directory is
    missing fails the check (exit 2) with the model's key, not "configuration OK"."""
    from router.cli import build_parser

    path = tmp_path / "c.toml"
    path.write_text(f"[models.m]\ntokenizer = '{tmp_path / 'nope'}'\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--check"])
    assert args.handler(args) == 2
    err = capsys.readouterr().err
    assert "configuration error: models.m: tokenizer directory" in err and "does not exist" in err


def test_serve_check_counts_configured_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis mode configures models and leaves replicas to discovery: ``--check`` counts the
    models the file names, not only those of its replicas."""
    from router.cli import build_parser

    path = tmp_path / "c.toml"
    path.write_text("[models.m]\n[[replicas]]\nurl = 'http://127.0.0.1:9'\nmodel = 'n'\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--check"])
    assert args.handler(args) == 0
    assert capsys.readouterr().out == "configuration OK: 1 replica(s), 2 model(s)\n"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[models.m]\nspeculative_ttl_s = -1.0\n", "models.m.speculative_ttl_s: must be"),
        ("[models.m]\nsession_ttl_s = -1.0\n", "models.m.session_ttl_s: must be"),
        ("[models.m]\ncache_mb = -1\n", "models.m.cache_mb: must be"),
        ("[models.m]\nchars_per_token = 0\n", "models.m.chars_per_token: must be"),
        ("[models.m.busy]\nmax_kv_usage = 1.5\n", "models.m.busy.max_kv_usage: must be in"),
        ("[models.m.busy]\nmax_in_flight = -1\n", "models.m.busy.max_in_flight: must be"),
        ("[models.m.busy]\nmax_queued_prefill_tokens = -1\n", "busy.max_queued_prefill_tokens"),
        # admission and P/D knobs: a wrong type names the key, not only the table
        ('[models.m.admission]\nmax_queue = "10"\n', "models.m.admission.max_queue: expected"),
        ("[models.m.admission]\nmax_queue = 1.5\n", "models.m.admission.max_queue: expected"),
        ("[models.m.admission]\nscan = true\n", "models.m.admission.scan: expected"),
        ('[models.m.admission]\nheadroom = [1, "x", 1]\n', "models.m.admission.headroom: expected"),
        ("[models.m.admission]\nstall_share = 0.5\n", "models.m.admission.stall_share: expected"),
        ("[models.m.admission]\nheadroom = [1, 1]\n", "models.m.admission.headroom: expected"),
        ('[models.m.pd]\nmin_uncached_tokens = "4096"\n', "models.m.pd.min_uncached_tokens: exp"),
        ("[models.m.pd]\nrack_penalty_s = -1.0\n", "models.m.pd.rack_penalty_s: must be"),
        ("[models.m.pd]\nnetwork_latency_s = nan\n", "models.m.pd.network_latency_s: must be"),
        ("[models.m.pd]\nmode = 1\n", "models.m.pd.mode: expected"),
        # the policy's cost: refused when read, not met by every request
        ("[models.m.policy_params]\ntpot_target_s = 0.0\n", "policy_params: tpot_target_s"),
        ("[models.m.policy_params.cost]\nchunk_tokens = 0\n", "policy_params: chunk_tokens"),
    ],
)
def test_out_of_range_model_settings_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "line",
    [
        'admin_token = ""',
        'api_keys_file = ""',
        'grpc_token = ""',
        'host = ""',
        'grpc_host = ""',
        'flex_keys = ""',
        'record_key = ""',
    ],
)
def test_an_empty_server_string_is_refused(tmp_path: Path, line: str) -> None:
    """A ``[server]`` string set to "" was read as a value: an empty ``api_keys_file``
    or ``grpc_token`` left the router or its gRPC index open to all, an empty ``host``
    bound every interface. Unset is how a setting is left out."""
    key = line.split()[0]
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\n{line}\n")
    with pytest.raises(ConfigError, match=f"server.{key}: empty"):
        load_settings(path, environ={})


@pytest.mark.parametrize("key", ["zmq", "zmq_replay", "rack", "region"])
def test_an_empty_replica_string_is_refused(tmp_path: Path, key: str) -> None:
    """``zmq = ""`` was read as no event endpoint (the replica's events silently not
    followed), a rack or region "" as one of that name."""
    path = tmp_path / "c.toml"
    path.write_text(f'[[replicas]]\nurl = "http://10.0.0.1:8000"\nmodel = "m"\n{key} = ""\n')
    with pytest.raises(ConfigError, match=f"replicas\\[0\\].{key}: empty"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        # the deadline is min(max(min_s, factor x predicted), timeout_s): min_s never applied
        (
            "first_byte_min_s = 700.0",
            "server.first_byte_min_s: 700 is more than server.first_byte_timeout_s (600)",
        ),
        # the n-th ejection lasts min(n x base, max): every one max, the growth gone
        (
            "outlier_base_ejection_s = 90.0",
            "server.outlier_base_ejection_s: 90 is more than server.outlier_max_ejection_s (60)",
        ),
        # a key is priority if listed there, else flex: its flex listing never applied
        (
            'priority_keys = "k1,k2"\nflex_keys = "k3, k2"',
            "server.flex_keys: 1 key is in server.priority_keys too",
        ),
        # probes are cut at 4 x the interval (a sweep waits for its slowest probe)
        (
            "health_interval_s = 0.5\nhealth_timeout_s = 3.0",
            "server.health_timeout_s: 3 is more than 4 x server.health_interval_s (0.5)",
        ),
    ],
)
def test_contradictory_server_settings_are_refused(tmp_path: Path, lines: str, needle: str) -> None:
    """A lower bound above its upper bound, or a key in two service classes: one setting
    would silently not apply."""
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\n{lines}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)
    assert "k2" not in str(info.value)  # (client keys are never shown)


def test_bounds_that_meet_and_a_slow_health_probe_load(tmp_path: Path) -> None:
    """Equal bounds are a fixed deadline and ejection; a probe timeout above the interval
    (within 4 x) only delays the next sweep, which starts when the slow one ends; with
    probes off (interval 0) the timeout is not read."""
    path = tmp_path / "c.toml"
    path.write_text(
        "[server]\nfirst_byte_min_s = 600.0\noutlier_base_ejection_s = 60.0\n"
        "health_interval_s = 0.5\nhealth_timeout_s = 2.0\n"
    )
    assert load_settings(path, environ={}).server.health_timeout_s == 2.0
    path.write_text("[server]\nhealth_interval_s = 0\nhealth_timeout_s = 30.0\n")
    assert load_settings(path, environ={}).server.health_timeout_s == 30.0


@pytest.mark.parametrize(
    "key", ["tokenizer", "bpe_file", "pattern", "chat_template", "render_api_key", "render_url"]
)
def test_an_empty_model_string_is_refused(tmp_path: Path, key: str) -> None:
    """``tokenizer = ""`` read the working directory as the model's, ``chat_template = ""``
    and ``render_api_key = ""`` were values too: refused as the [server] strings are."""
    path = tmp_path / "c.toml"
    path.write_text(f'[models.m]\n{key} = ""\n')
    with pytest.raises(ConfigError, match=f"^models.m.{key}: empty; remove the setting"):
        load_settings(path, environ={})
