"""SSE framing the relay must read as any SSE client would (router/service/answer_relay.py,
router/service/stream_usage.py, router/service/answers.py): events ended by CRLF blank lines,
``data:`` fields without the optional space. Raw-socket replicas (tests/test_upstream_wire.py
``Scripted``, tests/test_proxy_integrity.py ``UntilClose``) send exact bytes over loopback."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from tests.backends import metric_sample
from tests.test_proxy_integrity import UntilClose, _outcomes, _router
from tests.test_upstream_wire import (
    MODEL,
    SSE_HEAD,
    USAGE,
    Scripted,
    _answered,
    _chat,
    _chunk,
    cut_inside_an_event,
)
from tests.test_upstream_wire import _token as _lf_token


def _crlf(event: bytes) -> bytes:
    return event.replace(b"\n\n", b"\r\n\r\n")


def _token(i: int) -> bytes:
    return _crlf(_lf_token(i))


DONE = b"data: [DONE]\r\n\r\n"


async def test_a_crlf_stream_keeps_the_routers_usage_chunk_from_the_client() -> None:
    """An SSE stream may end its lines with CRLF (sse-starlette does, by default). The
    router asks every stream for usage and must take the usage chunk out for a client that
    did not ask: on a CRLF stream the filter stood aside and the client got a chunk with
    ``choices: []`` (``chunk.choices[0]`` raises in the usual client loop)."""
    tokens = _token(0) + _token(1)
    replica = await Scripted(
        [SSE_HEAD + _chunk(tokens + _crlf(USAGE) + DONE) + b"0\r\n\r\n"]
    ).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                body = await resp.read()
            assert body == tokens + DONE, body
            page = await _answered(url, session)
            assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 32
    finally:
        await replica.stop()


@pytest.mark.parametrize("usage", [False, True], ids=["usage-added", "usage-asked"])
async def test_a_crlf_stream_cut_inside_an_event_ends_with_a_clean_error_event(
    usage: bool,
) -> None:
    """A CRLF stream that breaks off inside an event: the half event must wait for its end
    (never relayed), so the client reads the router's error event; it went out at once and
    the error event was glued to it (a ``JSONDecodeError`` in the client)."""
    await cut_inside_an_event(_token, usage)


NO_SPACE = b'data:{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}\n\n'


async def test_a_done_without_the_space_ends_a_stream_delimited_by_the_connection() -> None:
    """``data:[DONE]`` is the same event as ``data: [DONE]`` (the space after the colon is
    optional, and every SSE client drops it): a stream delimited by the connection's end
    that ended so was taken as broken off, an error event written after its ``[DONE]``, the
    client's connection aborted and the answer counted ``upstream_broken``."""
    replica = await UntilClose(b"text/event-stream", NO_SPACE).start()
    try:
        async for url, session in _router(replica.url):
            async with session.post(url + "/v1/chat/completions", json=_chat(True)) as resp:
                assert resp.status == 200
                assert await resp.content.readuntil(b"\n\n") == NO_SPACE
                replica.finish(b"data:[DONE]\n\n", reset=False)
                body = await resp.read()
            assert body == b"data:[DONE]\n\n", body
            outcomes = await _outcomes(url, session)
            assert outcomes.get("ok") == 1.0 and "upstream_broken" not in outcomes, outcomes
    finally:
        await replica.stop()


async def test_an_error_event_without_the_space_is_no_good_answer() -> None:
    """The engine's error event spelled ``data:{"error":...}`` is the same error event: the
    client got an error, which was booked ``ok`` and judged against the SLO."""
    error = b'data:{"error":{"message":"engine died","type":"InternalServerError"}}\n\n'
    replica = await Scripted(
        [SSE_HEAD + _chunk(_lf_token(0) + error + b"data:[DONE]\n\n") + b"0\r\n\r\n"]
    ).start()
    try:
        async for url, session in _router(replica.url):
            body = _chat(True, stream_options={"include_usage": True})
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.read()).endswith(b"data:[DONE]\n\n")
            page = await _answered(url, session, "upstream_error")
            assert metric_sample(page, "kvrouter_requests_total", outcome="ok") is None
    finally:
        await replica.stop()


async def test_a_client_leaving_after_a_done_without_the_space_got_the_whole_answer() -> None:
    """A client that stops reading at ``data:[DONE]`` has the whole answer (``ok``), as one
    that stops at ``data: [DONE]``; it was counted ``cancelled``."""
    replica = await Scripted(
        [SSE_HEAD + _chunk(NO_SPACE + b"data:[DONE]\n\n"), b"0\r\n\r\n"]
    ).start()
    try:
        async for url, session in _router(replica.url):
            async with (
                aiohttp.ClientSession() as client,
                client.post(url + "/v1/chat/completions", json=_chat(True)) as resp,
            ):
                got = b""
                while not got.endswith(b"data:[DONE]\n\n"):
                    got += await resp.content.readany()
            # the client is gone before the replica's end of the body
            await _answered(url, session, "ok")
            replica.step()
    finally:
        await replica.stop()


def _responses_stream(crlf: bool, colon: bytes) -> list[bytes]:
    """A Responses API stream (vLLM's events) whose final event, larger than the tail the
    relay keeps of a stream, arrives in two reads; its usage says 32 cached tokens."""
    events = [
        (b"response.created", {"response": {"id": "resp_9", "status": "in_progress"},
                               "type": "response.created"}),
        (b"response.output_text.delta", {"delta": "hi", "type": "response.output_text.delta"}),
    ]  # fmt: skip
    text = "y" * 20_000
    final = {
        "response": {
            "id": "resp_9",
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}],
            "usage": {"input_tokens": 40, "output_tokens": 60, "total_tokens": 100,
                      "input_tokens_details": {"cached_tokens": 32},
                      "output_tokens_details": {"reasoning_tokens": 0}},
        },
        "type": "response.completed",
    }  # fmt: skip
    nl = b"\r\n" if crlf else b"\n"

    def event(name: bytes, data: dict[str, Any]) -> bytes:
        body = json.dumps(data, separators=(",", ":")).encode()
        return b"event" + colon + name + nl + b"data" + colon + body + nl + nl

    last = event(b"response.completed", final)
    half = len(last) // 2
    head = SSE_HEAD + _chunk(b"".join(event(n, d) for n, d in events))
    return [head, _chunk(last[:half]), _chunk(last[half:]) + b"0\r\n\r\n"]


@pytest.mark.parametrize(
    ("crlf", "colon"), [(False, b": "), (True, b": "), (False, b":")], ids=["lf", "crlf", "nospace"]
)
async def test_a_responses_streams_large_final_event_gives_its_usage(
    crlf: bool, colon: bytes
) -> None:
    """A Responses stream's final event carries the whole response, its usage last: the
    relay keeps it whole, however large, once it saw its ``event: response.completed``
    line. It looked for that line ended by LF after ``event: `` only: on a CRLF stream (or
    ``event:response.completed``) it kept the stream's last 8 KiB by whole reads, the
    final event's start was dropped, and its usage with it (no cached-token feedback)."""
    script = _responses_stream(crlf, colon)
    replica = await Scripted(script).start()
    try:
        async for url, session in _router(replica.url):
            body = {"model": MODEL, "input": "tell me everything", "stream": True}
            async with session.post(url + "/v1/responses", json=body) as resp:
                assert resp.status == 200, await resp.text()
                got = await resp.content.readany()
                for _ in script[1:]:
                    replica.step()
                    await replica.sent.wait()
                got += await resp.read()
            assert got.rstrip().endswith(b'"type":"response.completed"}'), got[-200:]
            page = await _answered(url, session)
            assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 32
    finally:
        await replica.stop()


async def test_a_stream_whose_media_type_is_not_lower_case_is_relayed_as_it_comes() -> None:
    """Media types are case-insensitive (RFC 9110 8.3.1): a ``Text/Event-Stream`` answer is
    a stream, relayed event by event. Read as a plain body it was held whole until the
    replica ended it, so the client saw no token before the last one."""
    head = SSE_HEAD.replace(b"text/event-stream", b"Text/Event-Stream")
    replica = await Scripted(
        [
            head + _chunk(_lf_token(0)),
            _chunk(_lf_token(1) + USAGE + b"data: [DONE]\n\n"),
            b"0\r\n\r\n",
        ]
    ).start()
    try:
        async for url, _session in _router(replica.url):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "go"}], stream=True
            )
            got = []
            async for part in stream:  # the next piece is sent only once this one arrived
                got.append(part.choices[0].delta.content)
                replica.step()
                replica.step()
            assert got == ["word0000 " + "x" * 200, "word0001 " + "x" * 200]
            await client.close()
    finally:
        await replica.stop()
