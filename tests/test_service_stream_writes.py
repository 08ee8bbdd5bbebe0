"""Streams relayed in as few writes as the replica's timing allows (router/service/answer_relay.py
``AnswerRelay.relay``): a replica that sends head, events and end in one go, one that sends the head
first and the events with the end, one that ends a stream without data, and one that sends
every piece on its own. The client must get the same events and a well-framed stream each
time, on both HTTP engines."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from router.service.config import build_settings
from tests.backends import kimi_model_table, start_router
from tests.waiting import eventually

MODEL = "kimi-test"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _events(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        delta = {"content": f"tok{i} "}
        ev = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        out.append(b"data: " + json.dumps(ev).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def _dechunk(body: bytes) -> bytes:
    """The data of a chunked body that must end right after its terminating chunk."""
    out, pos = b"", 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol], 16)
        if size == 0:
            assert body[eol:] == b"\r\n\r\n", body[eol:]
            return out
        out += body[eol + 2 : eol + 2 + size]
        assert body[eol + 2 + size : eol + 4 + size] == b"\r\n"
        pos = eol + 4 + size


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"


class _Replica(asyncio.Protocol):
    """Answers every request with a stream whose pieces are written as ``mode`` says."""

    mode = "one_write"
    release = asyncio.Event()  # "keep_alive": sends the events once set

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length :]
        asyncio.get_running_loop().create_task(self._answer())

    async def _answer(self) -> None:
        body = b"".join(_chunk(e) for e in _events(3))
        w = self.transport.write
        if self.mode == "one_write":
            w(HEAD + body + END)
        elif self.mode == "head_first":
            w(HEAD)
            await asyncio.sleep(0.05)
            w(body + END)
        elif self.mode == "no_data":
            w(HEAD + END)
        elif self.mode == "keep_alive":  # vLLM --sse-keep-alive-interval: a comment first
            w(HEAD + _chunk(b": keep-alive\n\n"))
            await _Replica.release.wait()
            w(body + END)
        elif self.mode == "late_end":  # every event at once, the end of the body 0.3 s later
            w(HEAD + body)
            await asyncio.sleep(0.3)
            w(END)
        else:  # "piecewise": head, each event, the end, each on its own
            w(HEAD)
            for e in _events(3):
                await asyncio.sleep(0.01)
                w(_chunk(e))
            await asyncio.sleep(0.01)
            w(END)


@pytest.fixture(params=["fast"])
async def routed(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Replica, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},  # the stub answers completions only
            "replicas": [{"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": "r0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings, str(request.param))
    try:
        yield url
    finally:
        await runner.cleanup()
        server.close()
        _Replica.mode = "one_write"


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize("mode", ["one_write", "head_first", "piecewise"])
async def test_events_reach_the_client_whole(routed: str, mode: str) -> None:
    _Replica.mode = mode
    client = openai.AsyncOpenAI(base_url=routed + "/v1", api_key="x", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    finally:
        await client.close()
    assert text == "tok0 tok1 tok2 "
    # the body byte for byte, and the keep-alive connection still usable after it
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(routed + "/v1/chat/completions", json=BODY) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                assert await resp.read() == b"".join(_events(3))


async def test_a_stream_without_data(routed: str) -> None:
    _Replica.mode = "no_data"
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(routed + "/v1/chat/completions", json=BODY) as resp:
                assert resp.status == 200
                assert await resp.read() == b""


async def test_raw_framing_of_a_stream_sent_in_one_piece(routed: str) -> None:
    """Raw socket: the chunked body the client gets ends with the last event and the
    terminating chunk, and nothing follows it. (How many writes it took is a performance
    matter: docs/bench-service.md measures it.)"""
    host, port = routed.removeprefix("http://").split(":")
    payload = json.dumps(BODY).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        await writer.drain()
        got = b""
        while not got.endswith(b"\r\n0\r\n\r\n"):
            more = await asyncio.wait_for(reader.read(65536), 5)
            assert more, got[-200:]
            got += more
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding: chunked" in head.lower()
        assert _dechunk(body) == b"".join(_events(3))
        # nothing more arrives on the kept-alive connection
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.2)
    finally:
        writer.close()


async def test_a_client_that_leaves_after_the_last_event_got_the_whole_answer(
    routed: str,
) -> None:
    """An SSE client may close at ``[DONE]``, before the replica's end of the body reaches
    the router: the request still counts as ``ok`` (not ``cancelled``) and still counts."""
    _Replica.mode = "late_end"
    host, port = routed.removeprefix("http://").split(":")
    payload = json.dumps(BODY).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload)
    )
    got = b""
    while b"data: [DONE]" not in got:
        more = await asyncio.wait_for(reader.read(65536), 5)
        assert more, got[-200:]
        got += more
    writer.close()  # gone before the end of the body

    async def outcomes_counted() -> dict[str, str]:
        async with aiohttp.ClientSession() as http:
            page = await (await http.get(routed + "/metrics")).text()
        return dict(
            re.findall(r'^kvrouter_requests_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', page, re.M)
        )

    await eventually(outcomes_counted)  # the router has closed the request's books
    outcomes = await outcomes_counted()
    assert outcomes.get("ok") == "1.0", outcomes
    assert "cancelled" not in outcomes, outcomes


async def test_a_keep_alive_comment_is_no_first_token() -> None:
    """vLLM with ``--sse-keep-alive-interval`` sends ``: keep-alive`` comments while a request
    queues or prefills: the client gets them, and the router keeps the request prefilling in
    its load model and times no first token until the first event."""
    from router.service.app import STATE

    loop = asyncio.get_running_loop()
    _Replica.mode, _Replica.release = "keep_alive", asyncio.Event()
    server = await loop.create_server(_Replica, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": "r0"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings)
    state = runner.app[STATE]
    key = state.registry.keys_for(MODEL)[0]
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/chat/completions", json=BODY) as r,
        ):
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            assert first == b": keep-alive\n\n"
            view = state.load.view(key, loop.time())
            assert (view.prefilling, view.decoding) == (1, 0)
            _Replica.release.set()
            rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n") and rest.count(b"data: ") == 4

        def settled() -> bool:
            v = state.load.view(key, loop.time())
            return v.in_flight == 0

        await eventually(settled)
    finally:
        await runner.cleanup()
        server.close()
        _Replica.mode = "one_write"
