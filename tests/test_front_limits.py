"""Connection limits of the router's HTTP server (router/service/fast_server.py) over raw
sockets: idle keep-alive connections close, a request whose head or body stalls gets 408,
the connection cap closes the longest-idle connection for a new one and answers 503 when
none is idle, HTTP/1.0 streams are unframed, and ``GET /v1/models/{id}``. The 20,000-socket
run is ``kvrouter bench faults --idle-sockets`` (docs/bench-reliability.md)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router
from tests.test_service_fast import Front, _chat, _post, _response
from tests.waiting import eventually

MODEL = "kimi-test"
CAP = 6


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    backend = await Backend("b0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {
                "health_interval_s": 0,
                "header_timeout_s": 1.0,
                "body_timeout_s": 1.0,
                "keep_alive_timeout_s": 0.5,
                "max_connections": CAP,
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


async def _closed(reader: asyncio.StreamReader) -> bool:
    return await reader.read() == b""


async def test_idle_and_stalled_connections_are_closed(front: Front) -> None:
    idle_r, _ = await front.open()
    kept_r, kept_w = await front.open()
    kept_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await _response(kept_r))[0] == 200
    head_r, head_w = await front.open()
    head_w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never ends its head
    body_r, body_w = await front.open()
    body_w.write(_post(b'{"model": "kimi-test", "messages": []}')[:-10])  # short body
    assert await asyncio.wait_for(_closed(idle_r), 5)
    assert await asyncio.wait_for(_closed(kept_r), 5)
    for reader in (head_r, body_r):
        status, headers, _ = await asyncio.wait_for(_response(reader), 5)
        assert status == 408 and headers["connection"] == "close"


async def test_the_connection_cap_evicts_idle_ones_then_answers_503(front: Front) -> None:
    idle = [await front.open() for _ in range(CAP)]
    reader, writer = await front.open()  # the longest-idle one makes room
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await _response(reader))[0] == 200
    assert await asyncio.wait_for(_closed(idle[0][0]), 5)
    writer.close()
    # every connection busy receiving a request: a new one is answered 503
    busy = [await front.open() for _ in range(CAP)]
    for _, w in busy:
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    await asyncio.sleep(0.05)
    r2, w2 = await front.open()
    w2.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, headers, body = await asyncio.wait_for(_response(r2), 5)
    assert status == 503 and headers["retry-after"] == "1"
    assert "max_connections" in json.loads(body)["error"]["message"]

    async def fine_again() -> bool:  # the stalled ones time out: room again
        r, w = await front.open()
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status = (await _response(r))[0]
        w.close()
        return status == 200

    await eventually(fine_again, timeout=10)


async def test_http_1_0_streams_are_unframed_and_close(front: Front) -> None:
    reader, writer = await front.open()
    body = _chat(1, stream=True)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    raw = await asyncio.wait_for(reader.read(), 10)  # to the close
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"chunked" not in head.lower() and b"connection: close" in head.lower()
    assert payload.startswith(b"data: ") and payload.endswith(b"data: [DONE]\n\n")


async def test_one_model_by_id(front: Front) -> None:
    reader, writer = await front.open()
    writer.write(f"GET /v1/models/{MODEL} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    status, _, body = await _response(reader)
    assert status == 200 and json.loads(body)["id"] == MODEL
    writer.write(b"GET /v1/models/org/unknown-model HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, body = await _response(reader)
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


async def test_a_client_that_takes_no_bytes_of_its_answer_is_disconnected() -> None:
    """A client that stops reading holds its connection, its request and, past
    ``max_connections``, everyone else's place: once the router has answer bytes it cannot
    hand over for ``send_timeout_s``, the connection is aborted. A slow client that keeps
    taking bytes is not: only no progress at all counts."""
    pad = 8 << 20  # an answer far larger than the socket buffers
    backend = await Backend("b0", [MODEL], pad_bytes=pad).start()
    settings = build_settings(
        {
            "server": {
                "health_interval_s": 0,
                "header_timeout_s": 1.0,
                "body_timeout_s": 1.0,
                "keep_alive_timeout_s": 0.5,
                "send_timeout_s": 1.0,
                "max_connections": CAP,
            },
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings, "fast")
    host, port = url.removeprefix("http://").split(":")
    request = _post(_chat(1))
    try:
        # slow but steady: ~6 s for the answer, paused writes all along, never cut
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        assert length > pad
        while length:
            piece = await asyncio.wait_for(reader.read(min(length, 65536)), 10)
            assert piece, "the slow reader was cut off"
            length -= len(piece)
            await asyncio.sleep(0.05)  # the client's pace is the subject here, not a wait
        writer.close()
        await eventually(lambda: not running.server.connections)
        # reads nothing at all: aborted, its place free again
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect((host, int(port)))
        stuck.sendall(request)
        await eventually(lambda: running.server.connections, message="never connected")
        await eventually(lambda: not running.server.connections, timeout=15)
        stuck.close()
    finally:
        await running.cleanup()
        await backend.stop()
