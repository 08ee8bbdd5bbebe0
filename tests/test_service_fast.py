"""HTTP/1.1 details of the router's HTTP server (router/service/fast_server.py) over raw
sockets: keep-alive, pipelining, ``Expect: 100-continue``, chunked request bodies, HEAD and
the other routes, malformed requests, oversized bodies, and the pooled upstream client's
reuse of connections. The API itself is covered by tests/test_service_api.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router

MODEL = "kimi-test"


@dataclass
class Front:
    host: str
    port: int
    backend: Backend

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {
                "admin_token": "t",
                "max_body_mb": 0.05,
                "http_engine": "fast",
                "health_interval_s": 0,  # the backend's connections are counted
            },
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings, "fast")
    host, port = url.removeprefix("http://").split(":")
    try:
        yield Front(host, int(port), backend)
    finally:
        await runner.cleanup()
        await backend.stop()


async def _header_lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while (line := await reader.readline()) not in (b"\r\n", b""):
        yield line


def _post(body: bytes, *, extra: str = "", path: str = "/v1/chat/completions") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def _chat(i: int, **kw: Any) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}], **kw}
    return json.dumps(body).encode()


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked)."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
        return status, headers, body
    n = int(headers.get("content-length", "0"))
    return status, headers, await reader.readexactly(n) if n else b""


async def test_keep_alive_and_pipelined_requests_answer_in_order(front: Front) -> None:
    reader, writer = await front.open()
    writer.write(b"".join(_post(_chat(i)) for i in range(5)))  # pipelined
    contents = []
    for _ in range(5):
        status, _, body = await _response(reader)
        assert status == 200
        contents.append(json.loads(body)["id"])
    assert len(set(contents)) == 5
    sent = [r["body"]["messages"][0]["content"] for r in front.backend.received]
    assert sent == [f"hello {i}" for i in range(5)]
    writer.write(_post(_chat(9, stream=True)))  # same connection, streaming
    status, headers, body = await _response(reader)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body.endswith(b"data: [DONE]\n\n")
    writer.close()


async def test_expect_continue_and_chunked_request_body(front: Front) -> None:
    reader, writer = await front.open()
    body = _chat(1)
    writer.write(_post(body, extra="Expect: 100-continue\r\n"))
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    assert await reader.readline() == b"\r\n"
    status, _, _ = await _response(reader)
    assert status == 200
    half = len(body) // 2
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    )
    status, _, _ = await _response(reader)
    assert status == 200
    assert front.backend.received[-1]["body"] == json.loads(body)  # forwarded as received
    writer.close()


async def test_other_paths_and_methods_are_relayed_to_the_app(front: Front) -> None:
    reader, writer = await front.open()
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b" 200 " in await reader.readline()
    head = [line async for line in _header_lines(reader)]
    assert any(line.lower().startswith(b"content-length: ") for line in head)  # no body follows
    writer.write(b"GET /admin/replicas HTTP/1.1\r\nHost: x\r\nX-Admin-Token: t\r\n\r\n")
    status2, _, body = await _response(reader)
    assert status2 == 200 and json.loads(body)["replicas"][0]["name"] == "b0"
    writer.write(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    status3, _, body = await _response(reader)
    assert status3 == 405 and json.loads(body)["error"]["type"] == "invalid_request_error"
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    status4, _, body = await _response(reader)
    assert status4 == 200 and b"kvrouter_requests_total" in body
    writer.close()


async def test_malformed_request_gets_400_and_close(front: Front) -> None:
    reader, writer = await front.open()
    writer.write(b"THIS IS NOT HTTP\r\n\r\n")
    status, headers, body = await _response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert await reader.read() == b""  # closed
    writer.close()


async def test_oversized_body_is_413_and_connection_stays_usable(front: Front) -> None:
    reader, writer = await front.open()
    big = _chat(1, padding="x" * 80_000)
    writer.write(_post(big))
    status, _, body = await _response(reader)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    writer.write(_post(_chat(2)))
    status, _, _ = await _response(reader)
    assert status == 200
    assert len(front.backend.received) == 1
    writer.close()


async def test_upstream_connections_are_reused(front: Front) -> None:
    reader, writer = await front.open()
    for i in range(10):
        writer.write(_post(_chat(i)))
        status, _, _ = await _response(reader)
        assert status == 200
    assert all(r["headers"].get("x-request-id") for r in front.backend.received)
    # one keep-alive connection to the backend served all ten (sequential requests)
    assert front.backend._runner is not None and front.backend._runner.server is not None
    assert len(front.backend._runner.server.connections) == 1
    writer.close()


async def test_a_bad_request_after_pipelined_ones_is_answered_after_them(front: Front) -> None:
    # a protocol error in a later pipelined request must not take the place of the earlier
    # requests' answers: they are answered in order, then the error, then the close
    reader, writer = await front.open()
    writer.write(_post(_chat(1)) + _post(_chat(2)) + b"GARBAGE\r\n\r\n")
    for _ in range(2):
        status, _, body = await _response(reader)
        assert status == 200 and json.loads(body)["choices"]
    status, headers, body = await _response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "http_400"
    assert await reader.read() == b""
    writer.close()
    # a request after one with "Connection: close" is ignored, not answered 400 first
    reader, writer = await front.open()
    writer.write(_post(_chat(3), extra="Connection: close\r\n") + _post(_chat(4)))
    status, headers, _ = await _response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await reader.read() == b""
    writer.close()
    sent = [r["body"]["messages"][0]["content"] for r in front.backend.received]
    assert sent == ["hello 1", "hello 2", "hello 3"]


async def test_expect_continue_waits_for_the_pipelined_answers_before_it(front: Front) -> None:
    # "100 Continue" belongs to the request it answers: never inside an earlier answer
    reader, writer = await front.open()
    body = _chat(2)
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n"
    ).encode()
    writer.write(_post(_chat(1, stream=True)) + head)
    status, _, first = await _response(reader)
    assert status == 200 and first.endswith(b"data: [DONE]\n\n")
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    status, _, _ = await _response(reader)
    assert status == 200
    writer.close()


async def test_expect_continue_over_the_body_limit_is_413_without_the_body(front: Front) -> None:
    # the client waits for "100 Continue" before sending its body: it gets the 413 at once
    reader, writer = await front.open()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000\r\nExpect: 100-continue\r\n\r\n"
    )
    status, headers, body = await asyncio.wait_for(_response(reader), 10)
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    writer.close()


async def test_the_servers_own_errors_on_the_messages_api_take_its_shape(front: Front) -> None:
    # the Messages API's paths answer the router's errors in Anthropic's shape, the ones
    # the HTTP server answers before the front door too (docs/service.md)
    reader, writer = await front.open()
    writer.write(
        b"POST /v1/messages?beta=true HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000\r\nExpect: 100-continue\r\n\r\n"
    )
    status, _, body = await asyncio.wait_for(_response(reader), 10)
    assert status == 413
    assert json.loads(body) == {
        "type": "error",
        "error": {"type": "request_too_large", "message": json.loads(body)["error"]["message"]},
    }
    writer.close()


async def test_http_1_0_keep_alive_is_confirmed(front: Front) -> None:
    # an HTTP/1.0 client keeps the connection only when the answer says so
    reader, writer = await front.open()
    for _ in range(2):
        writer.write(b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = await _response(reader)
        assert status == 200 and headers["connection"].lower() == "keep-alive"
    writer.write(b"GET /health HTTP/1.0\r\n\r\n")
    status, headers, _ = await _response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await reader.read() == b""
    writer.close()


async def test_a_body_of_tiny_chunks_costs_its_size_not_an_object_per_chunk() -> None:
    # 2-byte chunks used to be kept as one bytes object each (~27x the body in memory: at
    # server.max_body_mb = 64, GBs per connection); they are gathered as they arrive
    import tracemalloc

    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    peaks = []
    tracemalloc.start()
    try:
        for chunked in (False, True):  # the same 600 kB body in one piece, then in 2-byte chunks
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
            framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 600000"
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{framing}\r\n\r\n".encode())
            for _ in range(30):
                writer.write(b"2\r\nxy\r\n" * 10_000 if chunked else b"xy" * 10_000)
                await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
            status, _, body = await _response(reader)
            assert status == 400 and b"not valid JSON" in body
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
        writer.close()
        await running.cleanup()
        await backend.stop()
    whole, chunks = peaks
    assert chunks < whole + 2_000_000, f"{chunks / 1e6:.1f} MB vs {whole / 1e6:.1f} MB in one piece"


async def test_a_head_of_many_tiny_headers_is_431(front: Front) -> None:
    # each header is two bytes objects and a tuple (~20x its wire size): a head of tiny
    # headers up to the parser's 1 MiB cap held ~20 MB per connection for header_timeout_s
    reader, writer = await front.open()
    writer.write(b"GET /health HTTP/1.1\r\n" + b"x-h: v\r\n" * 1001 + b"\r\n")
    status, headers, body = await _response(reader)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "http_431"
    writer.close()
    reader, writer = await front.open()
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"x-h: v\r\n" * 999 + b"\r\n")
    status, _, _ = await _response(reader)
    assert status == 200
    writer.close()


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /health HTTP/1.1\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        (b"GET /health HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n", 400),
        (b"GET /health HTTP/1.0\r\n\r\n", 200),
        (b"GET /health HTTP/1.1\r\nhOsT: a\r\n\r\n", 200),
    ],
)
async def test_host_fields_are_checked_as_rfc_9112_says(
    front: Front, head: bytes, status: int
) -> None:
    # RFC 9112 3.2: a server must answer 400 to an HTTP/1.1 request without Host and to any
    # with more than one (a proxy in front may route on another Host than the one read here)
    reader, writer = await front.open()
    writer.write(head)
    got, headers, body = await _response(reader)
    assert got == status, body
    if status == 400:
        assert headers["connection"] == "close" and b"Host" in body
    writer.close()


async def test_an_upgrade_request_is_answered_once_in_http_1_1(front: Front) -> None:
    # curl --http2 on http:// asks "Upgrade: h2c": the router speaks HTTP/1.1 only and answers
    # as if not asked (RFC 9110, 7.8), body and all. The request used to be answered (without
    # its body), then a 400 followed: an answer no request asked for, read by the next one
    upgrade = (
        "Upgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    )
    reader, writer = await front.open()
    writer.write(
        f"GET /health HTTP/1.1\r\nHost: x\r\n{upgrade}\r\n".encode()
        + _post(_chat(1), extra=upgrade)
        + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body)["choices"], body
    status, headers, body = await _response(reader)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert headers["connection"] == "close"
    assert await reader.read() == b""  # nothing more: no stray 400
    writer.close()
    [sent] = front.backend.received
    assert sent["body"] == json.loads(_chat(1))
    assert "upgrade" not in sent["headers"] and "http2-settings" not in sent["headers"]
    # CONNECT (a tunnel) is refused, once
    reader, writer = await front.open()
    writer.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    status, headers, body = await _response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert await reader.read() == b""
    writer.close()


async def test_many_pipelined_upgrade_requests_are_each_answered(front: Front) -> None:
    # each request asking to switch protocols was parsed again by a nested call, one level
    # per request in a read: a client pipelining a few hundred of them in one write got
    # a 400 ("on_message_complete callback error": the recursion limit) for a valid one
    n = 600
    reader, writer = await front.open()
    writer.write(
        b"GET /health HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n" * n
        + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    for i in range(n + 1):
        status, _, body = await _response(reader)
        assert status == 200 and json.loads(body) == {"status": "ok"}, (i, body)
    assert await reader.read() == b""
    writer.close()


async def test_trailer_fields_of_a_chunked_body_are_not_headers() -> None:
    # a chunked body's trailer section is not the header section (RFC 9110, 6.5.1): it was
    # merged into the headers, so a key sent in a trailer passed the gate and trailer
    # fields reached the replica as headers
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, "api_keys": "k1"},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = _chat(1)
    try:
        for head in (b"", b"Authorization: Bearer k1\r\n"):
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n%b"
                b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n"
                b"Authorization: Bearer k1\r\nX-Session-Id: s1\r\nX-Trailer: t\r\n\r\n"
                % (head, len(body), body)
            )
            status, _, _ = await _response(reader)
            assert status == (200 if head else 401)
    finally:
        writer.close()
        await running.cleanup()
        await backend.stop()
    [sent] = backend.received
    assert sent["body"] == json.loads(body)
    assert "x-trailer" not in sent["headers"] and "x-session-id" not in sent["headers"]


async def test_an_absolute_form_request_target_is_served_as_its_path(front: Front) -> None:
    # a server must accept the absolute-form (RFC 9112, 3.2.2), which a client sends when
    # it takes the router for a proxy: it was a 404 "no route for GET http://x/health"
    reader, writer = await front.open()
    writer.write(b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    writer.write(_post(_chat(1), path="HTTP://router.example:8000/v1/chat/completions?x=1"))
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body)["choices"], body
    assert front.backend.received[-1]["path_qs"] == "/v1/chat/completions?x=1"
    writer.close()


async def test_expect_continue_from_an_http_1_0_client_is_ignored(front: Front) -> None:
    # HTTP/1.0 has no 1xx answers: a server must ignore a 1.0 request's 100-continue
    # (RFC 9110, 10.1.1). The "100 Continue" went out and such a client took it for the answer
    reader, writer = await front.open()
    body = _chat(1)
    writer.write(_post(body, extra="Expect: 100-continue\r\n").replace(b"HTTP/1.1", b"HTTP/1.0"))
    status, headers, answer = await _response(reader)
    assert status == 200 and json.loads(answer)["choices"], answer
    assert headers["connection"] == "close"
    writer.close()


async def test_expect_continue_with_trailing_whitespace_gets_its_100(front: Front) -> None:
    # a field value's trailing whitespace is not part of it (RFC 9112 5.1), but llhttp
    # passes it on: "Expect: 100-continue " was not recognised, no 100 went out, and a
    # client that waits for it before sending its body hung
    reader, writer = await front.open()
    body = _chat(1)
    writer.write(
        _post(b"", extra="Expect: 100-Continue \t\r\n").replace(
            b"Length: 0", b"Length: %d" % len(body)
        )
    )
    assert (await reader.readline()).startswith(b"HTTP/1.1 100")
    assert await reader.readline() == b"\r\n"
    writer.write(body)
    status, _, answer = await _response(reader)
    assert status == 200 and json.loads(answer)["choices"], answer
    writer.close()
