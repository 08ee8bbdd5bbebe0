"""gRPC API over real channels on loopback: Pick / Report, Index.Publish, Admin, health,
reflection, auth, deadlines and bad messages."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.core.hashing import hash_prompt, root_hash
from router.core.policies import TERM_NAMES
from router.rpc.gen import (
    admin_pb2,
    admin_pb2_grpc,
    index_pb2,
    index_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from router.rpc.server import loop_clock, serve_grpc
from router.rpc.settings import GrpcSettings
from router.service.config import build_settings
from router.service.settings import Settings
from router.service.state import RouterState
from tests.backends import kimi_model_table, metric_sample
from tests.waiting import eventually

MODEL = "kimi"
TOKEN = "client-secret"
ADMIN = "admin-secret"


def _state() -> RouterState:
    settings = build_settings(
        {
            "replicas": [
                {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a", "rack": "r1"},
                {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b", "dp_ranks": 2},
            ],
            "models": {MODEL: kimi_model_table(block_size=16, speculative_ttl_s=0.0)},
        }
    )
    return RouterState(settings)


@pytest.fixture
async def rpc() -> AsyncIterator[tuple[RouterState, grpc.aio.Channel]]:
    state = _state()
    settings = GrpcSettings(port=0, token=TOKEN, admin_token=ADMIN, max_message_mb=4)
    gen = serve_grpc(state, settings, loop_clock)
    _server, port = await gen.__anext__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield state, channel
    finally:
        await channel.close()
        await gen.aclose()


def auth(token: str = TOKEN) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_pick_with_token_ids_follows_the_index_and_report_updates_load(rpc: Any) -> None:
    state, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    tokens = list(range(1000, 1000 + 8192))  # 8k-token prompt as ids, block size 16
    hashes = hash_prompt(tokens, 16, root_hash(MODEL)).hashes
    publish = index_pb2_grpc.IndexStub(channel)

    async def batches() -> AsyncIterator[index_pb2.IndexEventBatch]:
        yield index_pb2.IndexEventBatch(
            replica="b",
            dp_rank=1,
            seq=1,
            events=[index_pb2.IndexEvent(type=index_pb2.IndexEvent.STORED, hashes=hashes[:300])],
        )

    acks = [a async for a in publish.Publish(batches(), metadata=auth())]
    assert [a.outcome for a in acks] == [index_pb2.PublishAck.APPLIED]

    resp = await stub.Pick(
        router_pb2.PickRequest(
            model=MODEL, token_ids=router_pb2.TokenIds(ids=tokens), session_id="s1"
        ),
        metadata=auth(),
    )
    assert (resp.replica, resp.dp_rank) == ("b", 1)
    assert resp.endpoint == "http://127.0.0.1:10"
    assert resp.prompt_tokens == 8192 and resp.usable_hit_tokens == 300 * 16
    assert resp.kv_hit_tokens == 300 * 16 and resp.policy == "ours"
    assert set(resp.terms) == set(TERM_NAMES) and "batch" in TERM_NAMES
    assert len(resp.fallbacks) == 2 and resp.decision_id
    key = next(k for k in state.registry.keys_for(MODEL) if str(k) == "b#dp1")
    assert state.load.view(key, loop_clock()).prefilling == 1

    report = router_pb2.ReportRequest
    ok = await stub.Report(
        report(decision_id=resp.decision_id, phase=report.FIRST_TOKEN), metadata=auth()
    )
    assert ok.accepted and state.load.view(key, loop_clock()).decoding == 1
    done = await stub.Report(
        report(decision_id=resp.decision_id, phase=report.COMPLETED, cached_tokens=4800),
        metadata=auth(),
    )
    assert done.accepted and state.load.view(key, loop_clock()).in_flight == 0
    again = await stub.Report(
        report(decision_id=resp.decision_id, phase=report.COMPLETED), metadata=auth()
    )
    assert not again.accepted


async def test_pick_text_chat_and_candidate_subset(rpc: Any) -> None:
    _, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    msgs = json.dumps([{"role": "user", "content": "hello " * 200}])
    tools = json.dumps([{"type": "function", "function": {"name": "f", "parameters": {}}}])
    chat = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, messages_json=msgs, tools_json=tools, candidates=["a"]),
        metadata=auth(),
    )
    assert chat.replica == "a" and chat.prompt_tokens > 200
    text = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, text="some words " * 50, candidates=["b#dp1"]),
        metadata=auth(),
    )
    assert (text.replica, text.dp_rank) == ("b", 1)


@pytest.mark.parametrize(
    "request_kw,code,fragment",
    [
        ({"model": MODEL}, grpc.StatusCode.INVALID_ARGUMENT, "messages_json or request_json"),
        (
            {"token_ids": router_pb2.TokenIds(ids=[1])},
            grpc.StatusCode.INVALID_ARGUMENT,
            "model is required",
        ),
        ({"model": "nope", "text": "hi"}, grpc.StatusCode.NOT_FOUND, "nope"),
        (
            {"model": MODEL, "messages_json": "[{"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "not valid JSON",
        ),
        ({"model": MODEL, "messages_json": "[]"}, grpc.StatusCode.INVALID_ARGUMENT, "messages"),
        (
            {"model": MODEL, "token_ids": router_pb2.TokenIds()},
            grpc.StatusCode.INVALID_ARGUMENT,
            "must not be empty",
        ),
        (
            {"model": MODEL, "text": "x", "candidates": ["zzz"]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "zzz",
        ),
    ],
)
async def test_bad_pick_requests_get_clear_statuses(
    rpc: Any, request_kw: dict[str, Any], code: grpc.StatusCode, fragment: str
) -> None:
    _, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(router_pb2.PickRequest(**request_kw), metadata=auth())
    assert exc.value.code() == code
    assert fragment in (exc.value.details() or "")


async def test_no_replica_available_is_unavailable(rpc: Any) -> None:
    state, channel = rpc
    for key in state.registry.keys_for(MODEL):
        state.load.set_draining(key, True)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await router_pb2_grpc.RouterStub(channel).Pick(
            router_pb2.PickRequest(model=MODEL, text="hi"), metadata=auth()
        )
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_oversized_message_is_rejected(rpc: Any) -> None:
    _, channel = rpc
    huge = router_pb2.PickRequest(model=MODEL, text="x" * (5 * 2**20))
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await router_pb2_grpc.RouterStub(channel).Pick(huge, metadata=auth())
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_auth_tokens(rpc: Any) -> None:
    _, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    req = router_pb2.PickRequest(model=MODEL, text="hi")
    for meta in ((), auth("wrong")):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Pick(req, metadata=meta)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    admin = admin_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await admin.Stats(admin_pb2.StatsRequest(), metadata=auth())  # client token: not admin
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def one() -> AsyncIterator[index_pb2.IndexEventBatch]:
        yield index_pb2.IndexEventBatch(replica="a", seq=1)

    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _ = [a async for a in index_pb2_grpc.IndexStub(channel).Publish(one())]
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_publishing_is_refused_when_other_workers_would_not_see_it(
    tmp_path: Any,
) -> None:
    """With ``server.workers`` > 1 a Publish stream lands on one worker, whose index alone
    would take its events: the others would route that replica cache-blind. The stream is
    refused with FAILED_PRECONDITION naming the way out, and nothing is applied."""
    from router.service.workers import Workers

    state = _state()
    settings = GrpcSettings(port=0, token=TOKEN, admin_token=ADMIN, max_message_mb=4)
    gen = serve_grpc(state, settings, loop_clock, workers=Workers(str(tmp_path), 2))
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            async def one() -> AsyncIterator[index_pb2.IndexEventBatch]:
                stored = index_pb2.IndexEvent.STORED
                yield index_pb2.IndexEventBatch(
                    replica="a", seq=1, events=[index_pb2.IndexEvent(type=stored, hashes=[1])]
                )

            stub = index_pb2_grpc.IndexStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                _ = [a async for a in stub.Publish(one(), metadata=auth())]
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "workers" in (exc.value.details() or "")
            key = state.registry.keys_for(MODEL)[0]
            assert state.index.replica_size(key) == (0, 0)
    finally:
        await gen.aclose()


async def test_publish_sequencing_and_bad_batches(rpc: Any) -> None:
    state, channel = rpc
    stub = index_pb2_grpc.IndexStub(channel)
    stored = index_pb2.IndexEvent.STORED

    async def batches() -> AsyncIterator[index_pb2.IndexEventBatch]:
        for seq in (1, 1, 3):
            yield index_pb2.IndexEventBatch(
                replica="a",
                seq=seq,
                events=[
                    index_pb2.IndexEvent(type=stored, hashes=[seq * 10 + 1, seq * 10 + 2]),
                    index_pb2.IndexEvent(type=stored, hashes=[seq * 10 + 2], kind=index_pb2.STATE),
                ],
            )

    acks = [a.outcome async for a in stub.Publish(batches(), metadata=auth())]
    ack = index_pb2.PublishAck
    assert acks == [ack.APPLIED, ack.DUPLICATE, ack.GAP]
    key = state.registry.keys_for(MODEL)[0]
    assert state.index.replica_size(key) == (4, 2)

    async def bad() -> AsyncIterator[index_pb2.IndexEventBatch]:
        yield index_pb2.IndexEventBatch(replica="", seq=1)

    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _ = [a async for a in stub.Publish(bad(), metadata=auth())]
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "replica is required" in (exc.value.details() or "")

    async def unknown() -> AsyncIterator[index_pb2.IndexEventBatch]:
        yield index_pb2.IndexEventBatch(
            replica="nobody", seq=1, events=[index_pb2.IndexEvent(type=stored, hashes=[7])]
        )

    size = len(state.index.replicas())
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _ = [a async for a in stub.Publish(unknown(), metadata=auth())]
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nobody" in (exc.value.details() or "")
    assert len(state.index.replicas()) == size  # nothing added for it


async def test_admin_list_drain_stats(rpc: Any) -> None:
    _, channel = rpc
    admin = admin_pb2_grpc.AdminStub(channel)
    listed = await admin.ListReplicas(admin_pb2.ListReplicasRequest(), metadata=auth(ADMIN))
    assert sorted((r.replica, r.dp_rank) for r in listed.replicas) == [("a", 0), ("b", 0), ("b", 1)]
    assert next(r for r in listed.replicas if r.replica == "a").rack == "r1"
    drained = await admin.Drain(
        admin_pb2.DrainRequest(replica="b", all_ranks=True), metadata=auth(ADMIN)
    )
    assert drained.changed == 2
    again = await admin.Drain(
        admin_pb2.DrainRequest(replica="b", all_ranks=True), metadata=auth(ADMIN)
    )
    assert again.changed == 0
    pick = await router_pb2_grpc.RouterStub(channel).Pick(
        router_pb2.PickRequest(model=MODEL, text="hi"), metadata=auth()
    )
    assert pick.replica == "a"
    undrained = await admin.Undrain(
        admin_pb2.DrainRequest(replica="b", dp_rank=1), metadata=auth(ADMIN)
    )
    assert undrained.changed == 1
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await admin.Drain(admin_pb2.DrainRequest(replica="nope"), metadata=auth(ADMIN))
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND
    stats = await admin.Stats(admin_pb2.StatsRequest(), metadata=auth(ADMIN))
    assert stats.replicas == 3 and stats.decisions == 1 and stats.in_flight == 1


async def test_health_reflection_and_deadline(rpc: Any) -> None:
    _, channel = rpc
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvrouter.v1.Router", "kvrouter.v1.Index", "kvrouter.v1.Admin"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)

    async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    names = set()
    async for r in refl.ServerReflectionInfo(ask()):
        names |= {s.name for s in r.list_services_response.service}
    assert {"kvrouter.v1.Router", "kvrouter.v1.Index", "kvrouter.v1.Admin"} <= names

    # A deadline that has already passed is honoured (no hang, DEADLINE_EXCEEDED).
    async def slow() -> AsyncIterator[index_pb2.IndexEventBatch]:
        await asyncio.sleep(5)
        yield index_pb2.IndexEventBatch(replica="a")

    with pytest.raises(grpc.aio.AioRpcError) as exc:
        _ = [
            a
            async for a in index_pb2_grpc.IndexStub(channel).Publish(
                slow(), metadata=auth(), timeout=0.2
            )
        ]
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _grpc_router_settings(**server: object) -> Settings:
    """A router serving gRPC (token and admin token set) beside HTTP, ``server`` added to
    its [server] table, for one replica at a URL where nothing answers (no health probe, so
    none takes it out of rotation)."""
    return build_settings(
        {
            "server": {
                "grpc_port": 0,
                "grpc_token": TOKEN,
                "admin_token": ADMIN,
                "health_interval_s": 0,
                **server,
            },
            "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"}],
            "models": {MODEL: kimi_model_table()},
        }
    )


async def test_router_app_serves_grpc_beside_http() -> None:
    from router.rpc.server import GRPC_PORT
    from tests.backends import start_router

    settings = _grpc_router_settings()
    runner, url = await start_router(settings)
    try:
        port = runner.app[GRPC_PORT]
        async with aiohttp.ClientSession() as http, http.get(url + "/health") as health:
            assert health.status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            resp = await router_pb2_grpc.RouterStub(channel).Pick(
                router_pb2.PickRequest(model=MODEL, text="hello there"), metadata=auth()
            )
            assert resp.replica == "a" and resp.endpoint == "http://127.0.0.1:9"
            stats = await admin_pb2_grpc.AdminStub(channel).Stats(
                admin_pb2.StatsRequest(), metadata=auth(ADMIN)
            )
            assert stats.replicas == 1 and stats.in_flight == 1
    finally:
        await runner.cleanup()


async def test_pick_applies_the_http_limits_and_unique_ids(rpc: Any) -> None:
    from dataclasses import replace

    state, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    ids = router_pb2.TokenIds(ids=list(range(200)))
    # an id in flight through the HTTP endpoints is refused, as one in flight here is
    key = state.registry.keys_for(MODEL)[0]
    state.load.dispatch("http-req-1", key, 100, 0)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(
            router_pb2.PickRequest(model=MODEL, token_ids=ids, request_id="http-req-1"),
            metadata=auth(),
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in flight" in (exc.value.details() or "")
    state.load.complete("http-req-1")
    # server.max_prompt_tokens applies to Pick as it does to /v1/*
    state.settings = replace(
        state.settings, server=replace(state.settings.server, max_prompt_tokens=100)
    )
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=ids), metadata=auth())
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_prompt_tokens" in (exc.value.details() or "")
    small = router_pb2.TokenIds(ids=list(range(50)))
    ok = await stub.Pick(router_pb2.PickRequest(model=MODEL, token_ids=small), metadata=auth())
    assert ok.prompt_tokens == 50


async def test_a_retry_on_a_fallback_moves_the_decisions_load(rpc: Any) -> None:
    """A gateway retrying on another replica reports the failure, then Picks again with the
    same ``request_id`` among the replicas left (docs/grpc.md): the load and the next
    Report follow the request to the replica that serves it."""
    state, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    ids = router_pb2.TokenIds(ids=list(range(5000, 5000 + 640)))
    first = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, token_ids=ids, request_id="g1"), metadata=auth()
    )
    report = router_pb2.ReportRequest
    failed = report(decision_id="g1", phase=report.FAILED)
    assert (await stub.Report(failed, metadata=auth())).accepted
    again = await stub.Pick(
        router_pb2.PickRequest(
            model=MODEL, token_ids=ids, request_id="g1", candidates=[first.fallbacks[0]]
        ),
        metadata=auth(),
    )
    moved = next(k for k in state.registry.keys_for(MODEL) if str(k) == first.fallbacks[0])
    assert state.load.replica_of("g1") == moved and state.load.in_flight() == 1
    assert f"{again.replica}#dp{again.dp_rank}".removesuffix("#dp0") == first.fallbacks[0]
    done = report(decision_id="g1", phase=report.COMPLETED)
    assert (await stub.Report(done, metadata=auth())).accepted
    assert state.load.in_flight() == 0


def _guessing_state(**server: Any) -> RouterState:
    """Two replicas nothing listens at (``a``, ``b``), in 16-token blocks, whose Picks enter
    what they guess the replica will cache for 60 s."""
    return RouterState(
        build_settings(
            {
                "server": server,
                "replicas": [
                    {"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"},
                    {"url": "http://127.0.0.1:10", "model": MODEL, "name": "b"},
                ],
                "models": {MODEL: kimi_model_table(block_size=16, speculative_ttl_s=60.0)},
            }
        )
    )


@pytest.mark.parametrize(
    "phase",
    [
        "REFUSED",
        "FAILED",
        "REFUSED_AFTER_FIRST_TOKEN",
        "CANCELLED",
        "CANCELLED_AFTER_FIRST_TOKEN",
    ],
)
async def test_a_refused_report_withdraws_the_decisions_guess(phase: str) -> None:
    """A gateway whose replica refused the request (an error status, a refused connection)
    reports REFUSED: what the Pick guessed the replica would cache goes at once, so the
    retry's Pick (and any request sharing the prefix) is not drawn there. FAILED (the
    replica may be prefilling it: no answer in time) keeps the guess until its TTL, and so
    does a REFUSED after a FIRST_TOKEN report (the replica computed the prompt: it holds
    it, whatever the gateway calls the end). CANCELLED before a first token (the client
    left, the engine aborted the prefill: it never reports the prompt's last block) goes
    as REFUSED does; after one it stays."""
    state = _guessing_state()
    grpc_settings = GrpcSettings(port=0, token=TOKEN, admin_token=ADMIN, max_message_mb=4)
    gen = serve_grpc(state, grpc_settings, loop_clock)
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            tokens = list(range(7000, 7000 + 640))
            hashes = hash_prompt(tokens, 16, root_hash(MODEL)).hashes
            pick = router_pb2.PickRequest(
                model=MODEL, token_ids=router_pb2.TokenIds(ids=tokens), request_id="w1"
            )
            first = await stub.Pick(pick, metadata=auth())
            key = next(k for k in state.registry.keys_for(MODEL) if k.replica == first.replica)
            assert state.index.match(hashes).get(key).kv_blocks == len(hashes)
            if phase.endswith("_AFTER_FIRST_TOKEN"):
                token = router_pb2.ReportRequest(
                    decision_id="w1", phase=router_pb2.ReportRequest.FIRST_TOKEN
                )
                assert (await stub.Report(token, metadata=auth())).accepted
            ends = phase.removesuffix("_AFTER_FIRST_TOKEN")
            report = router_pb2.ReportRequest(
                decision_id="w1", phase=getattr(router_pb2.ReportRequest, ends)
            )
            assert (await stub.Report(report, metadata=auth())).accepted
            held = state.index.match(hashes).get(key).kv_blocks
            assert held == (0 if phase in ("REFUSED", "CANCELLED") else len(hashes))
            assert state.load.in_flight() == 0
    finally:
        await gen.aclose()


@pytest.mark.parametrize("late", ["while_routing", "after_the_last_check"])
async def test_a_pick_whose_caller_never_heard_back_withdraws_its_guess(
    monkeypatch: Any, late: str, tmp_path: Any
) -> None:
    """A Pick whose deadline passed while it routed (or after its last check, while its
    reply is built and sent) undoes its dispatch: its caller never learns the replica, so
    no request goes there and no Report comes. What the Pick guessed the replica would
    cache (speculative entries) must go with its load, as for a REFUSED report, when the
    call ends, not after the book's hour; else requests sharing the prefix are drawn there
    for a hit it never holds. It is a row of offered load in the live-traffic trace
    (``status`` 499, router.recorder ``CLIENT_CLOSED``), as a Pick its caller left before
    it was routed is: it was no row, so a replay offered less load than the router had."""
    import router.rpc.router_service as router_service
    from router.recorder import CLIENT_CLOSED, RecordSettings, TraceRecorder, record_key

    trace = tmp_path / "trace.jsonl"
    state = _guessing_state(record_path=str(trace), record_key="k")
    recorder = TraceRecorder(
        RecordSettings(trace, key=record_key("k")),
        started_at=asyncio.get_running_loop().time(),
        wall_at_start=time.time(),
    )
    state.recorder = recorder
    routed: list[Any] = []
    deadline = [0.0]  # when the Pick in flight is past its deadline (monotonic)

    def past_deadline() -> None:
        while time.monotonic() < deadline[0]:
            time.sleep(0.05)

    if late == "while_routing":
        route = state.route

        def slow(*a: Any, **kw: Any) -> Any:
            past_deadline()  # holds the loop past the caller's deadline
            routed.append(route(*a, **kw))
            return routed[-1]

        monkeypatch.setattr(state, "route", slow)
    else:
        record = router_service.record

        def slow_record(st: Any, done: Any) -> None:
            routed.append(done)
            record(st, done)
            past_deadline()  # past the caller's deadline, after the last check

        monkeypatch.setattr(router_service, "record", slow_record)
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN), loop_clock)
    _server, port = await gen.__anext__()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            await channel.channel_ready()  # (the deadline is the Pick's, not the connect's)
            tokens = list(range(9000, 9000 + 640))
            hashes = hash_prompt(tokens, 16, root_hash(MODEL)).hashes
            pick = router_pb2.PickRequest(
                model=MODEL, token_ids=router_pb2.TokenIds(ids=tokens), request_id="late"
            )
            # (a deadline the Pick reaches its slow stage within on a loaded machine)
            deadline[0] = time.monotonic() + 2.0 + 0.2
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Pick(pick, metadata=auth(), timeout=2.0)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await eventually(lambda: routed and state.load.in_flight() == 0)
            held = state.index.match(hashes).get(routed[0].decision.replica)
            assert held is None or held.kv_blocks == 0, held
            report = router_pb2.ReportRequest(
                decision_id="late", phase=router_pb2.ReportRequest.COMPLETED
            )
            assert not (await stub.Report(report, metadata=auth())).accepted
        recorder.flush()
        (row,) = [json.loads(line) for line in trace.read_text().splitlines()]
        assert row["status"] == CLIENT_CLOSED and row["input_length"] == 640, row
        assert not {"replica", "pred_hit", "cached", "ttft_ms"} & row.keys(), row
    finally:
        await gen.aclose()


async def test_a_pick_its_caller_cancelled_while_answered_releases_its_load(
    monkeypatch: Any,
) -> None:
    """A caller that cancels its Pick (no deadline: a gateway whose client went away, a
    channel closed) while the router builds or sends the reply never learns the replica: no
    request goes there and no Report comes. The decision must end when the call does (load,
    what it guessed the replica would cache, counted ``cancelled``), as for a deadline; not
    after the book's hour. grpc.aio's ``context.cancelled()`` stays False for a call the
    client cancelled (it reads the status the server set), so it cannot tell."""
    import threading

    import router.rpc.router_service as router_service

    state = _guessing_state()
    routed: list[Any] = []
    picked = threading.Event()
    record = router_service.record

    def slow_record(st: Any, done: Any) -> None:
        routed.append(done)
        record(st, done)
        picked.set()
        time.sleep(0.5)  # holds the loop, after the last check: the caller cancels meanwhile

    monkeypatch.setattr(router_service, "record", slow_record)
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN), loop_clock)
    _server, port = await gen.__anext__()
    tokens = list(range(9000, 9000 + 640))
    hashes = hash_prompt(tokens, 16, root_hash(MODEL)).hashes
    pick = router_pb2.PickRequest(
        model=MODEL, token_ids=router_pb2.TokenIds(ids=tokens), request_id="left"
    )
    seen: dict[str, bool] = {}

    def caller() -> None:  # a client of its own (its loop is not the held one)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = router_pb2_grpc.RouterStub(channel).Pick.future(pick, metadata=auth())
            seen["picked"] = picked.wait(10)
            seen["cancelled"] = call.cancel()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        await eventually(lambda: "cancelled" in seen)
        assert seen == {"picked": True, "cancelled": True}
        await eventually(lambda: state.load.in_flight() == 0, message="the load stays booked")
        held = state.index.match(hashes).get(routed[0].decision.replica)
        assert held is None or held.kv_blocks == 0, held
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="cancelled")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            report = router_pb2.ReportRequest(
                decision_id="left", phase=router_pb2.ReportRequest.COMPLETED
            )
            assert not (await stub.Report(report, metadata=auth())).accepted
    finally:
        await asyncio.to_thread(thread.join)
        await gen.aclose()


async def test_a_request_id_is_bounded_as_an_http_header_is(rpc: Any) -> None:
    """A Pick's ``request_id`` is kept with its decision (up to an hour, up to 100,000 of
    them) and in the recent decisions: HTTP bounds an ``X-Request-Id`` by the header block's
    limit (``server.max_header_kb``), so gRPC does too, rather than by the message size
    (megabytes per decision)."""
    from dataclasses import replace

    state, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    state.settings = replace(
        state.settings, server=replace(state.settings.server, max_header_kb=1.0)
    )
    ids = router_pb2.TokenIds(ids=list(range(200)))
    long_id = "r" * 2048
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Pick(
            router_pb2.PickRequest(model=MODEL, token_ids=ids, request_id=long_id),
            metadata=auth(),
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_header_kb" in (exc.value.details() or "")
    assert state.load.in_flight() == 0
    ok = await stub.Pick(
        router_pb2.PickRequest(model=MODEL, token_ids=ids, request_id="r" * 1000),
        metadata=auth(),
    )
    assert ok.decision_id == "r" * 1000


async def test_grpc_health_follows_readiness_and_the_drain() -> None:
    """The health service says what ``/ready`` says: the Router service (and the server as
    a whole, service "") is NOT_SERVING while a model has no available replica, and every
    service is NOT_SERVING from the moment a drain begins (SIGTERM: ``Running.cleanup``),
    not only once the HTTP requests in flight have ended. From then on the server takes no
    new call, as the HTTP side closes its listener and idle connections then (grpc's
    graceful stop: GOAWAY, so a client's channel reconnects to another router), while the
    calls in flight (an index publisher's stream) go on."""
    from router.core.types import ReplicaKey
    from router.rpc.server import GRPC_PORT
    from router.service.app import STATE
    from tests.backends import start_router

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, never answers (until the router lets go)
        writer.close()

    upstream = await asyncio.start_server(hang, "127.0.0.1", 0)
    up_port = upstream.sockets[0].getsockname()[1]
    settings = build_settings(
        {
            "server": {
                "grpc_port": 0,
                "health_interval_s": 0,
                "first_byte_timeout_s": 120,
                "first_byte_min_s": 120,
            },
            "replicas": [{"url": f"http://127.0.0.1:{up_port}", "model": MODEL, "name": "a"}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    state = running.app[STATE]
    stopping: asyncio.Task[None] | None = None
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.app[GRPC_PORT]}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            serving = health_pb2.HealthCheckResponse.SERVING

            async def status(service: str) -> int:
                req = health_pb2.HealthCheckRequest(service=service)
                return int((await health.Check(req)).status)

            assert await status("") == serving
            state.fleet.mark_unhealthy(ReplicaKey("a"), loop_clock())
            async with aiohttp.ClientSession() as http, http.get(url + "/ready") as ready:
                assert ready.status == 503

            async def router_down() -> bool:
                return await status("") != serving and await status("kvrouter.v1.Router") != serving

            await eventually(router_down, message="gRPC health SERVING while /ready is 503")
            assert await status("kvrouter.v1.Admin") == serving  # (to undrain, say)
            state.fleet.unhealthy_until.clear()
            state.load.set_health(ReplicaKey("a"), True)

            async def router_up() -> bool:
                return await status("") == serving and await status("kvrouter.v1.Router") == serving

            await eventually(router_up, message="gRPC health not SERVING again")

            names = ("", "kvrouter.v1.Router", "kvrouter.v1.Index", "kvrouter.v1.Admin")
            watches = [health.Watch(health_pb2.HealthCheckRequest(service=n)) for n in names]
            for watch in watches:
                assert (await watch.read()).status == serving
            # a call in flight through the drain: an index publisher's stream
            batches: asyncio.Queue[index_pb2.IndexEventBatch | None] = asyncio.Queue()

            async def publish() -> AsyncIterator[index_pb2.IndexEventBatch]:
                while (batch := await batches.get()) is not None:
                    yield batch

            def batch(seq: int) -> index_pb2.IndexEventBatch:
                stored = index_pb2.IndexEvent.STORED
                event = index_pb2.IndexEvent(type=stored, hashes=[seq])
                return index_pb2.IndexEventBatch(replica="a", seq=seq, events=[event])

            index = index_pb2_grpc.IndexStub(channel)
            stream = index.Publish(publish())
            await batches.put(batch(1))
            assert (await stream.read()).outcome == index_pb2.PublishAck.APPLIED
            picks = router_pb2_grpc.RouterStub(channel)
            pick = router_pb2.PickRequest(model=MODEL, text="hello")
            before = await picks.Pick(pick, timeout=30)  # a decision made before the drain
            assert before.replica == "a"

            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
                held = asyncio.create_task(http.post(url + "/v1/completions", json=body))
                await eventually(lambda: any(c.task for c in running.server.connections))
                stopping = asyncio.create_task(running.cleanup(60.0))
                for watch in watches:  # at once, to every watcher
                    assert (await watch.read()).status != serving
                in_flight = state.load.in_flight()

                async def refused() -> bool:
                    try:
                        await picks.Pick(pick, timeout=30)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                        return True
                    return False

                await eventually(refused, message="new Picks are routed during the drain")
                assert state.load.in_flight() == in_flight  # nothing booked after that
                # the decisions made before are still reported to this router
                report = router_pb2.ReportRequest(
                    decision_id=before.decision_id,
                    phase=router_pb2.ReportRequest.COMPLETED,
                )
                assert (await picks.Report(report, timeout=30)).accepted
                assert state.load.in_flight() == in_flight - 1
                assert not stopping.done()  # the HTTP request still holds the drain
                await batches.put(batch(2))  # the call in flight is still served
                assert (await stream.read()).outcome == index_pb2.PublishAck.APPLIED
                await batches.put(None)
                assert await stream.code() == grpc.StatusCode.OK
                held.cancel()
                with contextlib.suppress(BaseException):
                    await held
    finally:
        if stopping is None:
            await running.cleanup()
        else:
            await stopping
        upstream.close()


async def test_a_report_of_an_unknown_phase_is_invalid_and_applies_nothing(rpc: Any) -> None:
    """Phase is an open proto3 enum: a gateway built against a newer proto (or a bug) may send
    a value this router does not know. It is a malformed Report, INVALID_ARGUMENT naming
    the phase, as a missing phase is; it must not end the decision as an unnamed outcome
    (counted ``failed`` yet ending the replica's failure run, its slot and load freed)."""
    state, channel = rpc
    stub = router_pb2_grpc.RouterStub(channel)
    picked = await stub.Pick(router_pb2.PickRequest(model=MODEL, text="hi"), metadata=auth())
    assert state.load.in_flight() == 1
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.Report(
            router_pb2.ReportRequest(decision_id=picked.decision_id, phase=9), metadata=auth()
        )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "phase 9" in (exc.value.details() or "")
    assert state.load.in_flight() == 1  # the decision stands: its real Report ends it
    report = router_pb2.ReportRequest(decision_id=picked.decision_id, phase=2)
    assert (await stub.Report(report, metadata=auth())).accepted
    assert state.load.in_flight() == 0


async def test_call_metadata_is_bounded_as_an_http_header_block_is() -> None:
    """``server.max_header_kb`` bounds a call's metadata as it bounds an HTTP request's
    header block (431 there): within it a call is served, whatever grpc's own default
    metadata limits (8 KiB soft, 16 KiB hard) say; over it every kvrouter call is refused
    RESOURCE_EXHAUSTED with the HTTP answer's message, before its credentials are read."""
    import re

    from router.rpc.server import GRPC_PORT
    from tests.backends import start_router

    settings = _grpc_router_settings(max_header_kb=24)
    runner, url = await start_router(settings)
    try:
        port = runner.app[GRPC_PORT]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            pick = router_pb2.PickRequest(model=MODEL, text="hello there")
            within = (*auth(), ("x-trace", "t" * 20_000))
            resp = await stub.Pick(pick, metadata=within)
            assert resp.replica == "a"
            over = (("x-trace", "t" * 30_000),)
            for call in (
                lambda md: stub.Pick(pick, metadata=md),
                lambda md: admin_pb2_grpc.AdminStub(channel).Stats(
                    admin_pb2.StatsRequest(), metadata=md
                ),
            ):
                for md in (over, (*auth(), *over), (*auth(ADMIN), *over)):
                    with pytest.raises(grpc.aio.AioRpcError) as exc:
                        await call(md)
                    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    details = exc.value.details() or ""
                    assert re.fullmatch(
                        r"request headers are \d+ bytes; the limit is 24576 "
                        r"\(server\.max_header_kb\)",
                        details,
                    ), details
        # the HTTP answer to the same header: 431 with the same message
        async with (
            aiohttp.ClientSession() as http,
            http.get(url + "/health", headers={"x-trace": "t" * 30_000}) as answer,
        ):
            assert answer.status == 431
            message = (await answer.json())["error"]["message"]
            assert re.fullmatch(
                r"request headers are \d+ bytes; the limit is 24576 \(server\.max_header_kb\)",
                message,
            ), message
    finally:
        await runner.cleanup()


async def test_completed_picks_are_recorded_as_the_http_answers_are(tmp_path: Any) -> None:
    """With ``server.record_path`` a COMPLETED Report writes the Pick's trace row, as the
    HTTP relay writes an answer's (router.service.answer_relay ``record_answer``): gateway
    traffic was missing from the recording operators replay. A FAILED or REFUSED one is a
    row of offered load with the status reported (502 without one) and no outcome, as an
    HTTP request that got no answer; it was none, so a replay offered less load."""
    from router.recorder import RecordSettings, TraceRecorder, record_key

    trace = tmp_path / "trace.jsonl"
    state = RouterState(
        build_settings(
            {
                "server": {"record_path": str(trace), "record_key": "k"},
                "replicas": [{"url": "http://127.0.0.1:9", "model": MODEL, "name": "a"}],
                "models": {MODEL: kimi_model_table(block_size=16, speculative_ttl_s=0.0)},
            }
        )
    )
    loop = asyncio.get_running_loop()
    recorder = TraceRecorder(
        RecordSettings(trace, key=record_key("k")),
        started_at=loop.time(),
        wall_at_start=time.time(),
    )
    state.recorder = recorder
    gen = serve_grpc(state, GrpcSettings(port=0, token=TOKEN), loop_clock)
    _server, port = await gen.__anext__()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = router_pb2_grpc.RouterStub(channel)
    phase = router_pb2.ReportRequest
    try:
        msgs = json.dumps([{"role": "user", "content": "hello " * 200}])
        chat = await stub.Pick(
            router_pb2.PickRequest(model=MODEL, messages_json=msgs), metadata=auth()
        )
        for step in (phase.FIRST_TOKEN, phase.COMPLETED):
            report = phase(
                decision_id=chat.decision_id, phase=step, output_tokens=7, cached_tokens=0
            )
            assert (await stub.Report(report, metadata=auth())).accepted
        body = json.dumps({"prompt": "some words " * 60, "max_tokens": 3})
        pick = router_pb2.PickRequest(
            model=MODEL, request_json=body, request_path="/v1/completions"
        )
        whole = await stub.Pick(pick, metadata=auth())
        done = phase(decision_id=whole.decision_id, phase=phase.COMPLETED, output_tokens=3)
        assert (await stub.Report(done, metadata=auth())).accepted
        failed = await stub.Pick(
            router_pb2.PickRequest(model=MODEL, text="x " * 40), metadata=auth()
        )
        gone = phase(decision_id=failed.decision_id, phase=phase.FAILED)
        assert (await stub.Report(gone, metadata=auth())).accepted
        refused = await stub.Pick(pick, metadata=auth())
        for status in (0, 99, 600, 99999):  # no HTTP status: refused, not recorded as one
            bad = phase(decision_id=refused.decision_id, phase=phase.REFUSED, http_status=status)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.Report(bad, metadata=auth())
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "http_status" in (exc.value.details() or "")
        busy = phase(decision_id=refused.decision_id, phase=phase.REFUSED, http_status=429)
        assert (await stub.Report(busy, metadata=auth())).accepted
        # the client left after 2 tokens: offered load (CLIENT_CLOSED), no failure, no miss
        left = await stub.Pick(pick, metadata=auth())
        for step in (phase.FIRST_TOKEN, phase.CANCELLED):
            report = phase(decision_id=left.decision_id, phase=step, output_tokens=2)
            assert (await stub.Report(report, metadata=auth())).accepted
        page = state.metrics.render().decode()
        outcome = partial(metric_sample, page, "kvrouter_requests_total", model=MODEL)
        assert outcome(outcome="cancelled") == 1 and outcome(outcome="failed") == 2
        recorder.flush()
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
        assert len(rows) == 5, rows
        first, second, *no_answer = rows
        assert [row.get("status") for row in no_answer] == [502, 429, 499], no_answer
        assert no_answer[2]["output_length"] == 2 and no_answer[2]["stream"] is True
        for row in no_answer:
            assert not {"replica", "pred_hit", "cached", "ttft_ms"} & row.keys(), row
        assert no_answer[1]["endpoint"] == "completions" and no_answer[1]["output_length"] == 3
        assert first["endpoint"] == "chat" and first["stream"] is True
        assert first["input_length"] == chat.prompt_tokens and first["output_length"] == 7
        assert first["replica"] == "a/0" and first["pred_hit"] == chat.usable_hit_tokens
        assert first["cached"] == 0 and first["ttft_ms"] <= first["e2e_ms"]
        assert second["endpoint"] == "completions" and second["stream"] is False
        assert second["input_length"] == whole.prompt_tokens and second["output_length"] == 3
        assert "cached" not in second  # not reported
    finally:
        await channel.close()
        await gen.aclose()
