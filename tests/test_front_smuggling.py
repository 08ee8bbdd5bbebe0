"""Request framing of the router's HTTP server (router/service/fast_server.py) against
request smuggling, over raw sockets: what the router takes for one request's head and body
must be what a proxy in front and the replica behind take for it (RFC 9112), and a header
that is for one hop only never reaches the replica. The parser's own refusals (CL + TE,
duplicate lengths, bare LF, obs-fold, ...) are llhttp's; these are the router's."""

from __future__ import annotations

import contextlib
import json

from router.service.http_connection import MAX_HEAD_BYTES
from tests.test_service_fast import Front, _chat, _post, _response
from tests.test_service_fast import front as front  # (the fixture)


async def test_a_header_line_that_never_ends_is_431_at_the_parser_cap(front: Front) -> None:
    # httptools gathers a header's name or value until its line ends (by repeated bytes
    # concatenation) and the cap was checked only then: one client sending an endless
    # header value grew a copy per read, quadratic CPU on the event loop (256 MB took 75 s
    # of it) and all the memory it wanted, never answered 431
    reader, writer = await front.open()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: "
    # one byte over the cap: the server has read all when it answers (no reset for unread
    # bytes); the line never ends
    writer.write(head + b"a" * (MAX_HEAD_BYTES + 1 - len(head)))
    writer.write_eof()
    status, headers, body = await _response(reader)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "http_431"
    assert await reader.read() == b""
    writer.close()


async def test_a_trailer_line_that_never_ends_is_431_at_the_parser_cap(front: Front) -> None:
    # the same in a chunked body's trailer section: its fields are dropped, but httptools
    # gathers each line first; a trailer line that never ended grew without bound
    reader, writer = await front.open()
    body = _chat(1)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\nX-Long: " % (len(body), body)
    )
    # (the cap counts whole pieces read from the last with body bytes, which may hold the
    # line's start: the line is longer than the cap by more than one read's 256 KiB)
    writer.write(b"a" * (MAX_HEAD_BYTES + 2**19))
    writer.write_eof()
    status, headers, answer = await _response(reader)
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(answer)["error"]["code"] == "http_431"
    assert await reader.read() == b""
    writer.close()
    assert front.backend.received == []


async def test_transfer_encoding_in_an_http_1_0_request_is_refused(front: Front) -> None:
    # HTTP/1.0 has no chunked coding: a proxy in front may frame such a request by its
    # Content-Length or as bodiless, so its "body" is the next request to it (RFC 9112
    # 6.1: the framing is faulty, the connection must close). The router decoded it as
    # chunked and kept the connection for the request that followed
    reader, writer = await front.open()
    body = _chat(1)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\nGET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
        % (len(body), body)
    )
    status, headers, answer = await _response(reader)
    assert status == 400 and headers["connection"] == "close", answer
    assert await reader.read() == b""
    writer.close()
    assert front.backend.received == []


async def test_a_transfer_coding_other_than_chunked_is_501(front: Front) -> None:
    # "gzip, chunked": llhttp undoes the chunked coding only, and the router took the still
    # gzip-coded bytes for the body, passing them on as a plain body (the coding, hop by
    # hop, dropped); a server must refuse a coding it does not know (RFC 9112 6.1: 501),
    # as h11 and nginx do
    for coding in (b"gzip, chunked", b"deflate,chunked"):
        reader, writer = await front.open()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: %b\r\n\r\n"
            b"4\r\nabcd\r\n0\r\n\r\n" % coding
        )
        status, headers, _ = await _response(reader)
        assert (status, headers["connection"]) == (501, "close"), coding
        writer.close()
    reader, writer = await front.open()  # the chunked coding alone, any case: served
    body = _chat(2)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n"
        b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    )
    status, _, answer = await _response(reader)
    assert status == 200 and json.loads(answer)["choices"], answer
    writer.close()


async def test_hop_by_hop_headers_do_not_reach_the_replica(front: Front) -> None:
    # Proxy-Connection (HTTP/1.0 proxies' Connection, RFC 9110 7.6.1) went to the replica
    reader, writer = await front.open()
    extra = (
        "Proxy-Connection: keep-alive\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
        "Trailer: X-T\r\nProxy-Authorization: Basic eA==\r\nConnection: X-Hop, keep-alive\r\n"
        "X-Hop: 1\r\nX-Data-Parallel-Rank: 3\r\nX-Kept: 1\r\n"
    )
    writer.write(_post(_chat(1), extra=extra))
    status, _, _ = await _response(reader)
    assert status == 200
    writer.close()
    [sent] = front.backend.received
    got = sent["headers"]
    assert got["x-kept"] == "1"
    for name in (
        "proxy-connection",
        "keep-alive",
        "te",
        "trailer",
        "proxy-authorization",
        "x-hop",
        "x-data-parallel-rank",
    ):
        assert name not in got, name


async def test_a_refusal_reaches_a_client_that_is_still_sending(front: Front) -> None:
    # a protocol error's answer was followed by a plain close: with bytes of the client's
    # still unread (a refused body, a head's rest, pipelined requests), that is a TCP reset,
    # and the client lost the answer (every time on loopback: a 413 at once for a body sent
    # without waiting for "100 Continue", a 400 with bytes after the bad line) and saw a
    # connection error, which OpenAI's SDKs retry
    body = b"x" * 2_000_000  # (max_body_mb 0.05)
    cases = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body),
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n" + body,
    ]
    for request, expected in zip(cases, (413, 400), strict=True):
        reader, writer = await front.open()
        writer.write(request)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        status, headers, _ = await _response(reader)
        assert (status, headers["connection"]) == (expected, "close")
        assert await reader.read() == b""  # the end of the stream, no reset
        writer.close()


async def test_an_answer_that_closes_the_connection_reaches_a_client_still_sending(
    front: Front,
) -> None:
    # the same for the answer to a request that ends the connection (``Connection: close``,
    # an HTTP/1.0 request without keep-alive): the server must process nothing after it
    # (RFC 9112 9.6) but closed at once, with the pipelined bytes that followed unread or
    # still coming: a reset, and the client lost the answer the request was owed
    body = b"x" * 2_000_000
    after = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )
    for first in (
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /health HTTP/1.0\r\n\r\n",
    ):
        reader, writer = await front.open()
        writer.write(first + after)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        status, headers, answer = await _response(reader)
        assert (status, headers["connection"]) == (200, "close"), first
        assert json.loads(answer) == {"status": "ok"}
        assert await reader.read() == b""  # the end of the stream, no reset
        writer.close()
    assert front.backend.received == []
