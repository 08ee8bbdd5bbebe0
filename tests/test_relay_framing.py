"""SSE framing the relay must read as any SSE client would (router/service/answer_relay.py,
router/service/stream_usage.py, router/service/answers.py): events ended by CRLF blank lines,
``data:`` fields without the optional space. Raw-socket replicas (tests/test_upstream_wire.py
``Scripted``, tests/test_proxy_integrity.py ``UntilClose``) send exact bytes over loopback."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.backends import metric_sample
from tests.test_proxy_integrity import _router
from tests.test_upstream_wire import MODEL, SSE_HEAD, USAGE, Scripted, _answered, _chat, _chunk
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
    replica = await Scripted([SSE_HEAD + _chunk(_token(0)), _chunk(_token(1)[:60])]).start()
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
