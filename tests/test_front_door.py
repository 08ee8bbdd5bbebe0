"""The front door (router.service.handling.handle) over real HTTP: every limit of the public
port holds on every route of the router's one HTTP server (the two hot endpoints, streaming
or not, ``/v1/models``, unknown ``/v1`` paths, probes, metrics and admin), and an unexpected
error is logged whether or not the answer had begun."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.service.config import build_settings
from tests.backends import Backend, start_router
from tests.waiting import eventually

MODEL = "m"
KEY_A = "sk-front-door-a"
KEY_B = "sk-front-door-b"
ADMIN = "adm-front-door"

# (method, path, body): every kind of route of the public port
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
HOT = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4}),
]
PROTECTED = [*HOT, ("GET", "/v1/models", None)]
OPEN = [("GET", "/health", None), ("GET", "/ready", None), ("GET", "/metrics", None)]


async def _router(server: dict[str, Any]) -> AsyncIterator[tuple[str, Backend]]:
    backend = await Backend("b0", [MODEL], chunk_delay_s=0.02).start()
    settings = build_settings(
        {
            "server": {"admin_token": ADMIN, "retry_after_s": 3, **server},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: {"block_size": 16}},
        }
    )
    running, url = await start_router(settings)
    try:
        yield url, backend
    finally:
        await running.cleanup()
        await backend.stop()


@pytest.fixture
async def keyed() -> AsyncIterator[tuple[str, Backend]]:
    limits = {
        "api_keys": f"{KEY_A},{KEY_B}",
        "max_concurrent_per_key": 1,
        "max_header_kb": 2.0,
        "max_body_mb": 0.01,
    }
    async for pair in _router(limits):
        yield pair


async def _call(
    s: aiohttp.ClientSession,
    url: str,
    method: str,
    path: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    async with s.request(method, url + path, json=body, headers=headers or {}) as r:
        raw = await r.read()
        try:
            data = await r.json(content_type=None)
        except ValueError:
            data = raw
        return r.status, dict(r.headers), data


def _code(data: Any) -> str:
    assert isinstance(data, dict) and "error" in data, data
    return str(data["error"]["code"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_api_keys_hold_on_every_v1_route(keyed: tuple[str, Backend]) -> None:
    url, _ = keyed
    async with aiohttp.ClientSession() as s:
        for method, path, body in PROTECTED:
            for headers in ({}, bearer("sk-wrong"), {"api-key": "sk-front-door-"}):
                status, _, data = await _call(s, url, method, path, body, headers)
                assert (status, _code(data)) == (401, "invalid_api_key"), (path, headers)
            for headers in (bearer(KEY_A), {"api-key": KEY_B}):
                status, _, data = await _call(s, url, method, path, body, headers)
                assert status == 200, (path, data)
        # an unknown /v1 path needs the key before it is a 404
        status, _, data = await _call(s, url, "GET", "/v1/nothing", None)
        assert (status, _code(data)) == (401, "invalid_api_key")
        status, _, data = await _call(s, url, "GET", "/v1/nothing", None, bearer(KEY_A))
        assert (status, _code(data)) == (404, "not_found")
        for method, path, body in OPEN:  # probes and scrapers carry no key
            status, _, _ = await _call(s, url, method, path, body)
            assert status == 200, path


async def test_api_keys_hold_on_every_route_that_reaches_a_replica(
    keyed: tuple[str, Backend],
) -> None:
    """vLLM's routes outside ``/v1/`` that the router passes to a replica (``/tokenize``,
    the pooling routes, ``/v2/...``) cost the fleet work as the ``/v1/`` ones do: they need a
    client key and count against its concurrency limit; only the probes, ``/metrics`` and
    the admin routes (their own token) are open."""
    from router.service.pass_through import PATHS

    url, backend = keyed
    outside = [p.decode() for p in PATHS if not p.startswith(b"/v1/")]
    assert "/tokenize" in outside and "/v2/embed" in outside
    body = {"model": MODEL, "prompt": "hello"}
    async with aiohttp.ClientSession() as s:
        for path in outside:
            for headers in ({}, bearer("sk-wrong")):
                status, _, data = await _call(s, url, "POST", path, body, headers)
                assert (status, _code(data)) == (401, "invalid_api_key"), (path, headers)
            status, _, data = await _call(s, url, "POST", path, body, bearer(KEY_A))
            assert status == 404, (path, data)  # the replica's own answer: it serves none
        backend.chunks = 200  # key A's one slot held by a stream
        hold = await s.post(url + "/v1/chat/completions", json=HOT[1][2], headers=bearer(KEY_A))
        await hold.content.readline()
        for path in outside:
            status, _, data = await _call(s, url, "POST", path, body, bearer(KEY_A))
            assert (status, _code(data)) == (429, "too_many_concurrent_requests"), path
        hold.close()


async def test_header_limit_holds_on_every_route(keyed: tuple[str, Backend]) -> None:
    url, _ = keyed
    admin = ("GET", "/admin/replicas", None)
    big = {**bearer(KEY_A), "X-Admin-Token": ADMIN, "X-Pad": "p" * 2100}
    async with aiohttp.ClientSession() as s:
        for method, path, body in [*PROTECTED, *OPEN, admin]:
            status, _, data = await _call(s, url, method, path, body, big)
            assert (status, _code(data)) == (431, "request_header_fields_too_large"), path
        status, _, _ = await _call(s, url, *admin, {"X-Admin-Token": ADMIN})
        assert status == 200


async def test_body_limit_holds_on_both_hot_endpoints(keyed: tuple[str, Backend]) -> None:
    url, backend = keyed
    async with aiohttp.ClientSession() as s:
        for method, path, body in HOT:
            huge = {**body, "pad": "x" * 20_000}
            status, _, data = await _call(s, url, method, path, huge, bearer(KEY_A))
            assert (status, _code(data)) == (413, "request_too_large"), path
            status, _, data = await _call(s, url, method, path, huge)
            assert status == 401, path  # the key is checked first
    assert backend.received == []


async def test_per_key_concurrency_holds_on_every_v1_route(keyed: tuple[str, Backend]) -> None:
    url, backend = keyed
    backend.chunks = 200  # a stream that lasts while the other requests are made
    async with aiohttp.ClientSession() as s:
        hold = await s.post(url + "/v1/chat/completions", json=HOT[1][2], headers=bearer(KEY_A))
        assert hold.status == 200
        await hold.content.readline()  # key A's one slot is taken
        for method, path, body in PROTECTED:
            status, headers, data = await _call(s, url, method, path, body, bearer(KEY_A))
            assert (status, _code(data)) == (429, "too_many_concurrent_requests"), path
            assert headers.get("Retry-After") == "3"
        backend.chunks = 4
        status, _, _ = await _call(s, url, *HOT[0], bearer(KEY_B))  # another key's slot
        assert status == 200
        await hold.read()  # the stream ends: its slot is free again
        hold.release()
        for method, path, body in PROTECTED:
            status, _, data = await _call(s, url, method, path, body, bearer(KEY_A))
            assert status == 200, (path, data)


async def test_per_address_concurrency_without_keys() -> None:
    async for url, backend in _router({"max_concurrent_per_key": 1}):
        backend.chunks = 200
        async with aiohttp.ClientSession() as s:
            hold = await s.post(url + "/v1/chat/completions", json=HOT[1][2])
            await hold.content.readline()
            status, _, data = await _call(s, url, *HOT[2])
            assert (status, _code(data)) == (429, "too_many_concurrent_requests")
            status, _, _ = await _call(s, url, "GET", "/health", None)
            assert status == 200  # the probes are not counted
            hold.close()


async def test_an_error_after_the_answer_began_is_logged_and_aborts(
    keyed: tuple[str, Backend], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream's head went out, then the router fails (a simulated bug in the usage filter
    of a stream it asked usage for): the client's connection is aborted, never left with a
    half answer that looks whole, and the error is logged with its traceback."""
    from router.service.stream_usage import UsageFilter

    original = UsageFilter.feed
    calls = 0

    def broken(self: UsageFilter, chunk: bytes) -> bytes:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("simulated bug mid-stream")
        return original(self, chunk)

    monkeypatch.setattr(UsageFilter, "feed", broken)
    url, _ = keyed
    with caplog.at_level(logging.ERROR):
        async with aiohttp.ClientSession() as s:
            resp = await s.post(url + "/v1/chat/completions", json=HOT[1][2], headers=bearer(KEY_A))
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
            resp.release()
    assert any(
        r.exc_info and "simulated bug mid-stream" in str(r.exc_info[1]) for r in caplog.records
    ), caplog.text
    monkeypatch.undo()
    async with aiohttp.ClientSession() as s:  # the router goes on serving, the key's slot free
        status, _, _ = await _call(s, url, *HOT[1], bearer(KEY_A))
        assert status == 200


async def test_no_route_and_wrong_method(keyed: tuple[str, Backend]) -> None:
    url, _ = keyed
    async with aiohttp.ClientSession() as s:
        status, _, data = await _call(s, url, "GET", "/nothing", None)
        assert (status, _code(data)) == (401, "invalid_api_key")  # the key before the 404
        status, _, data = await _call(s, url, "GET", "/nothing", None, bearer(KEY_A))
        assert (status, _code(data)) == (404, "not_found")
        status, headers, data = await _call(s, url, "GET", "/v1/completions", None, bearer(KEY_A))
        assert (status, _code(data), headers.get("Allow")) == (405, "http_405", "POST")
        status, headers, _ = await _call(s, url, "POST", "/health", {})
        assert (status, headers.get("Allow")) == (405, "GET")
        async with s.head(url + "/health") as r:
            assert r.status == 200 and await r.read() == b""


async def test_a_head_over_the_servers_cap_closes_the_connection(
    keyed: tuple[str, Backend],
) -> None:
    """Past the parser's cap (router.service.http_connection.MAX_HEAD_BYTES) the server does not
    keep collecting headers: 431 and the connection closes, before any route or limit runs."""
    from router.service.http_connection import MAX_HEAD_BYTES

    url, _ = keyed
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    line = b"X-Pad: " + b"p" * 8000 + b"\r\n"
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    for _ in range(MAX_HEAD_BYTES // len(line) + 2):
        writer.write(line)
    with contextlib.suppress(ConnectionError):  # it may close while the rest is sent
        await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    writer.close()


async def test_a_non_ascii_api_key_matches_as_a_client_sends_it() -> None:
    """A client sends a key's UTF-8 bytes; header bytes were read as latin-1 and hashed as
    their UTF-8 re-encoding, so a configured key with a non-ASCII character never matched
    (the admin token's check had the same defect: tests/test_admin_auth.py)."""
    key = "sk-clé-ü-鍵"
    async for url, _ in _router({"api_keys": key}):
        host, port = url[7:].split(":")
        sent = key.encode()
        for header, status in (
            (b"Authorization: Bearer " + sent, b"200"),
            (b"x-api-key: " + sent, b"200"),
            (b"Authorization: Bearer " + sent[:-1], b"401"),
            (b"Authorization: Bearer " + key.encode("latin-1", "replace"), b"401"),
        ):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            got = (await reader.readline()).split()[1]
            writer.close()
            assert got == status, header


async def test_a_hash_inside_a_key_of_the_keys_file_is_part_of_the_key(tmp_path: Path) -> None:
    """``api_keys_file`` takes ``#`` comments; a ``#`` inside a key (``sk-abc#def``, a
    generated key with symbols) cut the key there, so its prefix ``sk-abc``, a shorter key
    nobody was given, was let in. A comment starts a line or follows a space."""
    keys = tmp_path / "keys"
    keys.write_text("# client keys\nsk-abc#def\nsk-ghi  # the second client\n\t#sk-off\n")
    async for url, _ in _router({"api_keys_file": str(keys)}):
        async with aiohttp.ClientSession() as s:
            for key, status in (
                ("sk-abc#def", 200),
                ("sk-ghi", 200),
                ("sk-abc", 401),
                ("sk-ghi  # the second client", 401),
                ("#sk-off", 401),
                ("sk-off", 401),
            ):
                got, _, _ = await _call(s, url, "GET", "/v1/models", None, bearer(key))
                assert got == status, key


def test_a_keys_setting_that_yields_no_key_is_refused(tmp_path: Path) -> None:
    """``api_keys_file`` naming a file with no key in it (a secret mounted empty, only
    comments), or ``api_keys`` set to blanks, left the router with no key and so open to
    every client: it fails closed, refused when the app is built."""
    from router.core.errors import ConfigError
    from router.service.app import create_app

    empty = tmp_path / "keys"
    empty.write_text("# the keys go here\n\n")
    for server in ({"api_keys_file": str(empty)}, {"api_keys": " , "}, {"api_keys": ""}):
        settings = build_settings(
            {
                "server": server,
                "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "b0"}],
                "models": {MODEL: {"block_size": 16}},
            }
        )
        with pytest.raises(ConfigError, match="hold no client key"):
            create_app(settings)


async def test_a_request_with_a_wrong_key_has_its_body_dropped_and_no_100() -> None:
    """The key is known from the request's head: a request the gate will refuse for it has
    its body read and dropped, never kept (an unauthenticated client made the router buffer
    up to ``max_body_mb`` per request), and an ``Expect: 100-continue`` gets its 401 without
    a ``100 Continue`` first. A right key's request is kept and continued as before."""
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"api_keys": KEY_A, "max_body_mb": 1},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: {"block_size": 16}},
        }
    )
    running, url = await start_router(settings)
    kept: list[int] = []
    handler = running.server.handler

    async def recording(req: Any, sink: Any) -> None:
        kept.append(len(req.body))
        await handler(req, sink)

    running.server.handler = recording
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "x " * 200_000, "max_tokens": 1}).encode()
    try:
        for key, first in ((b"wrong", b"401"), (KEY_A.encode(), b"100")):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + key + b"\r\nExpect: 100-continue\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)
            )
            writer.write(body)  # (a client may send its body without waiting for the 100)
            status = (await reader.readline()).split()[1]
            writer.close()
            assert status == first, (key, status)
        await eventually(lambda: len(kept) == 2)
        assert kept == [0, len(body)], kept
    finally:
        await running.cleanup()
        await backend.stop()


async def test_a_refused_request_that_awaits_100_continue_is_answered_without_its_body(
    keyed: tuple[str, Backend],
) -> None:
    """A request whose refusal is known from its head (a wrong key) and that waits for
    ``100 Continue`` before sending its body gets that refusal at once (RFC 9110 10.1.1:
    a final status or a 100, immediately), then the connection closes: the client may send
    its body or not, so what follows cannot be framed. The router sent neither and waited
    for the body, so a client that waits for its 100 (the openai SDK's httpx does not ask;
    curl does, for a large body) hung until it gave up waiting."""
    url, backend = keyed
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(CHAT).encode()
    for framing in (b"Content-Length: %d\r\n" % len(body), b"Transfer-Encoding: chunked\r\n"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n" + framing + b"\r\n"
        )
        status = (await reader.readline()).split()[1]
        assert status == b"401", (framing, status)
        head = b""
        while (line := await reader.readline()) != b"\r\n":
            head += line.lower()
        assert b"connection: close\r\n" in head
        # what the client sends now is not taken for a request: the connection has ended
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        rest = await reader.read()
        assert json.loads(rest)["error"]["code"] == "invalid_api_key"
        assert await reader.read() == b""
        writer.close()
    assert backend.received == []
    # without a body, nothing is left unframed: the connection serves the next request
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answers = await reader.read()
    assert answers.startswith(b"HTTP/1.1 401 ") and answers.count(b"HTTP/1.1 200 OK") == 1
    writer.close()
