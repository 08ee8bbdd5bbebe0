"""What the router reads of its replicas' HTTP/1.1 answers, byte for byte: a raw-socket
replica sends exact bytes, in pieces the test releases one at a time (each acknowledged by
the router's kernel before the next goes), and what the client got and the router's
metrics show what the router made of them."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.backends import metric_sample
from tests.test_proxy_integrity import _read_request, _router, _unacknowledged
from tests.waiting import eventually

MODEL = "kimi-test"


class Scripted:
    """A keep-alive replica that answers its n-th request with the n-th script, a list of
    byte pieces: the first goes at once, each next one when the test calls :meth:`step`."""

    def __init__(self, *scripts: list[bytes]) -> None:
        self.scripts = list(scripts)
        self.connections = 0
        self.url = ""
        self._steps: asyncio.Queue[None] = asyncio.Queue()
        self.sent = asyncio.Event()  # the pieces released so far are all with the router
        self._server: asyncio.Server | None = None

    async def start(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def step(self) -> None:
        self.sent.clear()
        self._steps.put_nowait(None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        sock: socket.socket = writer.get_extra_info("socket")
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while self.scripts:
                await _read_request(reader)
                for i, piece in enumerate(self.scripts.pop(0)):
                    if i:
                        await self._steps.get()
                    writer.write(piece)
                    await writer.drain()
                    await eventually(lambda: _unacknowledged(sock) == 0)
                    self.sent.set()
        writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def _chat(stream: bool, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "messages": [{"role": "user", "content": "tell me everything"}],
        **extra,
    }


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _token(i: int) -> bytes:
    delta = {"content": f"word{i:04d} " + "x" * 200}
    event = {"id": "c1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "finish_reason": None}
    ]}  # fmt: skip
    return b"data: " + json.dumps(event).encode() + b"\n\n"


USAGE = (
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":'
    b'{"prompt_tokens":40,"completion_tokens":60,"total_tokens":100,'
    b'"prompt_tokens_details":{"cached_tokens":32}}}\n\n'
)


async def _answered(url: str, session: aiohttp.ClientSession, outcome: str = "ok") -> str:
    """The router's metrics page once it booked one answer with ``outcome`` (its usage
    read)."""
    page = ""

    async def booked() -> bool:
        nonlocal page
        async with session.get(url + "/metrics") as r:
            page = await r.text()
        return metric_sample(page, "kvrouter_requests_total", outcome=outcome) == 1.0

    await eventually(booked)
    return page


async def test_a_usage_chunk_split_after_a_large_read_is_still_read() -> None:
    """The relay keeps a stream's last ~8 KiB for its usage, trimmed by whole reads: when a
    read larger than that ended with the first half of the usage chunk, the next read (the
    other half) dropped it, and the usage (cached and output tokens: the prediction and SLO
    metrics) was lost."""
    tokens = b"".join(_token(i) for i in range(60))  # ~14 KiB in one read
    cut = USAGE.index(b'"prompt_tokens_details"')
    replica = await Scripted(
        [SSE_HEAD + _chunk(tokens + USAGE[:cut]), _chunk(USAGE[cut:] + b"data: [DONE]\n\n")
         + b"0\r\n\r\n"]
    ).start()  # fmt: skip
    try:
        async for url, session in _router(replica.url):
            body = _chat(True, stream_options={"include_usage": True})
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                got = b""
                # the relay has read the first piece (the half event waits for its end)
                while got != tokens:
                    got += await resp.content.readany()
                replica.step()
                got += await resp.read()
            assert got == tokens + USAGE + b"data: [DONE]\n\n"
            page = await _answered(url, session)
            assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 32
    finally:
        await replica.stop()


async def test_answers_are_asked_for_uncompressed() -> None:
    """The router reads answers (usage, error bodies, a stream's end), so it must get them
    uncompressed; it dropped the client's ``Accept-Encoding`` and sent none, which asks for
    any coding at all (RFC 9110, 12.5.3): a replica that took it so answered gzip, relayed
    as such, and its usage went unread."""
    answer = json.dumps(
        {"id": "c1", "object": "chat.completion", "choices": [], "usage": json.loads(
            USAGE[6:].strip())["usage"]}
    ).encode()  # fmt: skip

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        fields = dict(
            (k.strip().lower(), v.strip().lower())
            for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        )
        # no Accept-Encoding: any coding is acceptable (RFC 9110, 12.5.3)
        plain = fields.get(b"accept-encoding", b"*") == b"identity"
        body = answer if plain else gzip.compress(answer)
        coding = b"" if plain else b"Content-Encoding: gzip\r\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%b"
            b"Content-Length: %d\r\n\r\n%b" % (coding, len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        url_of = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async for url, session in _router(url_of):
            headers = {"Accept-Encoding": "gzip"}
            async with session.post(
                url + "/v1/chat/completions", json=_chat(False), headers=headers
            ) as resp:
                assert resp.status == 200
                assert await resp.read() == answer
            page = await _answered(url, session)
            assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 32
    finally:
        server.close()
        await server.wait_closed()


async def test_a_101_answer_is_a_broken_attempt_not_a_fatal_protocol_error(
    caplog: Any,
) -> None:
    """A replica that switches protocols unasked (101) broke its answer: the attempt fails
    as a malformed one does (the client gets the router's 502), without the event loop's
    "Fatal error on transport" traceback the parser's upgrade exception caused."""
    import logging

    switch = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    replica = await Scripted([switch]).start()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            async for url, session in _router(replica.url):
                async with session.post(url + "/v1/chat/completions", json=_chat(False)) as r:
                    assert r.status == 502, await r.text()
        assert not [rec for rec in caplog.records if rec.name == "asyncio"], caplog.text
    finally:
        await replica.stop()


async def test_a_stream_that_ends_with_the_engines_error_event_is_no_good_answer() -> None:
    """vLLM ends a stream that failed mid-way with its error event (``data: {"error":
    {...}}``, then ``[DONE]``): the client has an error, not an answer. It was booked
    ``ok`` and judged against the SLO like a whole answer; it is ``upstream_error`` and a
    miss of the SLO (``failed``: in goodput's denominator, as the live replay counts it)."""
    error = json.dumps(
        {"error": {"message": "engine died", "type": "InternalServerError", "param": None,
                   "code": 500}}, separators=(",", ":"),
    ).encode()  # fmt: skip
    replica = await Scripted(
        [SSE_HEAD + _chunk(_token(0) + b"data: " + error + b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n"]
    ).start()
    try:
        async for url, session in _router(replica.url):
            body = _chat(True, stream_options={"include_usage": True})
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data: [DONE]\n\n")
            page = await _answered(url, session, "upstream_error")
            assert metric_sample(page, "kvrouter_requests_total", outcome="ok") is None
            slo = "kvrouter_slo_requests_total"
            assert metric_sample(page, slo, model=MODEL, result="failed") == 1
            assert metric_sample(page, slo, model=MODEL, result="met") is None
    finally:
        await replica.stop()


async def test_a_stream_that_ends_with_the_engines_error_event_is_recorded_as_no_answer(
    tmp_path: Path,
) -> None:
    """A stream the engine ended with its error event is no completed request, so its row
    has no outcome (no replica, TTFT, usage), but it is offered load a replay must offer
    again: a row with the router's 502, its output the request's ``max_tokens``
    (router.service.answer_relay ``record_request``), as an error status is."""
    error = b'data: {"error":{"message":"engine died","type":"InternalServerError"}}\n\n'
    replica = await Scripted(
        [SSE_HEAD + _chunk(_token(0) + error + b"data: [DONE]\n\n") + b"0\r\n\r\n"],
        [SSE_HEAD + _chunk(_token(1) + USAGE + b"data: [DONE]\n\n") + b"0\r\n\r\n"],
    ).start()
    trace = tmp_path / "trace.jsonl"
    try:
        # (the router flushes its trace as it stops, when the loop below ends)
        async for url, session in _router(replica.url, record_path=str(trace), record_key="k"):
            for _ in range(2):
                body = _chat(True, max_tokens=500)
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            await _answered(url, session, "ok")
    finally:
        await replica.stop()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [row["output_length"] for row in rows] == [500, 60], rows
    assert [row.get("status") for row in rows] == [502, None], rows
    assert "replica" not in rows[0] and "ttft_ms" not in rows[0], rows


@pytest.mark.parametrize("usage", [False, True], ids=["usage-added", "usage-asked"])
async def test_a_stream_cut_inside_an_event_ends_with_a_clean_error_event(usage: bool) -> None:
    """A replica whose stream breaks off inside an event (its connection lost): the client
    gets the router's error event, which the openai client raises as an ``APIError``. The
    half event had gone out as it arrived when the router did not filter the stream (the
    client asked for usage itself), and the error event's line was glued to it: one
    garbled event, a ``JSONDecodeError`` in the client, the router's message lost."""
    await cut_inside_an_event(_token, usage)


async def cut_inside_an_event(token: Callable[[int], bytes], usage: bool) -> None:
    """A replica streams ``token(0)`` whole, then 60 bytes of ``token(1)`` and breaks off:
    the openai client must read the first token, then the router's error event."""
    replica = await Scripted([SSE_HEAD + _chunk(token(0)), _chunk(token(1)[:60])]).start()
    try:
        async for url, session in _router(replica.url):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "tell me everything"}],
                stream=True,
                **extra,
            )
            got = []
            with pytest.raises(openai.APIError, match="broke off the stream"):
                async for part in stream:
                    got.append(part.choices[0].delta.content)
                    replica.step()
            assert got == ["word0000 " + "x" * 200]
            await _answered(url, session, "upstream_broken")
            await client.close()
    finally:
        await replica.stop()


def test_each_apis_error_event_is_told_from_an_answer() -> None:
    """The error events of the three streaming APIs, wherever the tail begins; an answer
    whose text speaks of errors is none (its newlines are escaped inside the JSON)."""
    from router.service.answers import stream_error

    vllm = b'data: {"error":{"message":"x","type":"InternalServerError","code":500}}\n\n'
    anthropic = b'event: error\ndata: {"type":"error","error":{"type":"api_error"}}\n\n'
    failed = b'event: response.failed\ndata: {"type":"response.failed"}\n\n'
    for event in (vllm, anthropic, failed):
        assert stream_error(event)
        assert stream_error(_token(1) + event + b"data: [DONE]\n\n")
    text = json.dumps({"choices": [{"delta": {"content": '\ndata: {"error": 1}'}}]})
    assert not stream_error(b"data: " + text.encode() + b"\n\ndata: [DONE]\n\n")
    assert not stream_error(_token(2) + USAGE + b"data: [DONE]\n\n")


@pytest.mark.parametrize("where", ["head", "trailer", "fields"])
async def test_a_replica_head_over_the_cap_is_a_broken_answer(where: str) -> None:
    """A response head (or a chunked body's trailer section) that never ends, or of more
    fields than the server takes from a client, is a broken answer at the cap the router's
    server holds its clients to: it grew with every read (httptools gathers an unended line
    by repeated concatenation: quadratic CPU on the event loop) until the read timeout."""
    from router.service.http_connection import MAX_HEAD_BYTES, MAX_HEADERS
    from router.service.upstream import Pool, Target, Timeouts
    from router.service.upstream_errors import UpstreamBroken

    if where == "head":
        answer = b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * (MAX_HEAD_BYTES + 2**19)
    elif where == "trailer":
        answer = (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Long: "
            + b"a" * (MAX_HEAD_BYTES + 2**19)
        )
    else:
        answer = b"HTTP/1.1 200 OK\r\n" + b"x: v\r\n" * (MAX_HEADERS + 1) + b"\r\n"
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await _read_request(reader)
            writer.write(answer)  # and the connection stays open
            await done.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(Target("127.0.0.1", port), Timeouts(connect=3, read=30, total=60))
    try:
        with pytest.raises(UpstreamBroken, match=r"over|more than"):
            ex = await pool.send(b"GET / HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n")
            await ex.read_all()
    finally:
        done.set()
        pool.close()
        server.close()
        await server.wait_closed()


async def test_a_replicas_http_1_0_answer_with_transfer_encoding_is_not_pooled() -> None:
    """HTTP/1.0 has no transfer coding: a client that receives a 1.0 message with
    ``Transfer-Encoding`` must take its framing for faulty and close the connection after it
    (RFC 9112 6.1), whatever ``Connection: keep-alive`` says: an HTTP/1.0 hop before the
    replica may frame what follows otherwise. The connection was pooled and reused."""
    from router.service.upstream import Pool, Target, Timeouts

    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
                )
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(Target("127.0.0.1", port), Timeouts(connect=3, read=30, total=60))
    try:
        for _ in range(2):
            ex = await pool.send(b"GET / HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n")
            assert await ex.read_all() == b"ok"
            ex.release()
        assert connections == 2
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


async def test_a_replicas_transfer_coding_other_than_chunked_is_a_broken_answer() -> None:
    """The router asks for no transfer coding (it sends no ``TE``; RFC 9110 10.1.4): an
    answer with one but ``chunked`` is one it cannot read. llhttp undoes ``chunked`` alone,
    so a ``gzip, chunked`` body was taken for the payload, compressed, and relayed without
    its coding (``Transfer-Encoding`` is hop-by-hop): the client got gzip bytes as JSON."""
    from router.service.upstream import Pool, Target, Timeouts
    from router.service.upstream_errors import UpstreamBroken

    payload = gzip.compress(b'{"ok": true}')
    done = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await _read_request(reader)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: gzip, chunked\r\n\r\n" + _chunk(payload) + b"0\r\n\r\n"
            )
            await done.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = Pool(Target("127.0.0.1", port), Timeouts(connect=3, read=30, total=60))
    try:
        with pytest.raises(UpstreamBroken, match="transfer coding 'gzip'"):
            await pool.send(b"GET / HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n")
    finally:
        done.set()
        pool.close()
        server.close()
        await server.wait_closed()
