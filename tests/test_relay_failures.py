"""What the relay makes of a replica's answers (router/service/answer_relay.py,
router/service/proxy.py, router/service/upstream.py): a failed one is a row of offered load
in the live-traffic trace, an error answer's body is read under the request's timeouts once
its head came, and a keep-alive comment that arrives in pieces is no token. Raw-socket
replicas (tests/test_upstream_wire.py ``Scripted``) send exact bytes over loopback, in
pieces the test releases."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.demo.replay import count_requests
from router.service.answers import EventLines
from router.service.retry import expected_first_byte_s, first_byte_deadline
from sim.workload import mooncake_rows
from tests.backends import metric_sample
from tests.test_proxy_integrity import _router
from tests.test_upstream_wire import (
    MODEL,
    SSE_HEAD,
    USAGE,
    Scripted,
    _answered,
    _chat,
    _chunk,
    _token,
)
from tests.waiting import eventually

DONE = b"data: [DONE]\n\n"
# what a row of offered load without an outcome leaves out (router.recorder)
OUTCOME = ("replica", "pred_hit", "cached", "ttft_ms")


def _json_answer(status: bytes, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )


def _error(code: int) -> dict[str, Any]:
    return {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": code}}


def _rows(trace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


async def test_a_replicas_failed_answers_are_rows_of_offered_load(tmp_path: Path) -> None:
    """A request whose replica answered an error status, broke off its stream or ended it
    with the engine's error event was no row of the trace: a replay of a faulty hour
    offered less load than the router was offered. Each is a row now, with the status the
    client learnt and no outcome, as a request the router shed is."""
    error_event = b'data: {"error":{"message":"engine died","type":"InternalServerError"}}\n\n'
    replica = await Scripted(
        [SSE_HEAD + _chunk(_token(0) + USAGE + DONE) + b"0\r\n\r\n"],
        [_json_answer(b"400 Bad Request", _error(400))],
        [_json_answer(b"500 Internal Server Error", _error(500))],
        [SSE_HEAD + _chunk(_token(1)) + b"zz\r\n"],  # framing broken mid-stream
        [SSE_HEAD + _chunk(_token(2) + error_event + DONE) + b"0\r\n\r\n"],
    ).start()
    trace = tmp_path / "trace.jsonl"
    statuses = []
    try:
        settings = {"record_path": str(trace), "record_key": "k", "outlier_detection": False}
        async for url, session in _router(replica.url, **settings):
            for i in range(5):
                body = _chat(i != 2, max_tokens=500)
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    statuses.append(resp.status)
                    with contextlib.suppress(aiohttp.ClientPayloadError):
                        await resp.read()  # (a stream that broke off: its connection too)
            await _answered(url, session, "upstream_error")
    finally:
        await replica.stop()
    assert statuses == [200, 400, 500, 200, 200]
    rows = _rows(trace)
    assert [row.get("status") for row in rows] == [None, 400, 500, 502, 502], rows
    assert rows[0]["output_length"] == 60 and "replica" in rows[0]
    for row in rows[1:]:
        assert not [k for k in OUTCOME if k in row], row
        assert row["output_length"] == 500  # offered: the request's max_tokens
        assert "e2e_ms" in row
    assert [row["stream"] for row in rows] == [True, True, False, True, True]
    # the simulator and the live replay offer every row again, as they do a shed one, but
    # the replica's 400 (the client's error, as one the router refuses itself: no row)
    assert [r.output_tokens for r in mooncake_rows(trace)] == [60, 500, 500, 500]
    assert count_requests(trace, 100) == 4


@pytest.mark.parametrize("replica", ["silent", "refusing"])
async def test_a_request_no_replica_answered_is_a_row_of_offered_load(
    tmp_path: Path, replica: str
) -> None:
    """A request whose every attempt failed (no first byte in time: 504; a refused
    connection: 502) got the router's error and was no row of the trace."""
    scripted = await Scripted([b"", b""]).start()  # nothing, until the test is over
    if replica == "refusing":
        await scripted.stop()  # nothing listens at its address any more
    trace = tmp_path / "trace.jsonl"
    settings = {
        "record_path": str(trace),
        "record_key": "k",
        "first_byte_min_s": 0.2,
        "first_byte_factor": 0.01,
        "max_retries": 0,
    }
    try:
        async for url, session in _router(scripted.url, **settings):
            body = _chat(False, max_tokens=7)
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                status = resp.status
                await resp.read()
            scripted.step()
    finally:
        await scripted.stop()
    assert status == (504 if replica == "silent" else 502)
    (row,) = _rows(trace)
    assert row["status"] == status and row["stream"] is False and row["output_length"] == 7
    assert not [k for k in OUTCOME if k in row], row


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


def _comments(split: str) -> tuple[bytes, bytes]:
    """A whole comment and the keep-alive comment, their lines ended as ``split`` says."""
    if split == "crlf":
        return b": ping\r\n\r\n", b": keep-alive\r\n\r\n"
    return b": ping\n\n", b": keep-alive\n\n"


def _keep_alive_pieces(split: str) -> list[bytes]:
    """A stream whose keep-alive comment is cut into two reads; a whole comment goes
    before the first piece, so the client's copy of it shows the relay has read the piece."""
    ping, comment = _comments(split)
    at = {"colon": 1, "word": 7, "crlf": 13}[split]
    return [
        SSE_HEAD + _chunk(ping + comment[:at]),
        _chunk(comment[at:]),
        _chunk(_token(0) + USAGE + DONE) + b"0\r\n\r\n",
    ]


@pytest.mark.parametrize("split", ["colon", "word", "crlf"])
async def test_a_keep_alive_comment_in_pieces_is_no_first_token(split: str) -> None:
    """vLLM's ``: keep-alive`` comment (``--sse-keep-alive-interval``) cut across two
    reads: the second piece (`` keep-alive``, ``alive``) was taken for the first token,
    ending the request's prefill in the load model and timing its TTFT from a comment.
    Only whole lines are judged now."""
    ping, comment = _comments(split)
    replica = await Scripted(_keep_alive_pieces(split)).start()
    try:
        async for url, session in _router(replica.url):
            body = _chat(True, stream_options={"include_usage": True})
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                got = b""
                while got != ping:
                    got += await resp.content.readany()
                replica.step()  # the comment's second piece
                while got != ping + comment:
                    got += await resp.content.readany()
                # the relay read the whole comment, and took no token from it
                async with session.get(url + "/metrics") as r:
                    page = await r.text()
                assert not metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL)
                replica.step()
                rest = await resp.read()
            assert rest.startswith(_token(0)) and rest.endswith(DONE)
            page = await _answered(url, session, "ok")
            assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 1.0
    finally:
        await replica.stop()


def test_only_whole_lines_of_data_are_judged() -> None:
    """Which pieces of a stream end a line of data (router.service.answers ``EventLines``),
    whatever the reads cut: a comment's pieces never do, a data line does where it ends,
    and lines may end with LF, CRLF or a bare CR."""
    cases = [
        ([b":", b" keep-alive\n\n", b"data: {}\n\n"], [False, False, True]),
        ([b": keep-", b"alive\r", b"\n\r\n", b"data: {}\r\n\r\n"], [False, False, False, True]),
        ([b"da", b"ta: {", b"}\n", b"\n"], [False, False, True, False]),
        ([b": ping\r\rdata: {}\r\r"], [True]),  # bare CR line ends
        ([b": ping\n\ndata: {", b"}\n\n"], [False, True]),
        ([b"\n", b"\r\n", b"event: x\n"], [False, False, True]),
    ]
    for pieces, want in cases:
        lines = EventLines()
        assert [lines.data_ended(p) for p in pieces] == want, pieces
