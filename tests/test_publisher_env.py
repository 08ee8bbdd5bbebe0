"""``kvrouter publish`` flags from ``KVROUTER_PUBLISHER__<FLAG>`` (router/publisher/env.py),
the router's environment convention; the signing-key command reads the router's variable."""

from __future__ import annotations

import argparse
import logging

import pytest

from router.cli import build_parser, main
from router.publisher.cli import validate
from router.publisher.env import check
from router.store.codec import replica_signing_key


def _parse(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], argv: list[str]
) -> argparse.Namespace:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["publish", *argv])
    check(args, env)
    return args


def test_every_flag_from_the_environment_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "KVROUTER_PUBLISHER__REPLICA": "r0",
        "KVROUTER_PUBLISHER__MODEL": "m",
        "KVROUTER_PUBLISHER__ZMQ": "tcp://127.0.0.1:5557, tcp://127.0.0.1:6557",
        "KVROUTER_PUBLISHER__DP_RANKS": "0,1",
        "KVROUTER_PUBLISHER__BLOCK_SIZE": "32",
        "KVROUTER_PUBLISHER__ENGINE_METRICS": "http://127.0.0.1:8000/metrics",
        "KVROUTER_PUBLISHER__REDIS": "redis://redis:6379/0",
    }
    args = _parse(monkeypatch, env, [])
    assert (args.replica, args.model, args.block_size) == ("r0", "m", 32)
    assert args.zmq == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:6557"]
    assert args.dp_ranks == [0, 1] and args.redis == "redis://redis:6379/0"
    assert args.engine_metrics == "http://127.0.0.1:8000/metrics"
    args = _parse(monkeypatch, env, ["--block-size", "16", "--zmq", "tcp://127.0.0.1:7557"])
    assert args.block_size == 16 and args.zmq == ["tcp://127.0.0.1:7557"]


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("KVROUTER_PUBLISHER__BLOCK_SIZE", "big", "--block-size expects int, got 'big'"),
        ("KVROUTER_PUBLISHER__DP_RANKS", "0,x", "--dp-ranks expects int"),
        ("KVROUTER_PUBLISHER__REDIS_URL", "redis://h/0", "not a flag of kvrouter publish"),
    ],
)
def test_bad_variables_stop_the_command_naming_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str,
    needle: str,
) -> None:  # fmt: skip
    monkeypatch.setenv(name, value)
    assert main(["publish", "--replica", "r0", "--model", "m", "--zmq", "tcp://h:1"]) == 2
    err = capsys.readouterr().err
    assert name in err and needle in err


def test_earlier_names_are_read_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"KVROUTER_REDIS_URL": "redis://old:6379/0", "KVROUTER_SIGNING_KEY": "ab" * 16}
    with caplog.at_level(logging.WARNING, logger="kvrouter.publish"):
        args = _parse(monkeypatch, env, ["--replica", "r0", "--model", "m"])
    assert args.redis == "redis://old:6379/0" and args.signing_key == "ab" * 16
    assert "KVROUTER_PUBLISHER__REDIS" in caplog.text
    assert "KVROUTER_PUBLISHER__SIGNING_KEY" in caplog.text


def test_signing_key_reads_the_routers_master_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    master = bytes(range(32))
    monkeypatch.setenv("KVROUTER_SERVER__REDIS_SIGNING_MASTER", master.hex())
    assert main(["signing-key", "--replica", "a"]) == 0
    assert bytes.fromhex(capsys.readouterr().out.strip()) == replica_signing_key(master, "a")


@pytest.mark.parametrize("master", ["zz" * 16, "ab" * 8 + "a", "ab" * 15])
def test_signing_key_refuses_a_master_the_routers_refuse(
    master: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not hex, or shorter than the 16 bytes server.redis_signing_master needs: refused
    naming --master, not with fromhex()'s words nor a key the routers could not verify."""
    assert main(["signing-key", "--replica", "a", "--master", master]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--master: not a hex secret of 16 bytes or more" in captured.err


def test_an_endpoint_it_cannot_subscribe_to_stops_publish_and_deregisters(
    redis_url: str, key_prefix: str
) -> None:
    import redis

    from tests.inprocess import kvrouter

    out = kvrouter(
        "publish", "--replica", "r1", "--model", "m", "--zmq", "ipc:///tmp/" + "x" * 300,
        "--redis", redis_url, "--key-prefix", key_prefix,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "cannot subscribe to the engine's KV events" in out.stderr
    assert "File name too long" in out.stderr  # ZMQ's own reason
    client = redis.Redis.from_url(redis_url)
    assert not [k for k in client.scan_iter(f"{key_prefix}*") if b"r1" in k]  # deregistered


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--heartbeat", "0"], "--heartbeat must be > 0"),
        (["--heartbeat", "-1"], "--heartbeat must be > 0"),
        (["--heartbeat", "10", "--lease-ttl", "10"], "shorter than --lease-ttl"),
        (["--lease-ttl", "0"], "--lease-ttl must be > 0"),
        (["--flush-interval", "-0.5"], "--flush-interval must be > 0"),
        # inf: small batches never flushed (a silent stall); a lease Redis cannot take
        (["--flush-interval", "inf"], "--flush-interval must be > 0 seconds and finite"),
        (["--lease-ttl", "inf", "--heartbeat", "1"], "--lease-ttl must be > 0 seconds and"),
        (["--metrics-port", "70000"], "--metrics-port must be in 0..65535"),
        (["--redis", "http://127.0.0.1:1/0"], "--redis: scheme 'http' is not one of redis://"),
        (["--block-size", "0"], "--block-size must be positive"),
        (["--zmq", "foo"], "endpoint 'foo': expected tcp://HOST:PORT"),
    ],
)
def test_timing_flags_that_cannot_work_stop_the_command(flags: list[str], needle: str) -> None:
    """A heartbeat not shorter than the lease lets the lease lapse between renewals (routers
    drop the replica, it registers again, over and over); a zero or negative interval spins
    against Redis. Refused before anything starts, with the flag named, not a traceback."""
    import subprocess
    import sys

    from tests.ports import free_port

    argv = ["publish", "--replica", "r0", "--model", "m", "--zmq", "tcp://127.0.0.1:1"]
    argv += ["--redis", f"redis://127.0.0.1:{free_port()}/0", *flags]  # nothing listens
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_metrics_port_taken_stops_the_command_before_it_registers(
    redis_url: str, key_prefix: str
) -> None:
    """A ``--metrics-port`` another process holds: a clear error and exit 2 before the
    replica is registered (it was registered first, and left to its lease)."""
    import socket
    import subprocess
    import sys

    import redis

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["publish", "--replica", "r0", "--model", "m", "--zmq", "tcp://127.0.0.1:1"]
        argv += ["--redis", redis_url, "--key-prefix", key_prefix, "--metrics-port", str(port)]
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=30
        )
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.smembers(f"{key_prefix}:replicas") == set()
    finally:
        client.close()
    assert out.returncode == 2 and f"--metrics-port {port}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("env", "flags"),
    [
        ({}, ["--zmq", "auto", "--dp-ranks", "0", "1"]),
        ({"KVROUTER_PUBLISHER__DP_RANKS": "0,1"}, ["--zmq", "auto"]),
        ({"KVROUTER_PUBLISHER__ZMQ": "auto"}, ["--dp-ranks", "0"]),
        ({"KVROUTER_PUBLISHER__ZMQ": "auto", "KVROUTER_PUBLISHER__DP_RANKS": "0"}, []),
    ],
    ids=["flags", "ranks-from-env", "auto-from-env", "both-from-env"],
)
def test_ranks_given_with_zmq_auto_stop_the_command(env: dict[str, str], flags: list[str]) -> None:
    """``--zmq auto`` registers the ranks the engine names: ``--dp-ranks`` given as well
    (even ``0``, the default's value; or from the environment) was silently ignored, the
    command waiting for the engine. It is refused before anything starts, naming both."""
    import os
    import subprocess
    import sys

    from tests.ports import free_port

    argv = ["publish", "--replica", "r0", "--model", "m", *flags]
    argv += ["--url", f"http://127.0.0.1:{free_port()}"]  # nothing listens: never answers
    argv += ["--redis", f"redis://127.0.0.1:{free_port()}/0"]
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert out.returncode == 2, out.stderr
    assert "--dp-ranks" in out.stderr and "--zmq auto" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("env", "flags", "needle"),
    [
        # was "non-hexadecimal number found in fromhex() arg at position 0", no flag named
        ({}, ["--signing-key", "zz" * 32], "--signing-key: not hex"),
        # any other length signs with a key no router derives: every entry refused
        ({}, ["--signing-key", "ab" * 16], "--signing-key: 16 bytes, not the 32 of"),
        # was read as no key: the publisher ran unsigned
        ({"KVROUTER_PUBLISHER__SIGNING_KEY": ""}, [], "KVROUTER_PUBLISHER__SIGNING_KEY: empty"),
        ({}, ["--signing-key", ""], "--signing-key: empty"),
        # was "invalid key prefix ''" / "stream_shards must be in [1, 1024]", no flag named
        ({}, ["--key-prefix", ""], "--key-prefix: empty"),
        ({}, ["--key-prefix", "k{v}"], "--key-prefix: 'k{v}' holds"),
        ({}, ["--stream-shards", "0"], "--stream-shards: must be in [1, 1024], got 0"),
        # was read as no engine metrics: load never scraped
        ({"KVROUTER_PUBLISHER__ENGINE_METRICS": " "}, [], "ENGINE_METRICS: empty"),
        ({"KVROUTER_PUBLISHER__DP_RANKS": ""}, [], "KVROUTER_PUBLISHER__DP_RANKS: empty"),
    ],
)
def test_keys_the_routers_cannot_follow_stop_the_command(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], flags: list[str], needle: str
) -> None:
    """Checked before the command connects anywhere (``validate``, which ``run`` calls
    first), each naming the flag or the variable and never printing the key."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["publish", "--replica", "r0", "--model", "m", "--zmq", "tcp://127.0.0.1:1"]
    args = build_parser().parse_args([*argv, "--redis", "redis://127.0.0.1:1/0", *flags])
    with pytest.raises(ValueError) as info:
        validate(args, env)
    assert needle in str(info.value) and "zz" * 32 not in str(info.value)
