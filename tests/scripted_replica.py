"""A replica whose stream a test writes itself (``script``), over loopback HTTP, and the SSE
events it writes: for the clients that time answers (the live replay, the overload and
reliability benches) to be checked against one known stream."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from tests.ports import free_port

Script = Callable[[web.StreamResponse], Awaitable[None]]
GAP_S = 0.3  # a pause a script takes (a lower bound only: never flaky)
DONE = b"data: [DONE]\n\n"


def event(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def token(text: str, finish: str | None = None) -> bytes:
    """A completion chunk carrying ``text``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return event({"id": "c", "object": "text_completion", "choices": [choice]})


def usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    """The usage chunk (no choices) a stream asked for it ends with."""
    counts = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return event({"id": "c", "choices": [], "usage": counts})


@contextlib.asynccontextmanager
async def scripted_replica(
    script: Script, bodies: list[Any] | None = None, content_type: str = "text/event-stream"
) -> AsyncIterator[str]:
    """The base URL of a replica answering ``POST /v1/completions`` with an event stream
    (or another ``content_type``: a JSON answer) that ``script`` writes to each request's
    response; the JSON bodies it received go to ``bodies``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if bodies is not None:
            bodies.append(json.loads(body))
        resp = web.StreamResponse(headers={"Content-Type": content_type})
        await resp.prepare(request)
        await script(resp)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
