"""What the proxy relays is what the replica sent, whole or visibly broken: answers larger
than the upstream read buffer, bodies delimited by the connection's end (a reset or a stream
without its ``[DONE]`` is not an answer), the client's query string and request id bytes."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import socket
import struct
import termios
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.service.app import STATE
from router.service.config import build_settings
from router.service.upstream import HIGH_WATER
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi-test"
TOKEN = "admin-secret"


async def _router(
    replica_url: str, **server: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    settings = build_settings(
        {
            "server": {"admin_token": TOKEN, "health_interval_s": 0, **server},
            "replicas": [{"url": replica_url, "model": MODEL, "name": "r0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    session = aiohttp.ClientSession()
    try:
        yield url, session
    finally:
        await session.close()
        await running.cleanup()


async def _outcomes(url: str, session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        page = await r.text()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("kvrouter_requests_total{"):
            labels, _, value = line.rpartition(" ")
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = out.get(outcome, 0.0) + float(value)
    return out


def _chat(stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": "tell me everything"}],
    }


async def test_an_answer_larger_than_the_read_buffer_arrives_whole() -> None:
    backend = await Backend("r0", [MODEL], pad_bytes=3 * HIGH_WATER).start()
    try:
        async for url, session in _router(backend.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert len(body["x_pad"]) == 3 * HIGH_WATER
            assert body["choices"][0]["finish_reason"] == "stop"
            assert (await _outcomes(url, session)).get("ok") == 1.0
    finally:
        await backend.stop()


async def test_the_connection_of_a_large_answer_is_pooled_reading() -> None:
    """A non-streamed answer over the read buffer pauses reading from the replica while it
    arrives; the connection goes back to the pool once the answer is whole, and the next
    request on it must be read: it was pooled still paused, so the next answer was never
    read (the request waited for its first-byte deadline, then counted as a timeout of a
    healthy replica)."""
    backend = await Backend("r0", [MODEL], pad_bytes=3 * HIGH_WATER).start()
    try:
        async for url, session in _router(backend.url, first_byte_timeout_s=30.0):
            for _ in range(3):
                post = session.post(url + "/v1/chat/completions", json=_chat(False))
                async with await asyncio.wait_for(post, 10) as resp:
                    assert resp.status == 200, await resp.text()
                    assert len((await resp.json())["x_pad"]) == 3 * HIGH_WATER
            assert (await _outcomes(url, session)).get("ok") == 3.0
    finally:
        await backend.stop()


async def test_a_nested_stream_key_does_not_make_an_answer_a_stream() -> None:
    """The first-byte deadline of an answer that is not a stream includes its decode; a
    ``"stream": true`` nested before the top-level ``"stream": false`` must not shorten it
    to a stream's prefill-only deadline (the answer would be cut off and retried)."""
    backend = await Backend("r0", [MODEL], delay_s=0.6).start()
    try:
        async for url, session in _router(backend.url, first_byte_min_s=0.3, max_retries=0):
            chat = _chat(False)
            body = {"metadata": {"stream": True}, **chat, "max_tokens": 100}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            # ... while a stream that sends nothing by the same deadline is cut off
            body = {**chat, "stream": True}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 504, await resp.text()
    finally:
        await backend.stop()


async def test_query_string_request_id_bytes_and_end_to_end_headers_reach_the_replica() -> None:
    backend = await Backend("r0", [MODEL]).start()
    try:
        async for url, _ in _router(backend.url):
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps(_chat(False)).encode()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b"POST /v1/chat/completions?api-version=2024-06-01 HTTP/1.1\r\n"
                + f"Host: {host}\r\nContent-Type: application/json\r\n".encode()
                + b"X-Request-Id: caf\xe9-1\r\n"  # latin-1 bytes, as HTTP allows
                + b"X-Hop: for the router only\r\nX-Kept: for the replica\r\n"
                + b"Accept-Encoding: gzip, br\r\n"
                + f"Content-Length: {len(body)}\r\nConnection: close, X-Hop\r\n\r\n".encode()
                + body
            )
            raw = await reader.read()
            writer.close()
            head = raw.split(b"\r\n\r\n", 1)[0]
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"\r\nX-Request-Id: caf\xe9-1\r\n" in head, head
            seen = backend.received[-1]
            assert seen["path_qs"] == "/v1/chat/completions?api-version=2024-06-01"
            # aiohttp decodes header bytes as UTF-8 with surrogate escapes
            sent_id = b"caf\xe9-1".decode("utf-8", "surrogateescape")
            assert seen["headers"]["x-request-id"] == sent_id
            # a header the client's Connection header names is for the first hop only
            assert "x-hop" not in seen["headers"], seen["headers"]
            assert seen["headers"]["x-kept"] == "for the replica"
            # the router reads answers (usage, a stream's closing event, error bodies): it
            # asks for them uncompressed whatever the client accepts
            assert seen["headers"]["accept-encoding"] == "identity"
    finally:
        await backend.stop()


async def _read_request(reader: asyncio.StreamReader) -> None:
    """Read one request (its head and ``Content-Length`` body) off a raw replica's socket."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)


class UntilClose:
    """A replica whose answers have no length and no chunking: the body ends where the
    connection does. It sends the head and ``first`` at once, then what the test releases
    with ``finish(rest, reset)``: more bytes, then a clean close or a reset (RST)."""

    def __init__(self, content_type: bytes, first: bytes) -> None:
        self.content_type = content_type
        self.first = first
        self.sent_first = asyncio.Event()
        self._finish: asyncio.Future[tuple[bytes, bool]] | None = None
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> UntilClose:
        self._finish = asyncio.get_running_loop().create_future()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def finish(self, rest: bytes, reset: bool) -> None:
        assert self._finish is not None
        self._finish.set_result((rest, reset))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: " + self.content_type + b"\r\n"
            b"Connection: close\r\n\r\n" + self.first
        )
        await writer.drain()
        sock: socket.socket = writer.get_extra_info("socket")
        # every byte is with the router (acknowledged) before anything else happens
        await eventually(lambda: _unacknowledged(sock) == 0)
        self.sent_first.set()
        assert self._finish is not None
        rest, reset = await self._finish
        if rest:
            writer.write(rest)
            await writer.drain()
            await eventually(lambda: _unacknowledged(sock) == 0)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _unacknowledged(sock: socket.socket) -> int:
    got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    return int(struct.unpack("i", got)[0])


EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'


@pytest.mark.parametrize("reset", [False, True], ids=["clean-close", "reset"])
async def test_a_stream_delimited_by_the_connection_needs_its_done(reset: bool) -> None:
    replica = await UntilClose(b"text/event-stream", EVENT).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                first = await resp.content.readuntil(b"\n\n")
                assert first == EVENT
                replica.finish(EVENT, reset)  # one more event, then the end: no [DONE]
                with pytest.raises(aiohttp.ClientPayloadError):
                    await resp.content.read()
            outcomes = await _outcomes(url, session)
            assert outcomes.get("upstream_broken") == 1.0, outcomes
            assert "ok" not in outcomes, outcomes
    finally:
        await replica.stop()


async def test_a_stream_delimited_by_the_connection_ends_well_with_its_done() -> None:
    replica = await UntilClose(b"text/event-stream", EVENT).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                await replica.sent_first.wait()
                replica.finish(b"data: [DONE]\n\n", reset=False)
                body = await resp.read()
            assert body.startswith(EVENT) and body.rstrip().endswith(b"data: [DONE]"), body
            assert (await _outcomes(url, session)).get("ok") == 1.0
    finally:
        await replica.stop()


async def test_a_done_split_across_reads_ends_a_stream_delimited_by_the_connection() -> None:
    """``data: [DONE]`` cut by a TCP read (``data: [DO`` in one, ``NE]`` in the next) is
    still the stream's end: the stream was complete, yet the router judged only the last
    read, found no ``[DONE]`` ending it, and broke the answer off with an error event and
    an aborted connection (counted ``upstream_broken``)."""
    replica = await UntilClose(b"text/event-stream", EVENT + b"data: [DO").start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                # the router has read the first piece, "data: [DO" included
                assert await resp.content.readuntil(b"\n\n") == EVENT
                replica.finish(b"NE]\n\n", reset=False)
                body = await resp.read()
            assert body == b"data: [DONE]\n\n", body
            outcomes = await _outcomes(url, session)
            assert outcomes.get("ok") == 1.0 and "upstream_broken" not in outcomes, outcomes
    finally:
        await replica.stop()


async def test_a_replica_that_breaks_off_after_the_done_gave_the_whole_answer() -> None:
    """A replica whose connection resets after the stream's ``data: [DONE]`` (the client
    has it already) broke nothing of the answer: as for a client that leaves after the
    ``[DONE]``, the answer is whole (``ok``). The relay wrote an error event after the
    ``[DONE]`` and aborted the client's connection, counted ``upstream_broken``."""
    replica = await UntilClose(b"text/event-stream", EVENT).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                assert await resp.content.readuntil(b"\n\n") == EVENT
                replica.finish(b"data: [DONE]\n\n", reset=True)
                body = await resp.read()
            assert body == b"data: [DONE]\n\n", body
            outcomes = await _outcomes(url, session)
            assert outcomes.get("ok") == 1.0 and "upstream_broken" not in outcomes, outcomes
    finally:
        await replica.stop()


CREATED = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","status":"in_progress"},'
    b'"sequence_number":0,"type":"response.created"}\n\n'
)


async def _holder_of(replica_url: str, response_id: str) -> tuple[Any, str]:
    """A router whose one replica holds the stored response ``response_id``."""
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": replica_url, "model": MODEL, "name": "r0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    running.app[STATE].response_ids.put(response_id, MODEL, "r0")
    return running, url


async def test_a_streamed_retrieve_delimited_by_the_connection_needs_its_final_event() -> None:
    """``GET /v1/responses/{id}?stream=true`` relayed from the holder (pass_through.py): a
    stream the holder delimits by closing the connection is whole only with its final
    ``response.completed`` event, as for the hot endpoints. The relay took a clean close for
    the stream's end: the client got a truncated stream that ended like a whole one, with
    no error event."""
    replica = await UntilClose(b"text/event-stream", CREATED).start()
    running, url = await _holder_of(replica.url, "resp_1")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/responses/resp_1?stream=true") as resp,
        ):
            assert resp.status == 200
            assert await resp.content.readuntil(b"\n\n") == CREATED
            replica.finish(b"", reset=False)  # the holder stops: no response.completed
            rest = await resp.content.read()
        assert b"broke off" in rest, rest
    finally:
        await running.cleanup()
        await replica.stop()


async def test_a_cut_retrieve_that_came_whole_at_once_is_no_answer() -> None:
    """The same cut stream, head, event and close sent at once: when the relay finds it
    ended before relaying any of it, nothing reached the client and the holder gave no
    answer (503); else it is relayed with the error event. Never a whole-looking 200."""
    replica = await Canned(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + CREATED
    ).start()
    running, url = await _holder_of(replica.url, "resp_1")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/responses/resp_1?stream=true") as resp,
        ):
            body = await resp.read()
        if resp.status == 503:
            assert "closed before the stream's end" in json.loads(body)["error"]["message"]
        else:
            assert resp.status == 200 and b"broke off" in body, (resp.status, body)
    finally:
        await running.cleanup()
        await replica.stop()


@pytest.mark.parametrize("reset", [False, True], ids=["clean-close", "reset"])
async def test_a_json_answer_delimited_by_the_connection(reset: bool) -> None:
    """A clean close ends such a body (HTTP/1.1's rule; nothing else can tell), a reset
    breaks it: 502, never the half answer as a 200."""
    part = b'{"id": "c1", "choices": [{"index": 0, "message": {"content": "part'
    replica = await UntilClose(b"application/json", part).start()
    try:
        async for url, session in _router(replica.url):
            request = asyncio.ensure_future(
                session.post(url + "/v1/chat/completions", json=_chat(False))
            )
            await replica.sent_first.wait()
            rest = b'ial"}}]}'
            replica.finish(b"" if reset else rest, reset)
            async with await request as resp:
                body = await resp.read()
                if reset:
                    assert resp.status == 502, body
                    error = json.loads(body)["error"]
                    assert error["type"] == "upstream_error", error
                    assert "connection lost" in error["message"], error
                else:
                    assert resp.status == 200, body
                    assert body == part + rest
    finally:
        await replica.stop()


class Canned:
    """A keep-alive replica that answers each request with the next of ``answers``, written
    in one piece."""

    def __init__(self, *answers: bytes) -> None:
        self.answers = list(answers)
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> Canned:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while self.answers:
                await _read_request(reader)
                writer.write(self.answers.pop(0))
                await writer.drain()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def test_a_replicas_trailer_fields_are_not_relayed_as_headers() -> None:
    """A chunked answer's trailer section is not its header section (RFC 9110, 6.5.1): when
    the whole answer came in one read, its trailer fields were relayed as headers (a
    trailer ``Content-Type`` would even have made a JSON answer a stream)."""
    body = b'{"id": "c1", "choices": [{"index": 0, "message": {"content": "hi"}}]}'
    replica = await Canned(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        b"Trailer: X-Trailer\r\n\r\n%x\r\n%b\r\n0\r\nX-Trailer: t\r\n\r\n" % (len(body), body)
    ).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as resp:
                assert resp.status == 200
                assert await resp.read() == body
                assert "X-Trailer" not in resp.headers, resp.headers
    finally:
        await replica.stop()


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_an_answer_without_a_body_is_relayed_without_framing(status: bytes) -> None:
    """A 204 or 304 has no body and carries neither ``Content-Length`` (RFC 9110 8.6: a
    server must not send one with a 204; a 304's would name another answer's size) nor
    chunked framing: the router relayed both with ``Content-Length: 0``. The connection
    stays usable for the client's next request."""
    body = b'{"id": "c1", "choices": [{"index": 0, "message": {"content": "hi"}}]}'
    replica = await Canned(
        b"HTTP/1.1 %b\r\nX-Replica: r0\r\n\r\n" % status,
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        % (len(body), body),
    ).start()
    try:
        async for url, _ in _router(replica.url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            payload = json.dumps(_chat(False)).encode()
            request = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
                % (len(payload), payload)
            )
            writer.write(request)
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            assert head.startswith(b"http/1.1 " + status[:3]), head
            assert b"content-length" not in head and b"transfer-encoding" not in head, head
            writer.write(request)  # the same connection: the next answer reads whole
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            assert head.startswith(b"http/1.1 200"), head
            assert await reader.readexactly(len(body)) == body
            writer.close()
    finally:
        await replica.stop()


@pytest.mark.parametrize("idle", [False, True], ids=["with-the-answer", "while-idle"])
async def test_a_second_answer_nobody_asked_for_is_never_taken_for_one(idle: bool) -> None:
    """A replica (or a balancer before it) that sends an answer nobody asked for on a
    keep-alive connection (a 408 as it times the connection out), right behind the real
    answer or later while the connection idles in the pool: it must neither replace the
    real answer nor be read as the next request's; the connection is dropped."""
    answer = json.dumps({"id": "c", "object": "chat.completion", "choices": []}).encode()
    spoke, relayed = asyncio.Event(), asyncio.Event()
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        first = connections == 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + b"Content-Length: %d\r\n\r\n" % len(answer)
                    + answer
                )
                await writer.drain()
                if first:  # then it times the connection out unprompted
                    first = False
                    if idle:
                        await relayed.wait()
                    writer.write(
                        b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n"
                        b"Connection: close\r\n\r\n"
                    )
                    await writer.drain()
                    sock: socket.socket = writer.get_extra_info("socket")
                    await eventually(lambda s=sock: _unacknowledged(s) == 0)
                    spoke.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async for url, session in _router(f"http://127.0.0.1:{port}"):
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as r:
                assert r.status == 200, await r.text()
                assert await r.read() == answer
            relayed.set()
            await spoke.wait()
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as r:
                assert r.status == 200, await r.text()
                assert await r.read() == answer
        assert connections == 2
    finally:
        server.close()
        await server.wait_closed()


class CutsFirstAnswer:
    """Raw replicas sharing one count of requests: the first request any of them gets is
    answered a 200 whose ``Content-Length`` body breaks off after ``sent`` bytes (the
    connection closed); every later one gets the whole JSON answer."""

    def __init__(self, length: int, sent: int) -> None:
        self.length = length
        self.sent = sent
        self.requests = 0
        self._servers: list[asyncio.Server] = []

    async def url(self) -> str:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        self.requests += 1
        pad = b"x" * (self.length - len(b'{"object":"chat.completion","x_pad":""}'))
        body = b'{"object":"chat.completion","x_pad":"' + pad + b'"}'
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
        )
        writer.write(body if self.requests > 1 else body[: self.sent])
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()


async def test_a_large_answer_that_breaks_off_before_the_client_got_a_byte_is_retried() -> None:
    """A non-streamed answer is held until it is whole, so one that breaks off is retried
    on the next replica whatever its size. One larger than the read buffer was let through
    once the buffer filled (the head not sent yet): its break was answered 502, with no
    retry and no failure counted against the replica."""
    replicas = CutsFirstAnswer(3 * HIGH_WATER, 2 * HIGH_WATER)
    urls = [await replicas.url(), await replicas.url()]
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": u, "model": MODEL, "name": f"r{i}"} for i, u in enumerate(urls)],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json=_chat(False)) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert len(body["x_pad"]) > 2 * HIGH_WATER
            assert replicas.requests == 2
            outcomes = await _outcomes(url, session)
            assert outcomes == {"upstream_broken": 1.0, "ok": 1.0}, outcomes
    finally:
        await running.cleanup()
        await replicas.stop()
