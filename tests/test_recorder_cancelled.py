"""A request its client cancelled is a row of the live-traffic trace (router.recorder): the
load it offered, which a replay offers again. Real router and raw-socket replica on
loopback (tests/test_upstream_wire.py ``Scripted``); the client leaves mid-stream, or before
the answer's head."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
from pathlib import Path
from typing import Any

import aiohttp

from router.demo.replay import count_requests
from router.recorder import CLIENT_CLOSED
from sim.workload import mooncake_rows, offered
from tests.test_proxy_integrity import MODEL, _outcomes, _router
from tests.test_service_admission import _door
from tests.test_upstream_wire import SSE_HEAD, Scripted, _chat, _chunk, _token
from tests.waiting import eventually

# what a row of offered load without an outcome leaves out (router.recorder)
OUTCOME = ("replica", "pred_hit", "cached", "ttft_ms")


def _rows(trace: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


async def _cancelled(url: str, session: aiohttp.ClientSession) -> bool:
    return (await _outcomes(url, session)).get("cancelled", 0.0) == 1.0


async def test_a_stream_its_client_left_midway_is_a_row_of_offered_load(tmp_path: Path) -> None:
    """The client read the stream's first token and left. The defect: the request was no
    row at all (only answers and failures were), so a replay of an hour where clients gave
    up offered less load than the router was offered."""
    replica = await Scripted([SSE_HEAD + _chunk(_token(0)), _chunk(_token(1))]).start()
    trace = tmp_path / "trace.jsonl"
    try:
        settings = {"record_path": str(trace), "record_key": "k", "outlier_detection": False}
        async for url, session in _router(replica.url, **settings):
            async with aiohttp.ClientSession() as client:
                resp = await client.post(
                    url + "/v1/chat/completions", json=_chat(True, max_tokens=300)
                )
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")  # the first token
                resp.close()  # the client goes away mid-stream
            await eventually(functools.partial(_cancelled, url, session), timeout=20)
    finally:
        await replica.stop()
    (row,) = _rows(trace)
    assert row["status"] == CLIENT_CLOSED and row["stream"] is True, row
    assert row["endpoint"] == "chat" and "e2e_ms" in row
    assert not [k for k in OUTCOME if k in row], row
    assert row["output_length"] == 300  # offered: the request's max_tokens
    # the simulator and the live replay offer it again
    assert offered(row)
    assert [r.output_tokens for r in mooncake_rows(trace)] == [300]
    assert count_requests(trace, 100) == 1


async def test_a_request_its_client_left_before_the_answer_is_a_row(tmp_path: Path) -> None:
    """The replica had the request and sent nothing yet (a long prefill) when the client
    gave up: offered load too, not a stream (it asked for none)."""
    replica = await Scripted([b"", b""]).start()  # no answer until the test is over
    trace = tmp_path / "trace.jsonl"
    try:
        settings = {"record_path": str(trace), "record_key": "k", "outlier_detection": False}
        async for url, session in _router(replica.url, **settings):
            async with aiohttp.ClientSession() as client:
                body = _chat(False, max_tokens=9)
                post = asyncio.ensure_future(client.post(url + "/v1/chat/completions", json=body))
                await eventually(lambda: replica.sent.is_set(), timeout=20)
                post.cancel()  # the client goes away before the answer's head
                with contextlib.suppress(asyncio.CancelledError):
                    await post
            await eventually(functools.partial(_cancelled, url, session), timeout=20)
    finally:
        await replica.stop()
    (row,) = _rows(trace)
    assert row["status"] == CLIENT_CLOSED and row["stream"] is False, row
    assert not [k for k in OUTCOME if k in row], row
    assert row["output_length"] == 9
    assert [r.output_tokens for r in mooncake_rows(trace)] == [9]


async def test_a_request_its_client_left_while_admission_held_it_is_a_row(
    tmp_path: Path,
) -> None:
    """SLO-aware admission held the request (a priority one kept the replica busy) and its
    client gave up: offered load, as a request admission shed (429) is; no replica."""
    trace = tmp_path / "trace.jsonl"
    knobs = {
        "stall_share": [1e-9, 0.5, 0.5],
        "max_stall": [float("inf"), 1e-9, 1e-9],
        "max_hold_s": 60.0,
    }
    server = {"record_path": str(trace), "record_key": "k"}
    async for d in _door(knobs, {"ttft_s": 100.0}, server=server):
        await d.leave_while_held()
        assert len(d.backend.received) == 1  # the one that left was never sent
        await d.stop(10)
    rows = _rows(trace)
    assert sorted(str(row.get("status")) for row in rows) == [str(CLIENT_CLOSED), "None"], rows
    (gone,) = [row for row in rows if "status" in row]
    assert not [k for k in OUTCOME if k in gone], gone
    assert gone["output_length"] == 4 and gone["endpoint"] == "completions"
    assert len(mooncake_rows(trace)) == 2


async def test_a_request_its_client_left_during_the_prefill_leg_is_a_row(
    tmp_path: Path,
) -> None:
    """A disaggregated request whose client left while its prefill leg ran (the decode leg
    never sent): offered load, as on a replica of both phases."""
    from router.service.app import STATE
    from tests.backends import Backend, start_router
    from tests.test_pd_service import MODEL, _prompt, _stub_settings

    trace = tmp_path / "trace.jsonl"
    prefill = await Backend("p0", [MODEL], hang=True).start()
    decode = await Backend("d0", [MODEL]).start()
    settings = _stub_settings(
        prefill.url, [(decode.url, "decode")], record_path=str(trace), record_key="k"
    )
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        async with aiohttp.ClientSession() as client:
            body = {"model": MODEL, "prompt": _prompt(40), "stream": True, "max_tokens": 6}
            post = asyncio.ensure_future(client.post(url + "/v1/completions", json=body))
            await eventually(lambda: len(prefill.received) == 1, timeout=20)
            post.cancel()  # the client goes away during the prefill leg
            with contextlib.suppress(asyncio.CancelledError):
                await post
        await eventually(lambda: prefill.cancelled == 1, timeout=20)
        await eventually(lambda: not state.load._flights, timeout=20)
    finally:
        await router.cleanup()
        await prefill.stop()
        await decode.stop()
    (row,) = _rows(trace)
    assert row["status"] == CLIENT_CLOSED and row["stream"] is True, row
    assert not [k for k in OUTCOME if k in row], row
    assert row["output_length"] == 6 and row["input_length"] == 3000
    assert not decode.received


async def test_a_pick_its_caller_left_while_admission_held_it_is_a_row(tmp_path: Path) -> None:
    """A gRPC Pick held by admission whose caller left: offered load, as on HTTP."""
    import grpc

    from router.rpc.gen import router_pb2, router_pb2_grpc
    from router.service.keys import GRPC_PORT
    from tests.test_service_admission import CROWDED, MODEL, PROMPT

    trace = tmp_path / "trace.jsonl"
    server = {"record_path": str(trace), "record_key": "k", "grpc_port": 0}
    async for d in _door(dict(CROWDED, max_queue=1024), {"ttft_s": 100.0}, server=server):
        first, held = await d.one_held()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}")
        try:
            stub = router_pb2_grpc.RouterStub(channel)
            body = '{"prompt": "' + PROMPT + '", "max_tokens": 5}'
            pick = router_pb2.PickRequest(
                model=MODEL, request_json=body, request_path="/v1/completions"
            )
            picked = stub.Pick(pick, timeout=60)
            await eventually(lambda door=d: door.held() == 2)
            picked.cancel()  # the caller leaves while its Pick is held
            await eventually(lambda door=d: door.held() == 1)
        finally:
            await channel.close()
        d.backend.gate.set()
        async with await first as r:
            assert r.status == 200
        async with await held as r:
            assert r.status == 200
        await d.stop(10)
    rows = _rows(trace)
    (gone,) = [row for row in rows if "status" in row]
    assert len(rows) == 3 and gone["status"] == CLIENT_CLOSED, rows
    assert not [k for k in OUTCOME if k in gone], gone
    assert gone["output_length"] == 5 and gone["endpoint"] == "completions"


async def test_an_answer_its_client_left_while_it_was_sent_keeps_its_length(
    tmp_path: Path,
) -> None:
    """The replica's non-streamed answer was with the router whole (usage and all) and the
    client, which took none of it, left while the router still handed it over. The defect:
    the row's output length was the request's max_tokens (300), though the engine had
    reported the 4 tokens it produced, so a replay offered 75 times the decode work."""
    from tests.backends import Backend

    backend = await Backend("r0", [MODEL], pad_bytes=8 << 20).start()  # past any buffer
    trace = tmp_path / "trace.jsonl"
    loop = asyncio.get_running_loop()
    try:
        settings = {"record_path": str(trace), "record_key": "k", "outlier_detection": False}
        async for url, session in _router(backend.url, **settings):
            host, port = url.removeprefix("http://").split(":")
            client = socket.socket()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # takes little
            client.setblocking(False)
            try:
                await loop.sock_connect(client, (host, int(port)))
                await loop.sock_sendall(client, _post(_chat(False, max_tokens=300)))
                # the answer's first bytes: the router has the whole answer and is sending it
                await eventually(functools.partial(_has_data, client), timeout=20)
            finally:
                client.close()  # the client leaves with the answer unread
            await eventually(functools.partial(_cancelled, url, session), timeout=20)
    finally:
        await backend.stop()
    (row,) = _rows(trace)
    assert row["status"] == CLIENT_CLOSED and row["stream"] is False, row
    assert not [k for k in OUTCOME if k in row], row
    assert row["output_length"] == 4  # the engine's usage, not max_tokens
    assert [r.output_tokens for r in mooncake_rows(trace)] == [4]


def _has_data(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def _post(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )
