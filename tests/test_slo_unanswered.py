"""Goodput's denominator in the service: a request that got no whole answer (shed by
admission, no replica left, a replica's 5xx, a stream the engine broke, a gRPC FAILED Report)
is a miss in ``kvrouter_slo_requests_total`` (``result="failed"``), as the simulator's and
``kvrouter bench live``'s goodput count it; a request the client got wrong (a 400) and one
whose client left are not judged. Real HTTP and gRPC on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from router.rpc.gen import router_pb2, router_pb2_grpc
from router.service.keys import GRPC_PORT
from tests.backends import metric_sample
from tests.test_grpc_parity import AUTH, _ids
from tests.test_grpc_parity import MODEL as RPC_MODEL
from tests.test_service_admission import MODEL, PROMPT, Door, _door
from tests.test_service_admission import tiered_grpc as tiered_grpc
from tests.waiting import eventually

SLO = "kvrouter_slo_requests_total"


async def _slo(d: Door) -> dict[str, float]:
    return await d.metric(SLO)


def _total(counts: dict[str, float]) -> float:
    return sum(counts.values())


async def test_a_shed_request_is_a_miss_in_goodputs_denominator(tiered_grpc: Door) -> None:
    """Admission sheds a short prompt (429) while a long one holds the replica, over HTTP
    and gRPC: two misses of tier ``le1000`` in their class. Before, they were in no SLO
    result, so the documented goodput (met over all SLO results) rose as admission shed."""
    d = tiered_grpc
    d.backend.gate = asyncio.Event()
    long_prompt = "The tides rise and fall with the moon, day after day. " * 4000
    first = asyncio.create_task(d.post(prompt=long_prompt))
    await eventually(lambda: len(d.backend.received) == 1)
    async with await d.post(stream=True) as r:
        assert r.status == 429, await r.text()
    async with await d.post(max_tokens="many") as r:  # the client's error: not judged
        assert r.status == 400, await r.text()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}")
    try:
        body = '{"prompt": "' + PROMPT + '", "max_tokens": 5}'
        path = "/v1/completions"
        pick = router_pb2.PickRequest(model=MODEL, request_json=body, request_path=path)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterStub(channel).Pick(pick, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await channel.close()
    key = f'{{class="default",model="{MODEL}",result="failed",tier="le1000"}}'
    assert (await _slo(d)).get(key) == 2.0
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200

    async def all_judged() -> bool:  # the long prompt's answer, and the two shed
        return _total(await _slo(d)) == 3.0

    await eventually(all_judged, 5.0)


@pytest.fixture
async def lone() -> AsyncIterator[Door]:
    """One replica, a TTFT target every answer meets."""
    async for d in _door({}, {"ttft_s": 100.0, "tpot_s": 100.0}):
        yield d


async def test_a_failed_answer_is_a_miss_and_a_client_error_is_not_judged(lone: Door) -> None:
    d = lone
    d.backend.fail_next, d.backend.fail_status = 1, 500
    async with await d.post() as r:
        assert r.status >= 500
    d.backend.fail_next, d.backend.fail_status = 1, 400
    async with await d.post() as r:
        assert r.status == 400
    async with await d.post() as r:
        assert r.status == 200
    met = f'{{class="default",model="{MODEL}",result="met",tier="any"}}'
    failed = f'{{class="default",model="{MODEL}",result="failed",tier="any"}}'

    async def judged() -> bool:
        counts = await _slo(d)
        return counts.get(met) == 1.0 and counts.get(failed) == 1.0 and _total(counts) == 2.0

    await eventually(judged, 5.0)


async def test_a_grpc_retry_is_one_request_timed_from_its_first_pick() -> None:
    """A gateway retries on a fallback as a new decision: ``FAILED`` for the first, then a
    Pick with the same ``request_id`` (docs/grpc.md). That is one request to its client: one
    SLO result, its TTFT from the first Pick (as HTTP times a retried request from its first
    attempt). It used to count a ``failed`` miss and an answer timed from the retry's Pick.
    A ``FAILED`` whose id is not picked again within ``RETRY_WINDOW_S`` is the miss; a
    ``REFUSED`` with a client's error status (400) is not judged."""
    from router.rpc.decisions import RETRY_WINDOW_S
    from tests.test_grpc_parity import _serve, _state, loop_clock

    state = _state(slo={"ttft_s": 5.0})
    shift = [0.0]
    report = router_pb2.ReportRequest
    async for channel in _serve(state, lambda: loop_clock() + shift[0]):
        stub = router_pb2_grpc.RouterStub(channel)

        async def pick(request_id: str, start: int, stub: Any = stub) -> str:
            ids = _ids(320, start=start)
            asked = router_pb2.PickRequest(model=RPC_MODEL, token_ids=ids, request_id=request_id)
            return str((await stub.Pick(asked, metadata=AUTH)).decision_id)

        first = await pick("r1", 0)
        await stub.Report(report(decision_id=first, phase=report.FAILED), metadata=AUTH)
        shift[0] += 6.0  # the retry's first token comes 6 s after the first Pick: missed
        again = await pick("r1", 0)
        for phase in (report.FIRST_TOKEN, report.COMPLETED):
            end = report(decision_id=again, phase=phase, output_tokens=1)
            await stub.Report(end, metadata=AUTH)
        lost = await pick("r2", 9)  # failed, never retried
        await stub.Report(report(decision_id=lost, phase=report.FAILED), metadata=AUTH)
        wrong = await pick("r4", 30)  # the client's error (a 400): not judged
        refused = report(decision_id=wrong, phase=report.REFUSED, http_status=400)
        await stub.Report(refused, metadata=AUTH)
        page = state.metrics.render().decode()
        assert metric_sample(page, SLO, model=RPC_MODEL, result="ttft_missed") == 1
        assert metric_sample(page, SLO, model=RPC_MODEL, result="failed") is None
        shift[0] += RETRY_WINDOW_S + 1
        await pick("r3", 20)  # a Pick (or the sweep) ends what is past the window
        page = state.metrics.render().decode()
        assert metric_sample(page, SLO, model=RPC_MODEL, result="failed") == 1
        assert metric_sample(page, SLO, model=RPC_MODEL, result="met") is None


async def test_a_retry_whose_caller_left_ends_its_request_unjudged() -> None:
    """A gateway's retry (a Pick with the request id of a decision reported ``FAILED``) whose
    caller is gone before it has its answer (its deadline passed while it was routed) is a
    request its client left: not judged, as the HTTP endpoints do not judge a client that
    leaves. It used to leave the first attempt's ``FAILED`` to be counted a miss once the
    retry window had passed."""
    import time

    from router.rpc.decisions import RETRY_WINDOW_S
    from tests.test_grpc_parity import _serve, _state, loop_clock

    state = _state(slo={"ttft_s": 5.0})
    shift = [0.0]
    report = router_pb2.ReportRequest
    deadline = [0.0]
    route = state.route

    def slow_route(*a: Any, **kw: Any) -> Any:  # holds the loop past the caller's deadline
        routed = route(*a, **kw)
        while time.monotonic() < deadline[0]:
            time.sleep(0.05)
        return routed

    async for channel in _serve(state, lambda: loop_clock() + shift[0]):
        stub = router_pb2_grpc.RouterStub(channel)
        asked = router_pb2.PickRequest(model=RPC_MODEL, token_ids=_ids(320), request_id="r1")
        first = (await stub.Pick(asked, metadata=AUTH)).decision_id
        await stub.Report(report(decision_id=first, phase=report.FAILED), metadata=AUTH)
        state.route = slow_route  # type: ignore[method-assign]
        deadline[0] = time.monotonic() + 2.0 + 0.2
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(asked, metadata=AUTH, timeout=2.0)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        state.route = route  # type: ignore[method-assign]
        await eventually(lambda: state.load.in_flight() == 0)
        shift[0] += RETRY_WINDOW_S + 1
        other = router_pb2.PickRequest(model=RPC_MODEL, token_ids=_ids(320, start=40))
        await stub.Pick(other, metadata=AUTH)  # a Pick (or the sweep) ends what is past
        page = state.metrics.render().decode()
        assert metric_sample(page, SLO, model=RPC_MODEL, result="failed") is None
