"""``KVROUTER_*`` environment variables: which are config overrides, and how their values are
typed (by the declared type of the setting they target, not by how the text looks)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from router.core.errors import ConfigError
from router.service.config import load_settings
from router.service.config_env import env_overrides
from router.service.settings import Settings

REPLICA = {"KVROUTER_REPLICAS": "m=http://127.0.0.1:9"}

# Read by other components (router/cli.py, router/publisher/cli.py), not by the settings tree.
FOREIGN = {
    "KVROUTER_DEBUG": "1",
    "KVROUTER_PUBLISHER__REDIS": "redis://127.0.0.1:6379/0",
    "KVROUTER_PUBLISHER__SIGNING_KEY": "00" * 32,
    # the publisher's names before the convention was unified (still read by it)
    "KVROUTER_REDIS_URL": "redis://127.0.0.1:6379/0",
    "KVROUTER_SIGNING_KEY": "00" * 32,
    "KVROUTER_SIGNING_MASTER": "11" * 32,
}


@pytest.mark.parametrize(("name", "value"), sorted(FOREIGN.items()))
def test_other_components_variables_are_not_config(name: str, value: str) -> None:
    s = load_settings(environ={**REPLICA, name: value})
    assert [r.url for r in s.replicas] == ["http://127.0.0.1:9"]
    assert s.server.redis_url is None and s.server.redis_signing_master is None


def test_only_exact_near_misses_are_errors() -> None:
    """``KVROUTER_SERVER_<not a server key>`` may be another component's: ignored."""
    assert env_overrides({"KVROUTER_SERVER_NAME": "x", "KVROUTER_SERVERLESS": "1"}) == {}


def test_serve_check_starts_with_kvrouter_debug_set() -> None:
    env = {**os.environ, **FOREIGN}
    env.pop("KVROUTER_CONFIG", None)
    p = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--replica", "m=http://127.0.0.1:9"]
        + ["--check"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert "configuration OK" in p.stdout


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("KVROUTER_SERVER__PORTT", "unknown key 'portt'"),
        ("KVROUTER_MODELS__KIMI__POLICYY", "unknown key 'policyy'"),
        ("KVROUTER_MODELS__KIMI__BUSY__MAX_CATS", "unknown key 'max_cats'"),
        ("KVROUTER_SERVER__PORT__X", "not a table"),
        ("KVROUTER_SERVER", "KVROUTER_SERVER__<KEY>"),
        ("KVROUTER_MODELS__KIMI", "KVROUTER_MODELS__<NAME>__<KEY>"),
        ("KVROUTER_MODELS__KIMI__BUSY", "a table"),
        ("KVROUTER_REPLICAS__URL", "KVROUTER_REPLICAS"),
        ("KVROUTER_SERVER_PORT", "KVROUTER_SERVER__PORT"),  # one underscore: a near miss
        ("KVROUTER_MODELS_KIMI__POLICY", "KVROUTER_MODELS__<NAME>__<KEY>"),
    ],
)
def test_misspelt_key_in_a_known_section_names_the_variable(name: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        env_overrides({name: "1"})
    assert name in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize(
    ("name", "value", "get"),
    [
        ("KVROUTER_SERVER__API_KEYS", "12345", lambda s: s.server.api_keys),
        ("KVROUTER_SERVER__GRPC_TOKEN", "true", lambda s: s.server.grpc_token),
        ("KVROUTER_SERVER__POD_NAME", "0", lambda s: s.server.pod_name),
        ("KVROUTER_SERVER__HOST", "1.5", lambda s: s.server.host),
        ("KVROUTER_SERVER__REDIS_KEY_PREFIX", "[1]", lambda s: s.server.redis_key_prefix),
        ("KVROUTER_ADMIN_TOKEN", "false", lambda s: s.server.admin_token),
        ("KVROUTER_MODELS__M__TOKENIZER", "2024", lambda s: s.model("m").tokenizer),
        ("KVROUTER_SERVER__GRPC_TOKEN", '"quoted"', lambda s: s.server.grpc_token),
    ],
)
def test_string_settings_keep_the_raw_text(
    name: str, value: str, get: Callable[[Settings], object]
) -> None:
    s = load_settings(environ={name: value})
    assert get(s) == value


def test_typed_settings_parse_by_field_type() -> None:
    s = load_settings(
        environ={
            "KVROUTER_SERVER__PORT": "9001",
            "KVROUTER_SERVER__MAX_BODY_MB": "8",
            "KVROUTER_SERVER__DEBUG_HEADER": "TRUE",
            "KVROUTER_SERVER__DISCOVER_REPLICAS": "false",
            "KVROUTER_SERVER__GRPC_PORT": "0",
            "KVROUTER_MODELS__M__BLOCK_SIZE": "32",
            "KVROUTER_MODELS__M__HYBRID": "1",
            "KVROUTER_MODELS__M__STATE_INTERVAL_BLOCKS": "4",
            "KVROUTER_MODELS__M__CONTEXT_LENGTH": "4096",
            "KVROUTER_MODELS__M__BUSY__MAX_KV_USAGE": "0.9",
            "KVROUTER_MODELS__M__POLICY_PARAMS__W_QUEUE": "2.5",
            "KVROUTER_MODELS__M__POLICY_PARAMS__COST__CHUNK_TOKENS": "4096",
        }
    )
    assert s.server.port == 9001 and s.server.max_body_mb == 8.0
    assert isinstance(s.server.max_body_mb, float)
    assert s.server.debug_header is True and s.server.discover_replicas is False
    assert s.server.grpc_port == 0
    m = s.model("m")
    assert m.routing.block_size == 32 and m.routing.hybrid is True
    assert m.routing.state_interval_blocks == 4 and m.context_length == 4096
    assert m.routing.busy.max_kv_usage == 0.9
    assert m.policy_params["w_queue"] == 2.5
    assert m.policy_params["cost"] == {"chunk_tokens": 4096}


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("KVROUTER_SERVER__PORT", "80x", "an integer"),
        ("KVROUTER_SERVER__PORT", "1.0", "an integer"),
        ("KVROUTER_SERVER__PORT", "true", "an integer"),
        ("KVROUTER_SERVER__MAX_BODY_MB", "lots", "a number"),
        ("KVROUTER_SERVER__DEBUG_HEADER", "maybe", "true or false"),
        ("KVROUTER_MODELS__M__CONTEXT_LENGTH", "", "an integer"),
        ("KVROUTER_MODELS__M__BUSY__MAX_IN_FLIGHT", "many", "an integer"),
    ],
)
def test_unparsable_values_name_the_variable_and_the_type(
    name: str, value: str, needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ={name: value})
    assert name in str(info.value) and needle in str(info.value)
    assert repr(value) in str(info.value)


def test_admin_token_spellings_must_agree() -> None:
    same = {"KVROUTER_ADMIN_TOKEN": "t", "KVROUTER_SERVER__ADMIN_TOKEN": "t"}
    assert load_settings(environ=same).server.admin_token == "t"
    with pytest.raises(ConfigError, match="KVROUTER_ADMIN_TOKEN"):
        load_settings(environ={**same, "KVROUTER_SERVER__ADMIN_TOKEN": "u"})


def test_field_types_a_compiled_core_loses_match_the_source() -> None:
    """``LOST_WHEN_COMPILED`` repeats annotations of router/core dataclasses (a compiled
    build reports them as ``type``): they must say what the source says."""
    import ast
    import inspect

    import pytest

    from router.core import routing_settings
    from router.service.settings import LOST_WHEN_COMPILED

    if not str(routing_settings.__file__).endswith(".py"):
        pytest.skip("router/core is compiled: checked by the pure-Python run")
    tree = ast.parse(inspect.getsource(routing_settings))
    declared = {
        (cls.name, stmt.target.id): ast.unparse(stmt.annotation)
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for stmt in cls.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }
    for key, kind in LOST_WHEN_COMPILED.items():
        assert declared[key] == kind, key


@pytest.mark.parametrize(
    "name",
    [
        "KVROUTER_REPLICAS",
        "KVROUTER_ADMIN_TOKEN",
        "KVROUTER_SERVER__API_KEYS_FILE",
        "KVROUTER_SERVER__GRPC_TOKEN",
        "KVROUTER_SERVER__HOST",
        "KVROUTER_SERVER__PRIORITY_KEYS",
        "KVROUTER_SERVER__RECORD_PATH",
        "KVROUTER_MODELS__M__TOKENIZER",
    ],
)
def test_an_empty_variable_is_an_error_not_an_empty_setting(name: str) -> None:
    """``KVROUTER_X=${SECRET}`` with the secret unset sets ``X`` to "": the router read it
    as a setting, and ran with no replicas (the file's replaced by none), without its
    admin token, open to every client (no keys file), its gRPC index open to every writer
    (no token), listening on every interface (``host`` "" binds them all), every key
    allowed priority, or a tokenizer in the working directory. Now refused, naming the
    variable."""
    with pytest.raises(ConfigError, match=f"{name}: empty"):
        load_settings(environ={"KVROUTER_REPLICAS": "m=http://127.0.0.1:9", name: ""})
