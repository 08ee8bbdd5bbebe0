"""The request line and ``Host`` of the router's HTTP server (router/service/fast_server.py)
as RFC 9112 reads them, over raw sockets: what llhttp lets through that the RFC refuses (a
fragment in the target, a major version other than 1, a ``Host`` that is no URI authority)
is refused by the router, and what the RFC allows still passes, however the request's bytes
are cut into reads and wherever it stands in a pipeline. (Runs of spaces between the request
line's parts are served: RFC 9112 3 lets a recipient parse on whitespace.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router
from tests.test_service_fast import MODEL, _chat, _post, _response
from tests.waiting import eventually


@pytest.fixture
async def front() -> AsyncIterator[Any]:
    """The running router (``.port``, ``.server``: its FastServer) before one replica."""
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"admin_token": "t", "max_body_mb": 0.05, "health_interval_s": 0},
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, _ = await start_router(settings)
    try:
        yield running
    finally:
        await running.cleanup()
        await backend.stop()


async def _ask(front: Any, *pieces: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``pieces`` as separate reads of the server (each read before the next is sent)
    and return the first answer; a refusal must close the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    try:
        for i, piece in enumerate(pieces):
            writer.write(piece)
            if i < len(pieces) - 1:
                await eventually(lambda: any(c.in_message for c in front.server.connections))
        status, headers, body = await _response(reader)
        if status >= 400:
            assert headers["connection"] == "close", body
            assert await reader.read() == b""
        return status, headers, body
    finally:
        writer.close()


@pytest.mark.parametrize(
    "host",
    [b"a b", b"a<b>", b"u@a", b"a/b", b"a\xffb", b"a\tb", b"a:b", b"[::1", b"a%zz", b'a"b'],
)
async def test_a_host_that_is_no_uri_authority_is_400(front: Any, host: bytes) -> None:
    # RFC 9112 3.2: a request with an invalid Host field value must be answered 400
    # (uri-host [":" port], RFC 3986 3.2.2). llhttp takes any value without CTLs, and the
    # router routed "Host: a b" like any other
    status, _, body = await _ask(front, b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "http_400" and b"Host" in body


@pytest.mark.parametrize(
    "host",
    [
        b"",  # an empty authority (RFC 9112 3.2: then Host is sent empty)
        b"localhost:8000",
        b"a:",  # port = *DIGIT
        b"10.0.0.1",
        b"[::1]:80",
        b"[v1.fe80::a+en1]",
        b"xn--bcher-kva.example",
        b"a%2Eb",
        b"a.b-c_d~!$&'()*+,;=",
        b"a \t",  # trailing whitespace is not part of the value (llhttp keeps it)
    ],
)
async def test_a_host_that_is_a_uri_authority_is_served(front: Any, host: bytes) -> None:
    status, _, body = await _ask(front, b"GET /health HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert status == 200, body


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",  # llhttp takes 2.0
        b"GET /health HTTP/0.9\r\nHost: x\r\n\r\n",  # and 0.9
        b"GET /health\r\nHost: x\r\n\r\n",  # (0.9's request line, without version)
    ],
)
async def test_another_major_version_than_1_is_505(front: Any, head: bytes) -> None:
    # RFC 9110 15.6.6 / RFC 9112 2.3: a server refusing the client's major version answers
    # 505. The router served "HTTP/2.0" and "HTTP/0.9" requests as HTTP/1.1 (what llhttp
    # refuses itself, "HTTP/3.0", stays a 400)
    status, _, body = await _ask(front, head)
    assert status == 505, body
    assert json.loads(body)["error"]["code"] == "http_505"


async def test_a_minor_version_llhttp_refuses_stays_400(front: Any) -> None:
    status, _, _ = await _ask(front, b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n")
    assert status == 400


@pytest.mark.parametrize(
    "line",
    [
        b"GET /health#frag HTTP/1.1",
        b"GET http://x/health#frag HTTP/1.1",
        b"GET /health# HTTP/1.1",
    ],
)
async def test_a_request_line_rfc_9112_refuses_is_400(front: Any, line: bytes) -> None:
    # a request target has no fragment (RFC 9112 3.2, RFC 3986 3.5: a client sends none);
    # llhttp passes a "#..." on, and the router served it
    status, _, body = await _ask(front, line + b"\r\nHost: x\r\n\r\n")
    assert status == 400, body


@pytest.mark.parametrize(
    "cut",
    [
        (b"GET /he", b"alth HTTP/1.1\r\nHost: x\r\n\r\n"),
        (b"GET /health HTTP/1.1\r", b"\nHost: x\r\n\r\n"),
        (b"GET /health HTTP/1.1\r\nHo", b"st: x\r\n\r\n"),
        (b"\r\nG", b"ET /health HTTP/1.1\r\nHost: x\r\n\r\n"),  # an empty line before
        (b"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",),
        (b"G", b"E", b"T", b" ", b"/", b"health HTTP/1.", b"1", b"\r", b"\n", b"Host: x\r\n\r\n"),
    ],
)
async def test_a_valid_request_line_cut_across_reads_is_served(
    front: Any, cut: tuple[bytes, ...]
) -> None:
    status, _, body = await _ask(front, *cut)
    assert status == 200, body


def _chunked(body: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x;ext=1\r\n%b\r\n0\r\nX-Trailer: t\r\n\r\n"
        % (path, len(body), body)
    )


async def test_good_pipelined_requests_of_every_framing_are_all_served(front: Any) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    writer.write(
        get + _chunked(_chat(1)) + get + _post(_chat(2)) + b"\r\n" + get + _chunked(_chat(3)) + get
    )
    for _ in range(7):
        status, _, body = await _response(reader)
        assert status == 200, body
    writer.close()


async def test_runs_of_spaces_in_the_request_line_are_served(front: Any) -> None:
    # RFC 9112 3: "recipients MAY instead parse on whitespace-delimited word boundaries"
    status, _, body = await _ask(front, b"GET  /health   HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200, body
