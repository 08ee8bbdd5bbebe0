"""What the relay makes of a replica's failures (router/service/answer_relay.py,
router/service/proxy.py, router/service/upstream.py): an error answer's body is read under
the request's timeouts once its head came. Raw-socket replicas (tests/test_upstream_wire.py
``Scripted``) send exact bytes over loopback, in pieces the test releases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from router.service.retry import expected_first_byte_s, first_byte_deadline
from tests.test_proxy_integrity import _router
from tests.test_upstream_wire import Scripted, _chat
from tests.waiting import eventually


def _json_answer(status: bytes, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )


def _error(code: int) -> dict[str, Any]:
    return {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": code}}


def _passed(at: float) -> Callable[[], bool]:
    """Whether the event loop's clock has passed ``at``."""
    loop = asyncio.get_running_loop()
    return lambda: loop.time() > at


@pytest.mark.parametrize("status", [b"400 Bad Request", b"500 Internal Server Error"])
async def test_an_error_body_after_the_first_byte_deadline_is_relayed(status: bytes) -> None:
    """A replica that sends an error answer's head at once and its body after the
    attempt's first-byte deadline: that deadline covered the body too, and the client got
    the router's 504 instead of the replica's error. Once the head came, the body is read
    under the request's timeouts."""
    code = int(status[:3])
    answer = _json_answer(status, _error(code))
    head, body = answer.split(b"\r\n\r\n", 1)
    replica = await Scripted([head + b"\r\n\r\n", body]).start()
    deadline = {"first_byte_min_s": 0.1, "first_byte_factor": 1.0, "outlier_detection": False}
    # the attempt's deadline, at most: its prompt is far shorter than 1000 tokens
    bound = first_byte_deadline(expected_first_byte_s(1000, 1000, 0, False, 1), 0.1, 1.0, 600)
    assert bound < 1.0
    try:
        async for url, session in _router(replica.url, max_retries=0, **deadline):
            request = session.post(url + "/v1/chat/completions", json=_chat(False, max_tokens=1))
            task = asyncio.ensure_future(request)
            await replica.sent.wait()  # the head is with the router, sent after the request
            # the attempt's first-byte deadline (< bound after it was sent) has passed
            await eventually(_passed(asyncio.get_running_loop().time() + 1.0))
            replica.step()
            async with await task as resp:
                assert resp.status == code
                assert await resp.json() == _error(code)
    finally:
        await replica.stop()
