"""Request framing of the router's HTTP server (router/service/fast_server.py) against
request smuggling, over raw sockets: what the router takes for one request's head and body
must be what a proxy in front and the replica behind take for it (RFC 9112), and a header
that is for one hop only never reaches the replica. The parser's own refusals (CL + TE,
duplicate lengths, bare LF, obs-fold, ...) are llhttp's; these are the router's."""

from __future__ import annotations

import json

from router.service.fast_server import MAX_HEAD_BYTES
from tests.test_service_fast import Front, _response
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
