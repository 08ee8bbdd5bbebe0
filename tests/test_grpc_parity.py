"""gRPC Pick / Report against the HTTP front door's rules (router/service/handling.py):
the same metrics, session keys, admission bookkeeping and load release. Real grpcio
channels on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from router.core.load import decode_weight
from router.rpc.calls import metadata_headers
from router.rpc.gen import router_pb2, router_pb2_grpc
from router.rpc.server import loop_clock, serve_grpc
from router.rpc.settings import GrpcSettings
from router.service.config import build_settings
from router.service.intake import THREAD_MIN_BODY
from router.service.request_identity import scoped_session, session_key
from router.service.state import RouterState
from tests.backends import kimi_model_table, metric_sample
from tests.waiting import eventually

MODEL = "kimi"
TOKEN = "client-secret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def _state(**model: Any) -> RouterState:
    settings = build_settings(
        {
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b"},
            ],
            "models": {MODEL: kimi_model_table(block_size=16, speculative_ttl_s=0.0, **model)},
        }
    )
    return RouterState(settings)


async def _serve(
    state: RouterState, clock: Callable[[], float] = loop_clock, **kw: Any
) -> AsyncIterator[grpc.aio.Channel]:
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN, **kw), clock)
    _server, port = await gen.__anext__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await gen.aclose()


@pytest.fixture
async def rpc() -> AsyncIterator[tuple[RouterState, router_pb2_grpc.RouterStub]]:
    state = _state()
    async for channel in _serve(state):
        yield state, router_pb2_grpc.RouterStub(channel)


def _ids(n: int, start: int = 1000) -> router_pb2.TokenIds:
    return router_pb2.TokenIds(ids=list(range(start, start + n)))


async def test_pick_records_the_routing_metrics_http_records(rpc: Any) -> None:
    state, stub = rpc
    await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH)
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_prompt_tokens_total", model=MODEL) == 320
    assert metric_sample(page, "kvrouter_replica_prompt_tokens_total", model=MODEL) == 320
    bad = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), candidates=["zzz"])
    with pytest.raises(grpc.aio.AioRpcError):  # a bad request: rejected
        await stub.Pick(bad, metadata=AUTH)
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="rejected") == 1


async def test_a_long_session_id_is_keyed_as_http_keys_it(rpc: Any) -> None:
    state, stub = rpc
    sid = "s" * 1000  # HTTP keeps ids over 128 characters by their digest
    await stub.Pick(
        router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), session_id=sid), metadata=AUTH
    )
    sessions = state.engines[MODEL].sessions
    assert sessions is not None
    # scoped by the credential the call presented, as HTTP scopes by the API key
    scope = metadata_headers(AUTH)
    assert sessions.get(scoped_session(scope, session_key(sid)) or "", loop_clock()) is not None
    assert sessions.get(scoped_session(scope, sid) or "", loop_clock()) is None
    assert sessions.get(session_key(sid) or "", loop_clock()) is None


@pytest.mark.parametrize("field", ["text", "messages_json"])
async def test_a_large_prompt_is_processed_off_the_event_loop(
    rpc: Any, monkeypatch: Any, field: str
) -> None:
    """As the HTTP endpoints do for bodies of THREAD_MIN_BODY bytes or more: the loop serves
    every other request (HTTP ones too) while a large prompt is tokenized."""
    state, stub = rpc
    proc = state.processors[MODEL]
    threads: list[str] = []
    for name in ("completion", "chat"):
        real = getattr(proc, name)

        def spy(body: Any, real: Any = real) -> Any:
            threads.append(threading.current_thread().name)
            return real(body)

        monkeypatch.setattr(proc, name, spy)
    words = "many words here " * (THREAD_MIN_BODY // 16 + 1)
    small = "a few words"
    for text in (small, words):
        prompt = text if field == "text" else json.dumps([{"role": "user", "content": text}])
        await stub.Pick(router_pb2.PickRequest(model=MODEL, **{field: prompt}), metadata=AUTH)
    main = threading.main_thread().name
    assert threads[0] == main and threads[1] != main


async def test_a_pick_past_its_deadline_releases_its_load(rpc: Any, monkeypatch: Any) -> None:
    """A Pick that holds the loop past the caller's deadline (a long tokenization of token
    ids, a busy process): the caller never learns the decision, so no Report comes; its
    load must not stay booked (for an hour, until the decision expires)."""
    state, stub = rpc
    route = state.route

    def slow(*a: Any, **kw: Any) -> Any:
        time.sleep(0.5)
        return route(*a, **kw)

    monkeypatch.setattr(state, "route", slow)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(
            router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH, timeout=0.2
        )
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(0.3)  # the handler has returned
    assert state.load.in_flight() == 0


@pytest.fixture
async def admitted() -> AsyncIterator[tuple[RouterState, router_pb2_grpc.RouterStub]]:
    """SLO-aware admission on (as the app turns it on), one pending decision at most."""
    from router.service.admission import Admission

    state = _state(slo={"ttft_s": 100.0}, admission={"enabled": True})
    state.admission = Admission(state)
    async for channel in _serve(state, max_pending_decisions=1):
        yield state, router_pb2_grpc.RouterStub(channel)


async def test_a_decision_dropped_unreported_leaves_admission_too(admitted: Any) -> None:
    """A decision never reported is completed when the book drops it (over its bound, or
    after its TTL): in the load model and in admission's decode-stall ledger, or the
    replica's headroom stays taken and admission sheds more and more."""
    state, stub = admitted
    for rid in ("first", "second"):
        await stub.Pick(
            router_pb2.PickRequest(
                model=MODEL, token_ids=_ids(320, start=len(rid)), request_id=rid
            ),
            metadata=AUTH,
        )
    ledger = state.admission._models[MODEL].queue.stall
    assert state.load.replica_of("first") is None  # dropped from the book (bound 1)
    assert len(ledger) == 1  # "second"'s allowance only


async def test_a_request_id_held_in_admission_is_in_flight(admitted: Any, monkeypatch: Any) -> None:
    """A Pick held by admission has its id in flight: a second Pick with that id is refused
    (two decisions under one id would share one book entry and leak the other's load)."""
    state, stub = admitted
    gate = state.admission
    release = asyncio.Event()
    real = gate.route

    calls: list[str] = []

    async def held(*a: Any, **kw: Any) -> Any:
        calls.append(a[2])
        if len(calls) == 1:  # the first is held until released
            await release.wait()
        return await real(*a, **kw)

    monkeypatch.setattr(gate, "route", held)
    pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), request_id="r")
    first = asyncio.ensure_future(stub.Pick(pick, metadata=AUTH))
    await asyncio.sleep(0.2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(pick, metadata=AUTH, timeout=5)
    finally:
        release.set()
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in (exc.value.details() or "")
    decided = await first
    report = router_pb2.ReportRequest(decision_id=decided.decision_id, phase=3)
    assert (await stub.Report(report, metadata=AUTH)).accepted
    assert state.load.in_flight() == 0


async def test_report_completes_the_id_admission_routed_under(admitted: Any) -> None:
    """Admission renames a request whose id is held already (an HTTP request's, say): the
    decision's Report completes the renamed request, not the held one's id."""
    state, stub = admitted
    model = state.admission._model(MODEL)
    model.waiters["r"] = asyncio.get_running_loop().create_future()  # an HTTP request held
    try:
        decided = await stub.Pick(
            router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), request_id="r"),
            metadata=AUTH,
        )
        assert state.load.in_flight() == 1 and state.load.replica_of("r") is None
        report = router_pb2.ReportRequest(decision_id=decided.decision_id, phase=2)
        assert (await stub.Report(report, metadata=AUTH)).accepted
        assert state.load.in_flight() == 0 and len(model.queue.stall) == 0
    finally:
        model.waiters.pop("r").cancel()


async def test_a_pick_admission_does_not_judge_avoids_a_held_id(admitted: Any) -> None:
    """A Pick with a candidate list is not judged by admission; its id must still not be
    one a held request will be routed under, or the two share one load record."""
    state, stub = admitted
    model = state.admission._model(MODEL)
    model.waiters["r"] = asyncio.get_running_loop().create_future()  # an HTTP request held
    try:
        decided = await stub.Pick(
            router_pb2.PickRequest(
                model=MODEL, token_ids=_ids(320), request_id="r", candidates=["a"]
            ),
            metadata=AUTH,
        )
        assert state.load.in_flight() == 1 and state.load.replica_of("r") is None
        report = router_pb2.ReportRequest(decision_id=decided.decision_id, phase=2)
        assert (await stub.Report(report, metadata=AUTH)).accepted
        assert state.load.in_flight() == 0
    finally:
        model.waiters.pop("r").cancel()


def _trailer(exc: grpc.aio.AioRpcError, name: str) -> str | None:
    return next((str(v) for k, v in exc.trailing_metadata() or () if k == name), None)


async def test_refusals_carry_retry_info_as_http_does(rpc: Any) -> None:
    """HTTP answers 503 / 429 with Retry-After; gRPC says when to retry in the trailers."""
    state, stub = rpc
    for key in state.registry.keys_for(MODEL):
        state.load.set_draining(key, True)
    pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(pick, metadata=AUTH)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _trailer(exc.value, "retry-after") == "1"
    assert _trailer(exc.value, "grpc-retry-pushback-ms") == "1000"
    bad = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), candidates=["zzz"])
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(bad, metadata=AUTH)
    assert _trailer(exc.value, "retry-after") is None  # a bad request is not retried


async def test_an_admission_shed_is_resource_exhausted_with_retry_info() -> None:
    from router.service.admission import Admission

    # short prompts must start within 50 ms: an idle replica can, one prefilling a long
    # prompt (picked, not reported: in flight) cannot
    state = _state(slo={"ttft_tiers": "1000:0.05,*:1000"}, admission={"enabled": True})
    state.admission = Admission(state)
    async for channel in _serve(state):
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(2):  # one long prompt on each replica
            pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(20000, start=i * 30000))
            await stub.Pick(pick, metadata=AUTH)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(
                router_pb2.PickRequest(model=MODEL, token_ids=_ids(320, start=70000)),
                metadata=AUTH,
            )
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(_trailer(exc.value, "retry-after") or 0) >= 1
        assert int(_trailer(exc.value, "grpc-retry-pushback-ms") or 0) >= 1000


async def test_a_pick_no_idle_replica_could_serve_in_time_is_served_by_an_idle_fleet() -> None:
    """As on HTTP: a request whose own prefill misses its TTFT target on an idle replica is
    judged with that prefill added to its budget, not refused however idle the fleet."""
    from router.service.admission import Admission

    state = _state(slo={"ttft_s": 1e-9}, admission={"enabled": True})  # no request meets it
    state.admission = Admission(state)
    async for channel in _serve(state):
        got = await router_pb2_grpc.RouterStub(channel).Pick(
            router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH
        )
        assert got.decision_id and got.replica


async def test_pick_of_a_disaggregated_model_never_names_a_prefill_only_replica() -> None:
    """Pick answers one endpoint, so its request is served whole there (HTTP's local flow):
    a `prefill` replica decodes nothing and must never be named."""
    settings = build_settings(
        {
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "p0", "role": "prefill"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "p1", "role": "prefill"},
                {"url": "http://127.0.0.1:11", "model": MODEL, "name": "d0", "role": "decode"},
            ],
            "models": {MODEL: kimi_model_table(block_size=16, pd={"mode": "auto"})},
        }
    )
    state = RouterState(settings)
    async for channel in _serve(state):
        stub = router_pb2_grpc.RouterStub(channel)
        picked = set()
        for i in range(12):  # prefill replicas are idle and cheap: the policy likes them
            pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(5000, start=i * 7000))
            picked.add((await stub.Pick(pick, metadata=AUTH)).replica)
        assert picked == {"d0"}
        only_prefill = router_pb2.PickRequest(
            model=MODEL, token_ids=_ids(320), candidates=["p0", "p1"]
        )
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(only_prefill, metadata=AUTH)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prefill" in (exc.value.details() or "")


async def test_pick_of_a_disaggregated_model_falls_back_to_decode_replicas() -> None:
    """As HTTP's local flow (router/core/disagg.py ``plan``): with every ``both`` replica out
    of rotation, the request is served whole on a decode replica, not refused."""
    from router.core.types import ReplicaKey

    settings = build_settings(
        {
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "b0", "role": "both"},
                {"url": "http://127.0.0.1:11", "model": MODEL, "name": "d0", "role": "decode"},
            ],
            "models": {MODEL: kimi_model_table(block_size=16, pd={"mode": "auto"})},
        }
    )
    state = RouterState(settings)
    state.fleet.mark_unhealthy(ReplicaKey("b0"), 0.0)
    state.fleet.restore_health = lambda now: None  # stays out while the test runs
    async for channel in _serve(state):
        stub = router_pb2_grpc.RouterStub(channel)
        pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320))
        assert (await stub.Pick(pick, metadata=AUTH)).replica == "d0"


async def test_reports_feed_the_outcome_ttft_and_slo_metrics(rpc: Any) -> None:
    """What the HTTP endpoints count when the answer ends: the outcome, the TTFT, and for an
    answer with a first token whether it met its SLO (TTFT and TPOT from the reports)."""
    state, stub = rpc
    report = router_pb2.ReportRequest
    done = await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH)
    await stub.Report(report(decision_id=done.decision_id, phase=report.FIRST_TOKEN), metadata=AUTH)
    await stub.Report(
        report(decision_id=done.decision_id, phase=report.COMPLETED, output_tokens=10),
        metadata=AUTH,
    )
    failed = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, token_ids=_ids(320, start=9)), metadata=AUTH
    )
    await stub.Report(report(decision_id=failed.decision_id, phase=report.FAILED), metadata=AUTH)
    page = state.metrics.render().decode()
    ok = metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok")
    bad = metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="failed")
    assert (ok, bad) == (1, 1)
    assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 1
    met = metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result="met")
    assert met == 1


async def test_a_pick_held_by_admission_is_timed_from_its_arrival(monkeypatch: Any) -> None:
    """As on HTTP: a Pick held by admission has its TTFT (and SLO) timed from its arrival,
    which its deadline runs from, not from its dispatch after the hold."""
    from router.service.admission import Admission

    state = _state(slo={"ttft_s": 5.0}, admission={"enabled": True})
    state.admission = Admission(state)
    held_s = [0.0]
    gate = state.admission
    real = gate.route

    async def held(*a: Any, **kw: Any) -> Any:
        held_s[0] = 10.0  # the clock moves on 10 s while the Pick is held
        return await real(*a, **kw)

    monkeypatch.setattr(gate, "route", held)
    report = router_pb2.ReportRequest
    async for channel in _serve(state, lambda: loop_clock() + held_s[0]):
        stub = router_pb2_grpc.RouterStub(channel)
        pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320))
        done = await stub.Pick(pick, metadata=AUTH)
        first = report(decision_id=done.decision_id, phase=report.FIRST_TOKEN)
        await stub.Report(first, metadata=AUTH)
        end = report(decision_id=done.decision_id, phase=report.COMPLETED, output_tokens=1)
        await stub.Report(end, metadata=AUTH)
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_ttft_seconds_sum", model=MODEL) >= 10.0
    missed = metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result="ttft_missed")
    assert missed == 1


async def test_a_completed_report_without_a_first_token_is_judged_by_its_e2e() -> None:
    """A gateway that reports no FIRST_TOKEN (an answer not streamed: its first token reaches
    the client with the whole answer) has its COMPLETED judged as HTTP judges such an answer
    (router.core.slo ``answered_as``): its E2E against the TTFT target. It used to count in
    no SLO result at all."""
    state = _state(slo={"ttft_s": 5.0})
    shift = [0.0]
    report = router_pb2.ReportRequest
    async for channel in _serve(state, lambda: loop_clock() + shift[0]):
        stub = router_pb2_grpc.RouterStub(channel)
        for start, took_s in ((0, 10.0), (9, 0.0)):  # E2E 10 s: missed; ~0 s: met
            pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320, start=start))
            done = await stub.Pick(pick, metadata=AUTH)
            shift[0] += took_s
            end = report(decision_id=done.decision_id, phase=report.COMPLETED, output_tokens=9)
            await stub.Report(end, metadata=AUTH)
    page = state.metrics.render().decode()
    slo = "kvrouter_slo_requests_total"
    assert metric_sample(page, slo, model=MODEL, result="ttft_missed") == 1
    assert metric_sample(page, slo, model=MODEL, result="met") == 1
    assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 0


def _two_replicas(**server: Any) -> Any:
    """Settings of a router with gRPC on and two replicas (``a``, ``b``: nothing listens),
    ejected after 2 failures in a row; ``server`` adds to its ``[server]`` table."""
    return build_settings(
        {
            "server": {
                "grpc_port": 0,
                "grpc_token": TOKEN,
                "health_interval_s": 0,
                "outlier_consecutive_failures": 2,
                **server,
            },
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b"},
            ],
            "models": {MODEL: kimi_model_table(block_size=16)},
        }
    )


async def test_reported_failures_eject_a_replica_as_http_failures_do() -> None:
    """A replica that fails every request (it answers 500 fast, so it looks idle) is ejected
    after ``outlier_consecutive_failures`` failures in a row on HTTP; the same failures
    reported over gRPC must eject it too, or Pick keeps sending the gateway there."""
    from router.rpc.server import GRPC_PORT
    from router.service.app import STATE
    from tests.backends import start_router

    runner, _url = await start_router(_two_replicas())
    try:
        state = runner.app[STATE]
        report = router_pb2.ReportRequest
        async with grpc.aio.insecure_channel(f"127.0.0.1:{runner.app[GRPC_PORT]}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for i in range(2):
                pick = router_pb2.PickRequest(
                    model=MODEL, token_ids=_ids(320, start=i * 1000), candidates=["a"]
                )
                got = await stub.Pick(pick, metadata=AUTH)
                failed = report(decision_id=got.decision_id, phase=report.FAILED)
                assert (await stub.Report(failed, metadata=AUTH)).accepted
            (key,) = state.registry.find("a")
            assert not state.load.view(key, loop_clock()).healthy
            for i in range(4):
                pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320, start=9000 + i))
                assert (await stub.Pick(pick, metadata=AUTH)).replica == "b"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("status", "ejected"),
    [(400, False), (422, False), (429, True), (503, True), ("cancelled", False)],
)
async def test_a_refusal_reported_with_a_clients_error_status_ejects_nothing(
    status: int | str, ejected: bool
) -> None:
    """A REFUSED report with the answer's ``http_status``: a 4xx other than 429 is the
    client's error (the HTTP forwarder never counts one toward ejection), so a gateway
    whose clients send bad requests does not get a good replica ejected; 429 and 5xx count
    as failures. The guess is withdrawn either way (the replica took nothing) and the
    outcome is the HTTP endpoints' label. A CANCELLED report (the client left) is no
    failure either: counted ``cancelled``, as the HTTP forwarder counts a client leaving."""
    from router.rpc.server import GRPC_PORT
    from router.service.app import STATE
    from tests.backends import start_router

    runner, _url = await start_router(_two_replicas())
    try:
        state = runner.app[STATE]
        report = router_pb2.ReportRequest
        async with grpc.aio.insecure_channel(f"127.0.0.1:{runner.app[GRPC_PORT]}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for i in range(2):  # outlier_consecutive_failures
                pick = router_pb2.PickRequest(
                    model=MODEL, token_ids=_ids(320, start=i * 1000), candidates=["a"]
                )
                got = await stub.Pick(pick, metadata=AUTH)
                if isinstance(status, int):
                    refused = report(
                        decision_id=got.decision_id, phase=report.REFUSED, http_status=status
                    )
                else:
                    refused = report(decision_id=got.decision_id, phase=report.CANCELLED)
                assert (await stub.Report(refused, metadata=AUTH)).accepted
            (key,) = state.registry.find("a")
            assert state.load.view(key, loop_clock()).healthy is not ejected
            assert state.load.in_flight() == 0
            page = state.metrics.render().decode()
            label = "failed" if ejected else "upstream_4xx"
            if not isinstance(status, int):
                label = status
            assert (
                metric_sample(
                    page, "kvrouter_requests_total", model=MODEL, replica="a", outcome=label
                )
                == 2
            )
    finally:
        await runner.cleanup()


async def test_a_readmitted_replica_takes_one_pick_at_a_time_until_answered() -> None:
    """After its ejection a replica is on probation: as for the HTTP forwarder's attempts,
    one Pick at a time goes there until that decision is reported answered; a second Pick
    that could only go there finds no replica meanwhile."""
    from router.rpc.server import GRPC_PORT
    from router.service.app import STATE
    from tests.backends import start_router

    runner, _url = await start_router(_two_replicas(outlier_base_ejection_s=0.2))
    try:
        state = runner.app[STATE]
        report = router_pb2.ReportRequest
        (key,) = state.registry.find("a")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{runner.app[GRPC_PORT]}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            def only_a(i: int) -> Any:
                return router_pb2.PickRequest(
                    model=MODEL, token_ids=_ids(320, start=i * 1000), candidates=["a"]
                )

            for i in range(2):
                got = await stub.Pick(only_a(i), metadata=AUTH)
                failed = report(decision_id=got.decision_id, phase=report.FAILED)
                assert (await stub.Report(failed, metadata=AUTH)).accepted
            assert not state.load.view(key, loop_clock()).healthy
            await eventually(lambda: state.fleet.unhealthy_until.get(key, 0.0) < loop_clock())
            probe = await stub.Pick(only_a(10), metadata=AUTH)  # readmitted: on probation
            assert probe.replica == "a"
            with pytest.raises(grpc.aio.AioRpcError):  # the probe is out: none meanwhile
                await stub.Pick(only_a(11), metadata=AUTH)
            answered = report(decision_id=probe.decision_id, phase=report.FIRST_TOKEN)
            assert (await stub.Report(answered, metadata=AUTH)).accepted
            assert (await stub.Pick(only_a(12), metadata=AUTH)).replica == "a"
    finally:
        await runner.cleanup()


async def test_messages_and_responses_bodies_are_processed_as_their_endpoints_do(
    rpc: Any,
) -> None:
    """``request_path`` names the endpoint a gateway took ``request_json`` from: an Anthropic
    Messages body (top-level ``system``, content blocks) is its chat conversion, not an
    OpenAI chat body; a Responses body (``instructions``, ``input``) likewise; a follow-up
    naming a stored response the router recorded gets the replica that holds it."""
    from router.tokenize.anthropic import messages_prompt
    from router.tokenize.responses import responses_prompt

    state, stub = rpc
    proc = state.processors[MODEL]
    anthropic = {
        "model": MODEL,
        "max_tokens": 64,
        "system": "You are a careful assistant. " * 20,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 40}]}],
        "metadata": {"user_id": "u-17"},
    }
    want = messages_prompt(proc, anthropic)
    pick = router_pb2.PickRequest(
        model=MODEL, request_json=json.dumps(anthropic), request_path="/v1/messages"
    )
    got = await stub.Pick(pick, metadata=AUTH)
    assert got.prompt_tokens == want.prompt_tokens
    # read as an OpenAI chat body, the system prompt would be lost
    plain = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, request_json=json.dumps(anthropic)), metadata=AUTH
    )
    assert plain.prompt_tokens != want.prompt_tokens
    responses = {"model": MODEL, "instructions": "Be brief. " * 30, "input": "what now? " * 20}
    want = responses_prompt(proc, responses)
    got = await stub.Pick(
        router_pb2.PickRequest(
            model=MODEL, request_json=json.dumps(responses), request_path="/v1/responses"
        ),
        metadata=AUTH,
    )
    assert got.prompt_tokens == want.prompt_tokens
    # a stored response's follow-up goes to its holder, not where it would be routed
    follow = {**responses, "previous_response_id": "resp_abc", "input": "and then?"}
    pick = router_pb2.PickRequest(
        model=MODEL, request_json=json.dumps(follow), request_path="/v1/responses"
    )
    done = router_pb2.ReportRequest.COMPLETED

    async def routed() -> str:
        got = await stub.Pick(pick, metadata=AUTH)
        report = router_pb2.ReportRequest(decision_id=got.decision_id, phase=done)
        assert (await stub.Report(report, metadata=AUTH)).accepted
        return str(got.replica)

    unknown = [await routed() for _ in range(3)]  # the id is not known yet: routed
    assert len(set(unknown)) == 1
    holder = "a" if unknown[0] == "b" else "b"
    state.response_ids.put("resp_abc", MODEL, holder)
    assert [await routed() for _ in range(3)] == [holder] * 3
    bad = router_pb2.PickRequest(
        model=MODEL, request_json=json.dumps(responses), request_path="/v1/embeddings"
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Pick(bad, metadata=AUTH)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_path" in (info.value.details() or "")


async def test_a_whole_request_body_is_processed_as_http_processes_it(rpc: Any) -> None:
    """``request_json`` carries what a messages_json Pick cannot (a cache salt, template
    kwargs, truncation...): the prompt is the one the HTTP endpoint makes of the body, and
    the body's session keys the session when session_id is empty."""
    state, stub = rpc
    proc = state.processors[MODEL]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a salted question " * 30}],
        "cache_salt": "tenant-7",
        "metadata": {"session_id": "conv-9"},
    }
    want = proc.chat(body)
    got = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, request_json=json.dumps(body)), metadata=AUTH
    )
    assert got.prompt_tokens == want.prompt_tokens
    # the salt made another prompt than the messages alone
    plain = proc.chat({"messages": body["messages"]})
    assert plain.block_hashes != want.block_hashes
    decided = state.recent_decisions(1)[0]
    assert decided["prompt_tokens"] == want.prompt_tokens
    sessions = state.engines[MODEL].sessions
    scoped = scoped_session(metadata_headers(AUTH), "conv-9")
    assert sessions is not None and scoped is not None and scoped != "conv-9"
    assert sessions.get(scoped, loop_clock()) is not None
    completion = {"model": MODEL, "prompt": list(range(1000, 1400)), "truncate_prompt_tokens": 64}
    got = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, request_json=json.dumps(completion)), metadata=AUTH
    )
    assert got.prompt_tokens == 64
    for bad in ("[1]", "{not json", json.dumps({**body, "model": "other"})):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Pick(router_pb2.PickRequest(model=MODEL, request_json=bad), metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cached_tokens_count_once_per_decision(rpc: Any) -> None:
    """The engine's cached tokens of one request, as the HTTP forwarder counts them (once,
    from its answer's usage): a gateway that gives them with FIRST_TOKEN and again with
    COMPLETED, or whose client retried a Report, must not count them twice (the hit rate
    read from ``kvrouter_engine_cached_tokens`` would pass 100 %)."""
    state, stub = rpc
    report = router_pb2.ReportRequest
    done = await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH)
    first = report(decision_id=done.decision_id, phase=report.FIRST_TOKEN, cached_tokens=160)
    for _ in range(2):  # a retried Report
        assert (await stub.Report(first, metadata=AUTH)).accepted
    end = report(decision_id=done.decision_id, phase=report.COMPLETED, cached_tokens=160)
    assert (await stub.Report(end, metadata=AUTH)).accepted
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 160


async def test_a_cached_count_past_the_prompt_counts_the_prompt(rpc: Any) -> None:
    """``cached_tokens`` is a uint64 the caller fills: one of about 2^63 pushed
    ``kvrouter_engine_cached_tokens_total`` so high that every later count was lost to
    float rounding. An engine reuses no more than the prompt: the count is capped there,
    and the Report's phase still applies."""
    state, stub = rpc
    report = router_pb2.ReportRequest
    done = await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH)
    end = report(decision_id=done.decision_id, phase=report.COMPLETED, cached_tokens=2**63)
    assert (await stub.Report(end, metadata=AUTH)).accepted
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 320
    assert state.load.in_flight() == 0


async def test_a_reports_cached_tokens_feed_the_prediction_error(rpc: Any) -> None:
    """A Report's engine cached tokens measure the Pick's predicted hit as an HTTP answer's
    usage does: one ``kvrouter_prediction_error_tokens`` / ``_ratio`` sample per decision
    (the same formula: a whole-prompt prediction counts as prompt - 1). Without it a fleet
    routed over gRPC has no prediction-error figure and the docs' alert never fires."""
    state, stub = rpc
    report = router_pb2.ReportRequest
    cached = 160
    done = await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)), metadata=AUTH)
    first = report(decision_id=done.decision_id, phase=report.FIRST_TOKEN, cached_tokens=cached)
    for _ in range(2):  # a retried Report
        assert (await stub.Report(first, metadata=AUTH)).accepted
    end = report(decision_id=done.decision_id, phase=report.COMPLETED, cached_tokens=cached)
    assert (await stub.Report(end, metadata=AUTH)).accepted
    page = state.metrics.render().decode()
    error = min(done.usable_hit_tokens, done.prompt_tokens - 1) - cached
    for name in ("kvrouter_prediction_error_tokens", "kvrouter_prediction_error_ratio"):
        assert metric_sample(page, name + "_count", model=MODEL) == 1, name
    at_most_0 = metric_sample(page, "kvrouter_prediction_error_ratio_bucket", model=MODEL,
                              le="0.0")  # fmt: skip
    assert at_most_0 == (1 if error <= 0 else 0), error


@pytest.fixture(params=[False, True], ids=["direct", "admission"])
async def either(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[RouterState, router_pb2_grpc.RouterStub]]:
    """The ``rpc`` router, and the same with SLO-aware admission on."""
    from router.service.admission import Admission

    on = bool(request.param)
    state = _state(slo={"ttft_s": 100.0}, admission={"enabled": True}) if on else _state()
    if on:
        state.admission = Admission(state)
    async for channel in _serve(state):
        yield state, router_pb2_grpc.RouterStub(channel)


async def test_a_whole_request_bodys_output_limit_weighs_its_load(either: Any) -> None:
    """A ``request_json`` body's ``max_tokens`` is what the HTTP endpoint routes with
    (``Admitted.max_output_tokens``), admission on or off: it weighs the request's decode
    in the load model (router/core/load.py ``decode_weight``), the policy's decode cost and
    admission's stall allowance. Dropped, a gRPC request for 2 tokens weighs as one for
    the default 256, unlike the same body sent over HTTP."""
    state, stub = either
    body = {"model": MODEL, "prompt": list(range(1000, 1320)), "max_tokens": 2}
    got = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, request_json=json.dumps(body)), metadata=AUTH
    )
    key = next(k for k in state.registry.keys_for(MODEL) if k.replica == got.replica)
    assert state.load.own(key).decode_weight == pytest.approx(decode_weight(2))


async def test_admission_classes_a_pick_by_its_key_and_tier_as_http(monkeypatch: Any) -> None:
    """SLO-aware admission judges a Pick in the class and tenant the HTTP front door gives
    the same key and body (router/service/admission.py ``service_class``, ``tenant``): a
    ``server.flex_keys`` key's Picks are flex, a ``priority_keys`` key's priority, a
    ``request_json`` body's ``service_tier`` asks as on HTTP, and each key is its own
    tenant for fairness. Judged all in the default class and one tenant, a batch key's gRPC
    traffic would compete with interactive traffic and escape its fair share."""
    from router.core.admission import AdmissionQueue
    from router.service.admission import Admission
    from router.service.gate import Gate
    from router.service.security import Limits

    urgent, batch = "sk-urgent-0123", "sk-batch-4567"
    settings = build_settings(
        {
            "server": {
                "api_keys": f"{urgent},{batch}",
                "priority_keys": urgent,
                "flex_keys": batch,
            },
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b"},
            ],
            "models": {
                MODEL: kimi_model_table(
                    block_size=16,
                    speculative_ttl_s=0.0,
                    slo={"ttft_s": 100.0},
                    admission={"enabled": True},
                )
            },
        }
    )
    state = RouterState(settings)
    state.admission = Admission(state)
    tenants: list[str] = []
    ticket = AdmissionQueue.ticket

    def spy(queue: AdmissionQueue, rid: str, klass: int, tenant: str, *a: Any) -> Any:
        tenants.append(tenant)
        return ticket(queue, rid, klass, tenant, *a)

    monkeypatch.setattr(AdmissionQueue, "ticket", spy)
    gate = Gate(Limits.from_server(settings.server))
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN), loop_clock, gate=gate)
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            asked = json.dumps({"model": MODEL, "prompt": "hi", "service_tier": "flex"})
            picks = [
                (batch, router_pb2.PickRequest(model=MODEL, text="a batch job")),
                (urgent, router_pb2.PickRequest(model=MODEL, text="an urgent one")),
                (urgent, router_pb2.PickRequest(model=MODEL, request_json=asked)),
            ]
            for key, pick in picks:
                await stub.Pick(pick, metadata=(("authorization", f"Bearer {key}"),))
    finally:
        await gen.aclose()
    page = state.metrics.render().decode()

    def judged(klass: str) -> float | None:
        name = "kvrouter_admission_decisions_total"
        return metric_sample(page, name, model=MODEL, action="admit", **{"class": klass})

    assert (judged("flex"), judged("priority"), judged("default")) == (2, 1, None)
    want = [Admission.tenant([(b"authorization", f"Bearer {k}".encode())]) for k, _ in picks]
    assert tenants == want and tenants[0] != tenants[1]


async def test_a_pick_its_caller_left_counts_as_cancelled(rpc: Any, monkeypatch: Any) -> None:
    """A Pick whose caller left before it was answered (its deadline passed while its
    prompt was processed, or while it routed) ended before any replica took the request:
    ``kvrouter_requests_total{outcome="cancelled"}``, as the HTTP endpoints count a client
    that leaves then. Uncounted, the outcomes of gRPC traffic do not add up to its
    requests."""
    state, stub = rpc
    proc = state.processors[MODEL]
    real = proc.completion

    deadline = [0.0]  # when the Pick in flight is past its deadline (monotonic)

    def past_deadline() -> None:
        while time.monotonic() < deadline[0]:
            time.sleep(0.05)

    def slow_tokenizer(body: Any) -> Any:  # on a worker thread: the loop goes on
        past_deadline()
        return real(body)

    monkeypatch.setattr(proc, "completion", slow_tokenizer)
    big = "many words here " * (THREAD_MIN_BODY // 16 + 1)
    route = state.route
    routed: list[Any] = []

    def slow_route(*a: Any, **kw: Any) -> Any:  # holds the loop past the deadline
        past_deadline()
        routed.append(route(*a, **kw))
        return routed[-1]

    monkeypatch.setattr(state, "route", slow_route)

    def cancelled() -> float | None:
        page = state.metrics.render().decode()
        return metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="cancelled")

    for pick in (
        router_pb2.PickRequest(model=MODEL, text=big),
        router_pb2.PickRequest(model=MODEL, token_ids=_ids(320)),
    ):
        # (a deadline the Pick reaches its slow stage within on a loaded machine)
        deadline[0] = time.monotonic() + 2.0 + 0.2
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(pick, metadata=AUTH, timeout=2.0)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: len(routed) == 1 and state.load.in_flight() == 0)
    await eventually(lambda: cancelled() == 2)


async def test_a_flex_pick_is_judged_as_flex_with_admission_off() -> None:
    """As on HTTP: with admission off for the model, a Pick whose body asks for flex is
    counted in ``kvrouter_slo_requests_total`` as flex, against flex's TTFT factor (4x): a
    class's SLO does not depend on whether admission is on (it was "default" at 1x)."""
    from router.service.admission import Admission

    state = _state(slo={"ttft_s": 100.0})
    state.admission = Admission(state)
    report = router_pb2.ReportRequest
    body = json.dumps({"model": MODEL, "prompt": list(range(1000, 1320)), "service_tier": "flex"})
    async for channel in _serve(state):
        stub = router_pb2_grpc.RouterStub(channel)
        got = await stub.Pick(router_pb2.PickRequest(model=MODEL, request_json=body), metadata=AUTH)
        await stub.Report(
            report(decision_id=got.decision_id, phase=report.FIRST_TOKEN), metadata=AUTH
        )
        await stub.Report(
            report(decision_id=got.decision_id, phase=report.COMPLETED, output_tokens=1),
            metadata=AUTH,
        )
    page = state.metrics.render().decode()
    name = "kvrouter_slo_requests_total"
    assert metric_sample(page, name, model=MODEL, result="met", **{"class": "flex"}) == 1


async def test_a_picks_tpot_is_judged_per_sequence_of_its_samples() -> None:
    """As on HTTP: a Report's ``output_tokens`` is the engine's usage, the sum over the
    request's ``n`` sequences, which decode side by side. 101 tokens of 4 sequences 3 s after
    the first token are ~26 a sequence: 120 ms a token, which misses a 100 ms target (the sum
    gave 30 ms: met)."""
    state = _state(slo={"ttft_s": 100.0, "tpot_s": 0.1})
    shift = [0.0]
    report = router_pb2.ReportRequest
    body = json.dumps({"model": MODEL, "prompt": list(range(1000, 1320)), "n": 4})
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN), lambda: loop_clock() + shift[0])
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            pick = router_pb2.PickRequest(model=MODEL, request_json=body)
            got = await stub.Pick(pick, metadata=AUTH)
            first = report(decision_id=got.decision_id, phase=report.FIRST_TOKEN)
            await stub.Report(first, metadata=AUTH)
            shift[0] = 3.0
            end = report(decision_id=got.decision_id, phase=report.COMPLETED, output_tokens=101)
            await stub.Report(end, metadata=AUTH)
    finally:
        await gen.aclose()
    page = state.metrics.render().decode()
    missed = metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result="tpot_missed")
    assert missed == 1


@pytest.mark.parametrize("field", ["request_json", "messages_json", "tools_json"])
async def test_json_nested_too_deeply_is_invalid_argument_as_http_answers_400(
    rpc: Any, field: str
) -> None:
    """A JSON field nested deeper than the parser recurses is the client's error: HTTP
    answers such a body 400 ("nested too deeply", router.service.intake ``parse_body``),
    and Pick INVALID_ARGUMENT, counted ``rejected`` as HTTP counts it; not UNKNOWN (an
    unhandled RecursionError, logged as a servicer bug)."""
    state, stub = rpc
    deep = "[" * 5000 + "]" * 5000
    chat = json.dumps([{"role": "user", "content": "hi"}])
    kw = {
        "request_json": {"request_json": '{"messages": ' + deep + "}"},
        "messages_json": {"messages_json": deep},
        "tools_json": {"messages_json": chat, "tools_json": deep},
    }[field]
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(router_pb2.PickRequest(model=MODEL, **kw), metadata=AUTH)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} is nested too deeply" in (exc.value.details() or "")
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="rejected") == 1


@pytest.mark.parametrize("how", ["fields", "request_json"])
async def test_a_prompt_too_deeply_nested_to_render_is_invalid_argument(rpc: Any, how: str) -> None:
    """JSON the parser takes (1,020 nested arrays as the tools) but too deep for the chat
    template to render: the client's error, INVALID_ARGUMENT (HTTP's 400), not UNKNOWN
    from the RecursionError raised while the prompt is processed."""
    _state, stub = rpc
    deep = "[" * 1020 + "]" * 1020
    chat = json.dumps([{"role": "user", "content": "hi"}])
    if how == "fields":
        pick = router_pb2.PickRequest(model=MODEL, messages_json=chat, tools_json=deep)
    else:
        body = '{"messages": ' + chat + ', "tools": ' + deep + "}"
        pick = router_pb2.PickRequest(
            model=MODEL, request_json=body, request_path="/v1/chat/completions"
        )
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(pick, metadata=AUTH)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nested too deeply" in (exc.value.details() or "")


async def test_a_body_with_an_empty_model_is_for_the_picks_model(rpc: Any) -> None:
    """HTTP reads ``"model": ""`` as naming no model (vLLM's served one: the router's one
    model), so a gateway forwarding such a body as ``request_json`` gets it routed for the
    Pick's ``model``, not refused as a body naming another model."""
    _state, stub = rpc
    for named in ("", None):
        body = json.dumps({"model": named, "prompt": list(range(1000, 1100))})
        got = await stub.Pick(router_pb2.PickRequest(model=MODEL, request_json=body), metadata=AUTH)
        assert got.prompt_tokens == 100


@pytest.mark.parametrize("field", ["request_json", "text", "messages_json"])
async def test_a_prompt_over_the_http_body_limit_is_refused_as_http_refuses_it(
    field: str,
) -> None:
    """``server.max_body_mb`` bounds what a client may make the router parse and tokenize
    (HTTP: 413). A Pick's prompt fields carry that body (``request_json``) or what it
    would hold: over the limit they are RESOURCE_EXHAUSTED, as a message over
    ``grpc_max_message_mb`` is, whatever that larger limit; nothing is routed."""
    settings = build_settings(
        {
            "server": {"max_body_mb": 0.01},  # 10 KiB; grpc_max_message_mb is 16
            "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"}],
            "models": {MODEL: kimi_model_table(block_size=16, speculative_ttl_s=0.0)},
        }
    )
    state = RouterState(settings)

    def pick(words: str) -> router_pb2.PickRequest:
        value = {
            "request_json": json.dumps({"prompt": words}),
            "text": words,
            "messages_json": json.dumps([{"role": "user", "content": words}]),
        }[field]
        return router_pb2.PickRequest(model=MODEL, **{field: value})

    async for channel in _serve(state):
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(pick("many words here " * 1000), metadata=AUTH)  # 16,000 bytes
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_body_mb" in (exc.value.details() or "")
        assert state.load.in_flight() == 0
        assert (await stub.Pick(pick("a few words"), metadata=AUTH)).prompt_tokens > 0


async def test_a_follow_up_whose_holder_cannot_take_it_names_the_holder_as_http(
    rpc: Any,
) -> None:
    """A Responses follow-up can go only to the replica holding its stored response; when
    that one cannot take it now, HTTP's 503 names the holder and why (handling.py
    ``route_pinned``: any other replica could only answer that the response does not
    exist). Pick's UNAVAILABLE says the same, with the retry trailers."""
    state, stub = rpc
    state.response_ids.put("resp_abc", MODEL, "a")
    key = next(k for k in state.registry.keys_for(MODEL) if k.replica == "a")
    state.load.set_draining(key, True)
    follow = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_abc"}
    pick = router_pb2.PickRequest(
        model=MODEL, request_json=json.dumps(follow), request_path="/v1/responses"
    )
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(pick, metadata=AUTH)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    details = exc.value.details() or ""
    assert "replica 'a', the only one holding response 'resp_abc'" in details, details
    assert _trailer(exc.value, "retry-after") == "1"


async def test_a_follow_up_whose_holder_is_no_candidate_is_refused_not_sent_elsewhere(
    rpc: Any,
) -> None:
    """The caller's ``candidates`` leave out the replica holding the stored response: any
    of them could only answer that the response does not exist, so Pick routes it nowhere
    and answers UNAVAILABLE naming the holder, with the retry trailers (HTTP's 503 for a
    holder that cannot take it); with the holder among the candidates it goes there."""
    state, stub = rpc
    state.response_ids.put("resp_abc", MODEL, "a")
    follow = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_abc"}

    def pick(*candidates: str) -> router_pb2.PickRequest:
        return router_pb2.PickRequest(
            model=MODEL,
            request_json=json.dumps(follow),
            request_path="/v1/responses",
            candidates=list(candidates),
        )

    decided = len(state.decisions)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(pick("b"), metadata=AUTH)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    details = exc.value.details() or ""
    assert "replica 'a', the only one holding response 'resp_abc'" in details, details
    assert "not among the candidates" in details, details
    assert _trailer(exc.value, "retry-after") == "1"
    assert len(state.decisions) == decided  # routed nowhere
    assert (await stub.Pick(pick("b", "a"), metadata=AUTH)).replica == "a"


def _outcome_counts(state: RouterState) -> dict[str, float]:
    """outcome -> ``MODEL``'s ``kvrouter_requests_total`` summed over replicas."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(state.metrics.render().decode()):
        for s in family.samples:
            if s.name == "kvrouter_requests_total" and s.labels["model"] == MODEL:
                out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


async def test_a_decision_never_reported_counts_expired_once() -> None:
    """HTTP counts every request's outcome once; a Pick's is counted by its Report, so a
    decision that ends without one (past ``decision_ttl_s``, or evicted beyond
    ``max_pending_decisions``) counts ``expired`` on its replica, once: a late Report of it
    is unknown and counts nothing more."""
    state = _state()
    shift = [0.0]
    report = router_pb2.ReportRequest
    settings = GrpcSettings(port=0, token=TOKEN, decision_ttl_s=60.0, max_pending_decisions=2)
    gen = serve_grpc(state, settings, lambda: loop_clock() + shift[0])
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for rid in ("p1", "p2", "p3"):  # p1: evicted by p3
                pick = router_pb2.PickRequest(model=MODEL, token_ids=_ids(320), request_id=rid)
                await stub.Pick(pick, metadata=AUTH)
            assert _outcome_counts(state) == {"expired": 1}
            first = report(decision_id="p2", phase=report.FIRST_TOKEN)
            assert (await stub.Report(first, metadata=AUTH)).accepted
            done = report(decision_id="p3", phase=report.COMPLETED, output_tokens=1)
            assert (await stub.Report(done, metadata=AUTH)).accepted
            shift[0] = 120.0  # p2 (answering, never ended) is past its TTL: the sweep ends it
            await eventually(lambda: _outcome_counts(state) == {"expired": 2, "ok": 1})
            for rid in ("p1", "p2"):
                late = report(decision_id=rid, phase=report.COMPLETED, output_tokens=1)
                assert not (await stub.Report(late, metadata=AUTH)).accepted
            assert _outcome_counts(state) == {"expired": 2, "ok": 1}
            assert state.load.in_flight() == 0
    finally:
        await gen.aclose()
