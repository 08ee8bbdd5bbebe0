"""Edges of the settings and command lines that were silently wrong or said too much: a
secret printed in a configuration error, a setting the loader took that start-up then
refused (or crashed on), an empty config path read as none. Each is refused at load
(``serve --check`` too) with an error naming the key and the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.cli import main
from router.core.errors import ConfigError
from router.service.config import load_settings

SECRET = "s3cr3t-987654321"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # a numeric token, unquoted: not a string, and not to be printed
        ("[server]\nadmin_token = 987654321\n", "server.admin_token: expected str"),
        ("[server]\ngrpc_token = 987654321\n", "server.grpc_token: expected str"),
        ("[server]\nrecord_key = 987654321\n", "server.record_key: expected str"),
        ("[server]\napi_keys = 987654321\n", "server.api_keys: expected str"),
        ("[server]\nredis_signing_master = 987654321\n", "server.redis_signing_master: expect"),
        ("[models.m]\nrender_api_key = 987654321\n", "models.m.render_api_key: expected str"),
    ],
)
def test_a_secret_of_the_wrong_type_is_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value) and "987654321" not in str(info.value)
    assert main(["serve", "--check", "--config", str(path)]) == 2
    assert "987654321" not in capsys.readouterr().err


def test_a_non_secret_of_the_wrong_type_is_still_shown(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = "9000"\n')
    with pytest.raises(ConfigError, match=r"server\.port: expected int, got '9000'"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    "text",
    [
        f'server:\n  api_keys: "{SECRET},other\n',  # an unterminated quote
        f"server:\n  redis_signing_master: [{SECRET}\n",
        f"server:\n  record_key: {SECRET}: x\n",
    ],
)
def test_a_yaml_syntax_error_names_the_place_not_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """PyYAML's message quotes the offending line, the secret on it included: the error
    gives the file, line, column and problem instead."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    message = str(info.value)
    assert f"cannot parse config file {path}" in message and "line 2" in message, message
    assert SECRET not in message
    assert main(["serve", "--check", "--config", str(path)]) == 2
    assert SECRET not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('redis_key_prefix = ""', "server.redis_key_prefix: empty"),
        ('redis_key_prefix = "kv{r}"', "server.redis_key_prefix: 'kv{r}' holds '{' or '}'"),
        ("redis_stream_shards = 2000", "server.redis_stream_shards: must be in [1, 1024], got"),
    ],
)
def test_redis_keys_start_up_would_refuse_are_refused_at_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, needle: str
) -> None:
    """The loader took these and ``serve --check`` said OK; start-up then stopped on the
    key schema's error, which named no setting."""
    path = tmp_path / "c.toml"
    path.write_text(f'[server]\nredis_url = "redis://127.0.0.1:1/0"\n{line}\n')
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)
    assert main(["serve", "--check", "--config", str(path)]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        # grpc's channel arguments are C ints: 2048 MiB overflowed when gRPC started
        ("grpc_max_message_mb = 2048", "server.grpc_max_message_mb: must be below 2048"),
        ("grpc_max_message_mb = 1e6", "server.grpc_max_message_mb: must be below 2048"),
        # the HTTP parser keeps 1 MiB of a head whatever the setting: 431 at 1 MiB, silently
        ("max_header_kb = 1025", "server.max_header_kb: must be at most 1024"),
        ("max_header_kb = 3e6", "server.max_header_kb: must be at most 1024"),
    ],
)
def test_limits_past_what_the_servers_take_are_refused(
    tmp_path: Path, line: str, needle: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[server]\n{line}\n")
    with pytest.raises(ConfigError) as info:
        load_settings(path, environ={})
    assert needle in str(info.value)


def test_limits_at_what_the_servers_take_load(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[server]\ngrpc_max_message_mb = 2047.5\nmax_header_kb = 1024\n")
    server = load_settings(path, environ={}).server
    assert (server.grpc_max_message_mb, server.max_header_kb) == (2047.5, 1024)


@pytest.mark.parametrize("key", ["grpc_tls_cert", "grpc_tls_key"])
def test_half_a_grpc_tls_pair_is_refused(tmp_path: Path, key: str) -> None:
    """TLS is on when both files are set: one alone served gRPC in plaintext, the bearer
    tokens of its calls readable on the wire, without a word."""
    path = tmp_path / "c.toml"
    path.write_text(f'[server]\ngrpc_port = 0\n{key} = "/etc/kvrouter/x.pem"\n')
    other = "grpc_tls_key" if key == "grpc_tls_cert" else "grpc_tls_cert"
    with pytest.raises(ConfigError, match=f"server.{other}: needed with {key}"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        ([], {"KVROUTER_CONFIG": ""}, "KVROUTER_CONFIG: empty"),
        (["--config", ""], {}, "--config: empty"),
        (["--config", ""], {"KVROUTER_CONFIG": "/nonexistent.toml"}, "--config: empty"),
    ],
)
def test_an_empty_config_path_is_no_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
    env: dict[str, str], needle: str,
) -> None:  # fmt: skip
    """``KVROUTER_CONFIG=${CONFIG}`` with CONFIG unset (or ``--config ""``) ran the router
    with no file at all: the defaults, no replicas, on 127.0.0.1:8000, and ``--check`` OK."""
    monkeypatch.delenv("KVROUTER_CONFIG", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--check", *argv]) == 2
    assert needle in capsys.readouterr().err
