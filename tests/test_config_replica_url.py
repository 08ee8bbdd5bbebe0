"""Replica URLs the proxy cannot honour are refused at start-up, not per request: the proxy's
client speaks plain http and sends requests to the host's root (no path, query, fragment or
credentials)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.core.errors import ConfigError
from router.service.config import load_settings
from router.service.replica_url import replica_url_problem
from router.service.upstream import Target


def _replicas(url: str) -> dict[str, str]:
    return {"KVROUTER_REPLICAS": f"m={url}"}


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://h:1/prefix", "path"),
        ("http://h:1/v1", "path"),
        ("http://h:1?x=1", "query"),
        ("http://h:1/?x=1", "query"),
        ("http://h:1#frag", "fragment"),
        ("https://h:1", "terminate TLS in front of the router or use a sidecar"),
        ("HTTPS://h:1", "plain http"),
        ("http://user:pw@h:1", "credentials"),
        ("http://h:port", "port"),
        ("http://h:70000", "port"),
        ("http://:80", "host"),
        ("ftp://h:1", "not an http URL"),
    ],
)
def test_unusable_replica_urls_are_refused(url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ=_replicas(url))
    message = str(info.value)
    assert "replicas[0].url" in message and needle in message, message


def test_https_message_says_what_to_do_instead() -> None:
    problem = replica_url_problem("https://h:1")
    assert problem is not None
    assert "replicas are reached over plain http on the cluster network" in problem


@pytest.mark.parametrize(
    ("url", "stored"),
    [
        ("http://h:1", "http://h:1"),
        ("http://h:1/", "http://h:1"),
        ("http://h:1?", "http://h:1"),  # an empty query: nothing to drop but the "?"
        ("http://10.0.0.1", "http://10.0.0.1"),
        ("http://[::1]:8000", "http://[::1]:8000"),
        ("HTTP://H:1", "http://H:1"),  # the proxy's client matches the scheme literally
    ],
)
def test_plain_http_urls_are_accepted_and_the_proxy_can_use_them(url: str, stored: str) -> None:
    (replica,) = load_settings(environ=_replicas(url)).replicas
    assert replica.url == stored
    Target.from_url(replica.url)  # what the proxy does per request: no ValueError


def test_file_replicas_are_checked_too(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[[replicas]]\nurl = 'http://h:1/engine'\nmodel = 'm'\n")
    with pytest.raises(ConfigError, match=r"replicas\[0\]\.url: 'http://h:1/engine'"):
        load_settings(path, environ={})


@pytest.mark.parametrize(
    ("key", "endpoint"), [("zmq", "tcp://*:5557"), ("zmq", "tcp://h"), ("zmq_replay", "h:5558")]
)
def test_kv_event_endpoints_a_router_cannot_connect_to_are_refused(
    tmp_path: Path, key: str, endpoint: str
) -> None:
    """vLLM's own ``tcp://*:5557`` binds; a router connects to a host and port."""
    extra = "" if key == "zmq" else 'zmq = "tcp://h:5557"\n'
    config = tmp_path / "router.toml"
    config.write_text(
        f'[[replicas]]\nurl = "http://h:1"\nmodel = "m"\n{extra}{key} = "{endpoint}"\n'
    )
    with pytest.raises(ConfigError) as info:
        load_settings(config, environ={})
    message = str(info.value)
    assert "replicas[0].zmq" in message and endpoint in message, message
