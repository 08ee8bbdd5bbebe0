"""SLO-aware admission at the front door (router/service/admission.py): ``service_tier``
checks, refusal with 429 + Retry-After, a held request released when capacity frees, and a
held request whose client leaves taken out of the queue. Real HTTP on loopback; a backend
held on an event stands for a busy replica."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import openai
import pytest

from router.core.admission import AdmissionQueue, AdmissionSettings
from router.core.errors import ConfigError
from router.rpc.gen import router_pb2, router_pb2_grpc
from router.service.app import STATE
from router.service.config import build_settings
from router.service.keys import GRPC_PORT
from router.service.state import RouterState
from tests.backends import Backend, kimi_model_table, start_router
from tests.test_audit_metrics import series
from tests.waiting import eventually

MODEL = "kimi-test"
PROMPT = "Why is the sky blue? " * 30


@dataclass
class Door:
    url: str
    state: RouterState
    backend: Backend
    http: aiohttp.ClientSession
    backends: list[Backend]
    running: Any = None  # router.service.app.Running
    stopped: bool = False

    async def stop(self, timeout: float) -> None:
        """Stop the router as SIGTERM does (``Running.cleanup``)."""
        self.stopped = True
        await self.running.cleanup(timeout)

    async def post(self, tier: str | None = None, **extra: Any) -> aiohttp.ClientResponse:
        body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}
        if tier is not None:
            body["service_tier"] = tier
        return await self.http.post(self.url + "/v1/completions", json=body)

    def queue(self) -> AdmissionQueue:
        queue: AdmissionQueue = self.state.admission._models[MODEL].queue
        return queue

    def held(self) -> int:
        return len(self.queue())

    async def one_held(self) -> tuple[asyncio.Task[Any], asyncio.Task[Any]]:
        """A priority request keeps the backend busy (its gate closed) while a second one
        is held by admission: their tasks, (in flight, held)."""
        self.backend.gate = asyncio.Event()
        first = asyncio.create_task(self.post("priority"))
        await eventually(lambda: len(self.backend.received) == 1)
        held = asyncio.create_task(self.post())
        await eventually(lambda: self.held() == 1)
        return first, held

    async def leave_while_held(self) -> None:
        """A priority request keeps the backend busy (its gate closed) while a second one,
        held by admission, is left by its client; then the first is answered."""
        first, gone = await self.one_held()
        gone.cancel()  # the client closes its connection while held
        with pytest.raises(asyncio.CancelledError):
            await gone
        await eventually(lambda: self.held() == 0)
        self.backend.gate.set()
        async with await first as r:
            assert r.status == 200

    async def metric(self, name: str) -> dict[str, float]:
        async with self.http.get(self.url + "/metrics") as r:
            return series(await r.text(), name)


async def _door(
    admission: dict[str, Any],
    slo: dict[str, Any],
    replicas: int = 1,
    server: dict[str, Any] | None = None,
) -> AsyncIterator[Door]:
    backends = [await Backend(f"b{i}", [MODEL]).start() for i in range(replicas)]
    backend = backends[0]
    settings = build_settings(
        {
            "server": server or {},
            "replicas": [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            "models": {
                MODEL: kimi_model_table(
                    context_length=100_000, slo=slo, admission={"enabled": True, **admission}
                )
            },
        }
    )
    runner, url = await start_router(settings)
    http = aiohttp.ClientSession()
    d = Door(url, runner.app[STATE], backend, http, backends, runner)
    try:
        yield d
    finally:
        for b in backends:
            if b.gate is not None:
                b.gate.set()
        await http.close()
        if not d.stopped:
            await runner.cleanup()
        for b in backends:
            await b.stop()


@pytest.fixture
async def impossible() -> AsyncIterator[Door]:
    """A TTFT target no request can meet."""
    async for d in _door({}, {"ttft_s": 1e-9}):
        yield d


@pytest.fixture
async def protective() -> AsyncIterator[Door]:
    """Priority requests in flight leave no decode-stall headroom to default ones, whose
    TTFT target is long: a default request is held while a priority one runs."""
    knobs = {
        "stall_share": [1e-9, 0.5, 0.5],
        "max_stall": [float("inf"), 1e-9, 1e-9],
        "max_hold_s": 60.0,
    }
    async for d in _door(knobs, {"ttft_s": 100.0}):
        yield d


@pytest.fixture
async def pair() -> AsyncIterator[Door]:
    """Two replicas, every request admitted at once (a long TTFT target)."""
    async for d in _door({}, {"ttft_s": 100.0}, replicas=2):
        yield d


def test_config_reads_the_admission_table() -> None:
    table = kimi_model_table(admission={"enabled": True, "headroom": [1, 0.6, 0.2]})
    settings = build_settings({"models": {MODEL: table}})
    assert settings.model(MODEL).admission == AdmissionSettings(headroom=(1, 0.6, 0.2))
    off = build_settings({"models": {MODEL: kimi_model_table(admission={"headroom": [1, 1, 1]})}})
    assert off.model(MODEL).admission is None  # enabled defaults to false
    for bad in ({"enabled": "yes"}, {"enabled": True, "headroom": [2, 1, 1]}, {"nope": 1}):
        with pytest.raises(ConfigError, match="admission"):
            build_settings({"models": {MODEL: kimi_model_table(admission=bad)}})


async def test_a_bad_service_tier_is_a_400(impossible: Door) -> None:
    async with await impossible.post("gold") as r:
        assert r.status == 400
        error = (await r.json())["error"]
        assert "service_tier" in error["message"] and error["type"] == "invalid_request_error"


@pytest.fixture
async def tiered() -> AsyncIterator[Door]:
    """Short prompts must start within 50 ms, long ones within 1000 s: a long prompt in
    flight (its prefill predicted to take about a second) keeps the replica from meeting a
    short one's target, which an idle replica meets."""
    async for d in _door({}, {"ttft_tiers": "1000:0.05,*:1000"}):
        yield d


async def test_a_request_that_cannot_meet_its_slo_now_is_refused_at_once(tiered: Door) -> None:
    d = tiered
    d.backend.gate = asyncio.Event()
    long_prompt = "The tides rise and fall with the moon, day after day. " * 4000
    first = asyncio.create_task(d.post(prompt=long_prompt))
    await eventually(lambda: len(d.backend.received) == 1)
    for tier in (None, "priority", "flex"):
        async with await d.post(tier) as r:
            assert r.status == 429, await r.text()
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            error = (await r.json())["error"]
            assert error["code"] == "slo_deadline" and error["type"] == "rate_limit_error"
    assert len(d.backend.received) == 1  # never sent, never held
    assert d.held() == 0
    shed = await d.metric("kvrouter_admission_shed_total")
    assert shed[f'{{class="priority",model="{MODEL}",reason="deadline"}}'] == 1.0
    assert sum(shed.values()) == 3.0
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200


async def test_a_request_no_idle_replica_could_serve_in_time_is_served_when_one_is_free(
    impossible: Door,
) -> None:
    """A request whose own prefill misses its TTFT target even on an idle replica (a prompt
    too long for its class's target) was refused however idle the fleet: it could never be
    served. It is judged with its prefill added to its budget: served by an idle fleet (its
    SLO still judged missed), refused with a Retry-After worth following while the replica
    is busy with another prefill."""
    client = openai.AsyncOpenAI(base_url=impossible.url + "/v1", api_key="k", max_retries=0)
    for tier in ("default", "priority", "flex"):
        got = await client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"service_tier": tier}
        )
        assert got.choices
    await client.close()
    assert len(impossible.backend.received) == 3
    d = impossible
    d.backend.gate = asyncio.Event()
    long_prompt = "The tides rise and fall with the moon, day after day. " * 4000
    first = asyncio.create_task(d.post(prompt=long_prompt))
    await eventually(lambda: len(d.backend.received) == 4)
    async with await d.post() as r:
        assert r.status == 429, await r.text()
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        assert (await r.json())["error"]["code"] == "slo_deadline"
    assert len(d.backend.received) == 4 and d.held() == 0
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200


async def test_a_held_request_goes_when_capacity_frees(protective: Door) -> None:
    d = protective
    first, held = await d.one_held()
    depth = await d.metric("kvrouter_admission_held")
    assert depth[f'{{class="default",model="{MODEL}"}}'] == 1.0
    d.backend.gate.set()  # the priority request completes: the held one may go
    for task in (first, held):
        async with await task as r:
            assert r.status == 200, await r.text()
    assert d.held() == 0 and len(d.backend.received) == 2
    waits = await d.metric("kvrouter_admission_wait_seconds_count")
    assert waits[f'{{class="default",model="{MODEL}"}}'] == 1.0


# as ``protective``, with room for two held requests
CROWDED: dict[str, Any] = {
    "stall_share": [1e-9, 0.5, 0.5],
    "max_stall": [float("inf"), 1e-9, 1e-9],
    "max_hold_s": 60.0,
    "max_queue": 2,
}


@pytest.fixture
async def crowded() -> AsyncIterator[Door]:
    """As ``protective``, with room for two held requests."""
    async for d in _door(CROWDED, {"ttft_s": 100.0}):
        yield d


FULL = (
    "the router is overloaded: the admission queue has no place for this flex-class request;"
    " retry later"
)


async def test_a_full_queue_refuses_the_worst_class_not_a_better_newcomer(
    crowded: Door,
) -> None:
    """Held requests go best class first, so a full queue keeps its places for the best: a
    default request arriving while flex ones fill the queue is held (and served), and the
    flex one that would have gone last is refused in its place, 429 ``slo_queue_full`` with
    ``Retry-After``; a flex request arriving then is refused itself."""
    d = crowded
    d.backend.gate = asyncio.Event()
    first = asyncio.create_task(d.post("priority"))
    await eventually(lambda: len(d.backend.received) == 1)
    flex = [asyncio.create_task(d.post("flex", prompt=f"{i} {PROMPT}")) for i in range(2)]
    await eventually(lambda: d.queue().depth(2) == 2)
    default = asyncio.create_task(d.post())
    await eventually(lambda: default.done() or d.queue().depth(1) == 1)
    assert not default.done() and d.held() == 2
    done, _ = await asyncio.wait(flex, return_when=asyncio.FIRST_COMPLETED)
    (out,) = done
    async with await out as r:
        assert r.status == 429, await r.text()
        assert 1 <= int(r.headers["Retry-After"]) <= 60
        error = (await r.json())["error"]
        assert error["code"] == "slo_queue_full" and error["type"] == "rate_limit_error"
        assert error["message"] == FULL
    async with await d.post("flex") as r:  # none held is worse than flex: refused
        error = (await r.json())["error"]
        assert r.status == 429 and error["code"] == "slo_queue_full"
        assert error["message"] == FULL
    d.backend.gate.set()
    (kept,) = [t for t in flex if t is not out]
    for task in (first, default, kept):
        async with await task as r:
            assert r.status == 200, await r.text()
    shed = await d.metric("kvrouter_admission_shed_total")
    assert shed == {f'{{class="flex",model="{MODEL}",reason="queue_full"}}': 2.0}, shed
    decisions = await d.metric("kvrouter_admission_decisions_total")
    assert sum(decisions.values()) == 5.0, decisions  # one first answer each
    assert d.held() == 0 and d.state.load.in_flight() == 0


@pytest.fixture
async def brief(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Door]:
    """As ``crowded``, held at most 0.2 s; the pump looks at the queue only when a request
    finishes (no tick), so held requests outlive their hold unless an arrival looks."""
    import router.service.admission as service_admission

    monkeypatch.setattr(service_admission, "TICK_S", 3600.0)
    async for d in _door({**CROWDED, "max_hold_s": 0.2}, {"ttft_s": 100.0}):
        yield d


async def test_an_arrival_is_judged_without_the_held_requests_past_their_hold(
    brief: Door,
) -> None:
    """A new request is judged against the held requests that can still be served: those
    past ``max_hold_s`` (or their deadline) are refused first, as the simulator's pump does
    on each arrival. They were counted until the pump's next look (up to 50 ms later), so
    a full queue of them refused the newcomer ``slo_queue_full`` (and their work ahead of
    it could refuse it ``slo_deadline``) while the simulator held it."""
    d = brief
    loop = asyncio.get_running_loop()
    d.backend.gate = asyncio.Event()
    first = asyncio.create_task(d.post("priority"))
    await eventually(lambda: len(d.backend.received) == 1)
    stale = [asyncio.create_task(d.post(prompt=f"{i} {PROMPT}")) for i in range(2)]
    await eventually(lambda: d.held() == 2)
    held_at = loop.time()
    await eventually(lambda: loop.time() > held_at + 0.25)  # both past their 0.2 s hold
    newcomer = asyncio.create_task(d.post())
    await eventually(lambda: newcomer.done() or all(t.done() for t in stale))
    assert not newcomer.done() and d.held() == 1  # held: the queue had room
    for task in stale:
        async with await task as r:
            assert r.status == 429, await r.text()
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            assert (await r.json())["error"]["code"] == "slo_deadline"
    d.backend.gate.set()  # the priority request finishes: the pump looks at the newcomer
    async with await first as r:
        assert r.status == 200
    async with await newcomer as r:
        assert r.status in (200, 429), await r.text()  # sent, or refused past its hold
    shed = await d.metric("kvrouter_admission_shed_total")
    assert shed.get(f'{{class="default",model="{MODEL}",reason="queue_full"}}', 0.0) == 0.0
    assert d.held() == 0


async def test_a_client_that_leaves_leaves_the_queue(protective: Door) -> None:
    d = protective
    await d.leave_while_held()
    assert len(d.backend.received) == 1  # the one that left was never sent
    assert d.state.load.in_flight() == 0


async def test_a_held_request_whose_replicas_all_leave_is_answered_as_a_new_one(
    protective: Door,
) -> None:
    """A held request that no replica can take any more (drained, unhealthy) is answered at
    once as a request arriving now is, 503 naming the cause: not held for ``max_hold_s``
    (60 s here) to be refused then as one that missed its TTFT target."""
    d = protective
    first, held = await d.one_held()
    (key,) = d.state.registry.keys_for(MODEL)
    d.state.fleet.set_draining(key, True)
    await eventually(held.done)
    async with await held as r:
        assert r.status == 503, await r.text()
        assert r.headers["Retry-After"] == "1"
        error = (await r.json())["error"]
        assert error["code"] == "no_replica_available" and "draining" in error["message"]
    assert d.held() == 0 and len(d.backend.received) == 1
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200


@pytest.fixture
async def bounded() -> AsyncIterator[Door]:
    """As ``protective``, with room for 1000 bytes of held bodies."""
    knobs = dict(CROWDED, max_queue=1024, max_queue_mb=1000 / 2**20)
    async for d in _door(knobs, {"ttft_s": 100.0}):
        yield d


async def test_held_bodies_are_bounded_in_bytes(bounded: Door) -> None:
    """A held request keeps its body: past ``max_queue_mb`` of held bodies a request that
    would be held is refused at once, 429 ``slo_queue_full`` with ``Retry-After``; a
    smaller one is held."""
    d = bounded
    d.backend.gate = asyncio.Event()
    first = asyncio.create_task(d.post("priority"))
    await eventually(lambda: len(d.backend.received) == 1)
    async with await d.post(prompt=PROMPT * 2) as r:  # over 1000 bytes
        assert r.status == 429, await r.text()
        assert int(r.headers["Retry-After"]) >= 1
        error = (await r.json())["error"]
        assert error["code"] == "slo_queue_full" and error["type"] == "rate_limit_error"
    assert d.held() == 0
    small = asyncio.create_task(d.post(prompt="Why?"))
    await eventually(lambda: d.held() == 1)
    d.backend.gate.set()
    for task in (first, small):
        async with await task as r:
            assert r.status == 200, await r.text()
    assert d.held() == 0 and d.queue().held_bytes == 0


@pytest.fixture
async def stoppable() -> AsyncIterator[Door]:
    """As ``protective`` (a default request is held while a priority one runs, for up to
    60 s), with gRPC on: held Picks too."""
    async for d in _door(dict(CROWDED, max_queue=1024), {"ttft_s": 100.0}, server={"grpc_port": 0}):
        yield d


async def test_requests_held_when_the_router_stops_are_answered_at_once(stoppable: Door) -> None:
    """A request held by admission when the router stops (SIGTERM: ``Running.cleanup``) is
    answered at once, 503 ``router_stopping`` with ``Retry-After`` (gRPC: UNAVAILABLE with
    its retry trailers), for its client to retry elsewhere: a hold (``max_hold_s`` 60 s)
    longer than the drain would otherwise end in a dropped connection at its deadline. A
    Pick that arrives during the drain is refused so too, before admission judges it (as the
    HTTP listener closes then, docs/grpc.md). The request in flight runs to its end."""
    d = stoppable
    first, held = await d.one_held()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}")
    stub = router_pb2_grpc.RouterStub(channel)
    pick = router_pb2.PickRequest(model=MODEL, text=PROMPT)
    picked = asyncio.ensure_future(stub.Pick(pick, timeout=60))
    await eventually(lambda: d.held() == 2)
    stopping = asyncio.create_task(d.stop(30.0))
    try:
        async with await held as r:
            assert r.status == 503, await r.text()
            assert int(r.headers["Retry-After"]) >= 1
            error = (await r.json())["error"]
            assert error["code"] == "router_stopping" and error["type"] == "service_unavailable"
            assert "stopping" in error["message"]
        for call in (picked, stub.Pick(pick, timeout=60)):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stopping" in (exc.value.details() or "")
            trailers = dict(exc.value.trailing_metadata() or ())
            assert int(trailers["retry-after"]) >= 1
        assert d.held() == 0 and len(d.backend.received) == 1
        assert not first.done() and not stopping.done()  # answered before the drain's end
    finally:
        d.backend.gate.set()
        await channel.close()
    async with await first as r:
        assert r.status == 200
    await stopping
    assert d.state.load.in_flight() == 0
    # the Pick that came during the drain never reached admission
    (family,) = d.state.metrics.admission_decisions.collect()
    counted = {s.labels["action"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert counted == {"admit": 1.0, "hold": 2.0}, counted


async def test_a_retry_moves_the_stall_allowance(pair: Door) -> None:
    d = pair
    for b in d.backends:
        b.gate = asyncio.Event()
    task = asyncio.create_task(d.post(max_tokens=200))
    await eventually(lambda: sum(len(b.received) for b in d.backends) == 1)
    first = next(b for b in d.backends if b.received)
    other = next(b for b in d.backends if b is not first)
    rid = first.received[0]["headers"]["x-request-id"]
    queue = d.queue()
    failed = d.state.load.replica_of(rid)
    assert failed is not None and failed.replica == first.name
    assert queue.stall.headroom(failed) < float("inf")  # its allowance is on the replica
    first.fail_next = 1
    assert first.gate is not None
    first.gate.set()  # it answers 500: the request is retried on the other replica
    await eventually(lambda: len(other.received) == 1)
    retried = d.state.load.replica_of(rid)
    assert retried is not None and retried.replica == other.name
    # the failed replica protects nothing of it any more; the one decoding it does
    assert queue.stall.headroom(failed) == float("inf")
    assert queue.stall.headroom(retried) < float("inf")
    assert other.gate is not None
    other.gate.set()
    async with await task as r:
        assert r.status == 200, await r.text()
    assert len(queue.stall) == 0


async def test_a_held_request_keeps_its_id_from_other_models() -> None:
    """A held request is in no load record yet; a request of another model (admission off)
    sent meanwhile with the same X-Request-Id must not share its accounting."""
    other_model = "kimi-other"
    held_on = await Backend("b0", [MODEL]).start()
    plain = await Backend("b1", [other_model]).start()
    admission = {
        "enabled": True,
        "stall_share": [1e-9, 0.5, 0.5],
        "max_stall": [float("inf"), 1e-9, 1e-9],
        "max_hold_s": 60.0,
    }
    settings = build_settings(
        {
            "replicas": [
                {"url": held_on.url, "model": MODEL, "name": "b0"},
                {"url": plain.url, "model": other_model, "name": "b1"},
            ],
            "models": {
                MODEL: kimi_model_table(slo={"ttft_s": 100.0}, admission=admission),
                other_model: kimi_model_table(),
            },
        }
    )
    runner, url = await start_router(settings)
    state: RouterState = runner.app[STATE]
    held_on.gate, plain.gate = asyncio.Event(), asyncio.Event()
    try:
        async with aiohttp.ClientSession() as http:

            def post(model: str, rid: str, tier: str = "default") -> Any:
                body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "service_tier": tier}
                return http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid})

            first = asyncio.create_task(post(MODEL, "p", "priority"))
            await eventually(lambda: len(held_on.received) == 1)
            held = asyncio.create_task(post(MODEL, "dup"))
            await eventually(lambda: len(state.admission._models[MODEL].queue) == 1)
            other = asyncio.create_task(post(other_model, "dup"))
            await eventually(lambda: len(plain.received) == 1)
            held_on.gate.set()  # the held request goes, while the other model's is in flight
            for task in (first, held):
                async with await task as r:
                    assert r.status == 200, await r.text()
            assert state.load.in_flight() == 1  # the other model's request is still counted
            plain.gate.set()
            async with await other as r:
                assert r.status == 200
            assert state.load.in_flight() == 0
    finally:
        held_on.gate.set()
        plain.gate.set()
        await runner.cleanup()
        await held_on.stop()
        await plain.stop()


@pytest.fixture
async def impatient() -> AsyncIterator[Door]:
    """Every request admitted at once; no retry, and a short wait for a first byte."""
    server = {"max_retries": 0, "first_byte_timeout_s": 0.2, "first_byte_min_s": 0.1}
    async for d in _door({}, {"ttft_s": 100.0}, server=server):
        yield d


async def test_an_id_reused_while_an_error_is_written_keeps_its_allowance(
    impatient: Door, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request the forwarder gives up on leaves the load model before its error is written;
    a request sent meanwhile under its id (a client retrying at once) must keep its own
    decode-stall allowance when the first one's handler ends."""
    import router.service.proxy as proxy

    writing = asyncio.Event()
    written = asyncio.Event()
    real = proxy.send_error

    async def slow(*a: Any, **kw: Any) -> None:
        writing.set()
        await written.wait()
        await real(*a, **kw)

    monkeypatch.setattr(proxy, "send_error", slow)
    d = impatient
    d.backend.hang = True  # no first byte in time: 504
    headers = {"X-Request-Id": "same"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200}
    url = d.url + "/v1/completions"
    first = asyncio.create_task(d.http.post(url, json=body, headers=headers))
    await eventually(writing.is_set)
    d.backend.hang = False
    d.backend.gate = asyncio.Event()
    again = asyncio.create_task(d.http.post(url, json=body, headers=headers))
    await eventually(lambda: len(d.backend.received) == 2)
    written.set()
    async with await first as r:
        assert r.status == 504
    assert len(d.queue().stall) == 1  # still tracked while it runs
    d.backend.gate.set()
    async with await again as r:
        assert r.status == 200
    assert len(d.queue().stall) == 0


async def test_a_held_request_is_timed_from_its_arrival(protective: Door) -> None:
    """Admission's deadline runs from a request's arrival, as the simulator's TTFT does: the
    router's TTFT histogram and SLO counter time a held request from then, not from its
    dispatch (its hold would otherwise count as met)."""
    d = protective
    d.backend.gate = asyncio.Event()  # the priority request is answered once the other is held
    first = asyncio.create_task(d.post("priority", stream=True))
    await eventually(lambda: len(d.backend.received) == 1)
    held = asyncio.create_task(d.post(stream=True))
    await eventually(lambda: d.held() == 1)
    d.backend.delay_s = 0.5  # answers (the priority one's first) start no sooner than this
    d.backend.gate.set()
    for task in (first, held):
        async with await task as r:
            assert r.status == 200, await r.text()
            await r.read()
    waits = await d.metric("kvrouter_admission_wait_seconds_sum")
    assert waits[f'{{class="default",model="{MODEL}"}}'] > 0.25  # it was held
    fast = await d.metric("kvrouter_ttft_seconds_bucket")
    assert fast[f'{{le="0.25",model="{MODEL}"}}'] == 0.0, fast


@pytest.fixture
async def keyed() -> AsyncIterator[Door]:
    """Every request admitted at once; one priority key and one flex key."""
    server = {"priority_keys": "gold", "flex_keys": "batch"}
    async for d in _door({}, {"ttft_s": 100.0}, server=server):
        yield d


async def test_a_flex_key_asking_for_default_is_served_default_with_priority_keys(
    keyed: Door,
) -> None:
    """``server.flex_keys``: flex "unless it asks otherwise"; ``server.priority_keys`` only
    stops other keys from asking for *priority*. A flex key asking for ``default`` is a
    default request whether or not priority keys are configured."""
    d = keyed
    for key, tier in (
        ("batch", "default"),  # asks otherwise: default
        ("batch", None),  # flex by its key
        ("batch", "priority"),  # may not ask for priority: its key's class
        ("other", "priority"),  # likewise: default
        ("gold", "priority"),
    ):
        body: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
        if tier is not None:
            body["service_tier"] = tier
        headers = {"Authorization": f"Bearer {key}"}
        async with d.http.post(d.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
    got = await d.metric("kvrouter_admission_decisions_total")
    by_class = {c: 0.0 for c in ("priority", "default", "flex")}
    for labels, n in got.items():
        for c in by_class:
            if f'class="{c}"' in labels:
                by_class[c] += n
    assert by_class == {"priority": 1.0, "default": 2.0, "flex": 2.0}, got


async def test_a_client_that_leaves_as_its_held_request_goes_takes_back_its_dispatch(
    protective: Door,
) -> None:
    """The pump commits a held request (load record, speculative index entries, session
    hint) and its client leaves before its handler runs again: the request never reaches
    the replica, so the index must not keep predicting a hit there for its prompt."""
    from router.service.intake import admit

    d = protective
    state = d.state
    adm = state.admission
    assert adm is not None
    loop = asyncio.get_running_loop()
    d.backend.gate = asyncio.Event()
    first = asyncio.create_task(d.post("priority"))
    await eventually(lambda: len(d.backend.received) == 1)
    other = "Tell me about the tides of the northern seas, in detail. " * 30
    body = {"model": MODEL, "prompt": other, "max_tokens": 4}
    admitted = await admit(state, body, len(other), "completion")

    def hit() -> int:
        probe = state.decide(MODEL, admitted.prompt, "probe", loop.time())
        return state.engines[MODEL].best_usable_tokens(probe.request, probe.candidates)

    assert hit() == 0  # nothing of it anywhere
    held = asyncio.create_task(
        adm.route(
            MODEL,
            admitted.prompt,
            "held",
            loop.time(),
            klass=1,
            tenant="",
            session_id=None,
            max_output_tokens=4,
        )
    )
    await eventually(lambda: d.held() == 1)
    m = adm._models[MODEL]
    assert m is not None
    priority_rid = d.backend.received[0]["headers"]["x-request-id"]
    m.queue.finished(priority_rid)  # the priority request no longer needs protecting ...
    charged = m.queue.counter("")
    adm._step(m, loop.time())  # ... so the pump commits the held one
    assert state.load.replica_of("held") is not None and hit() > 0
    assert m.queue.counter("") > charged  # its tenant charged for its uncached prompt
    held.cancel()  # and its client leaves before its handler runs again
    with pytest.raises(asyncio.CancelledError):
        await held
    assert state.load.replica_of("held") is None
    assert hit() == 0  # never sent: not predicted there
    assert m.queue.counter("") == charged  # nor charged to its tenant's fairness counter
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200


async def test_engine_priority_gives_each_class_vllms_priority_field() -> None:
    """``engine_priority``: the engines schedule by vLLM's ``priority`` (lower first), so the
    body each replica gets carries its class's, overriding the client's own; without it the
    body goes as it came."""
    async for door in _door({"engine_priority": True}, {"ttft_s": 100.0}):
        for tier, want in (("priority", -1), (None, 0), ("flex", 1)):
            async with await door.post(tier, priority=-50) as r:
                assert r.status == 200, await r.text()
            assert door.backend.received[-1]["body"]["priority"] == want
    async for door in _door({}, {"ttft_s": 100.0}):
        async with await door.post("priority", priority=7) as r:
            assert r.status == 200
        async with await door.post("priority") as r:
            assert r.status == 200
        assert [x["body"].get("priority") for x in door.backend.received] == [7, None]


@pytest.fixture
async def protective_pair() -> AsyncIterator[Door]:
    """As ``protective``, with two replicas and gRPC on."""
    knobs = {
        "stall_share": [1e-9, 0.5, 0.5],
        "max_stall": [float("inf"), 1e-9, 1e-9],
        "max_hold_s": 60.0,
    }
    async for d in _door(knobs, {"ttft_s": 100.0}, replicas=2, server={"grpc_port": 0}):
        yield d


async def test_a_pick_with_candidates_is_admitted_among_them(protective_pair: Door) -> None:
    """A Pick naming ``candidates`` is judged by admission as any request of the model is,
    among its candidates only: before, it skipped admission (never held, never shed). Here
    the only candidate is busy with a priority request, so the Pick is held though another
    replica is free, and goes to its candidate once that one is."""
    d = protective_pair
    for b in d.backends:
        b.gate = asyncio.Event()
    first = asyncio.create_task(d.post("priority"))
    await eventually(lambda: sum(len(b.received) for b in d.backends) == 1)
    busy = next(b for b in d.backends if b.received)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}")
    stub = router_pb2_grpc.RouterStub(channel)
    try:
        pick = router_pb2.PickRequest(model=MODEL, text=PROMPT, candidates=[busy.name])
        picked = asyncio.ensure_future(stub.Pick(pick, timeout=60))
        await eventually(lambda: d.held() == 1)
        assert not picked.done()
        busy.gate.set()  # the priority request ends: its replica has room again
        async with await first as r:
            assert r.status == 200
        reply = await picked
        assert reply.replica == busy.name
        done = router_pb2.ReportRequest(
            decision_id=reply.decision_id, phase=router_pb2.ReportRequest.COMPLETED
        )
        assert (await stub.Report(done)).accepted
    finally:
        await channel.close()


@pytest.fixture
async def tiered_grpc() -> AsyncIterator[Door]:
    """As ``tiered``, with gRPC on."""
    async for d in _door({}, {"ttft_tiers": "1000:0.05,*:1000"}, server={"grpc_port": 0}):
        yield d


async def test_requests_shed_are_recorded_as_offered_load(tiered_grpc: Door, tmp_path: Any) -> None:
    """A recorded trace replays the traffic the router was offered: a request admission
    shed is a row too (``status`` 429, no replica, no outcome; a gRPC Pick's as its HTTP
    equivalent's), else a replay of an overloaded hour offers only what was served. A
    request the client got wrong (400) is none."""
    import json
    import time

    from router.recorder import RecordSettings, TraceRecorder, record_key

    d = tiered_grpc
    trace = tmp_path / "trace.jsonl"
    loop = asyncio.get_running_loop()
    recorder = TraceRecorder(
        RecordSettings(trace, key=record_key("k")),
        started_at=loop.time(),
        wall_at_start=time.time(),
    )
    d.state.recorder = recorder
    d.backend.gate = asyncio.Event()
    long_prompt = "The tides rise and fall with the moon, day after day. " * 4000
    first = asyncio.create_task(d.post(prompt=long_prompt))
    await eventually(lambda: len(d.backend.received) == 1)
    async with await d.post(stream=True) as r:
        assert r.status == 429, await r.text()
    async with await d.post(max_tokens="many") as r:
        assert r.status == 400, await r.text()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}")
    try:
        body = '{"prompt": "' + PROMPT + '", "max_tokens": 5}'
        pick = router_pb2.PickRequest(
            model=MODEL, request_json=body, request_path="/v1/completions"
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await router_pb2_grpc.RouterStub(channel).Pick(pick, timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await channel.close()
    d.backend.gate.set()
    async with await first as r:
        assert r.status == 200
    recorder.flush()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    shed = [row for row in rows if "status" in row]
    assert len(shed) == 2 and len(rows) == 3, rows
    http, rpc = shed
    assert http["status"] == 429 and http["endpoint"] == "completions" and http["stream"] is True
    assert http["output_length"] == 4 and http["input_length"] > 100 and http["hash_ids"]
    assert rpc["status"] == 429 and rpc["endpoint"] == "completions" and "stream" not in rpc
    assert rpc["output_length"] == 5 and rpc["hash_ids"] == http["hash_ids"]
    for row in shed:
        assert not {"replica", "pred_hit", "cached", "ttft_ms"} & row.keys(), row


@pytest.fixture
async def roomy_grpc() -> AsyncIterator[Door]:
    """Admission that admits every request at once (a long TTFT target), with gRPC on."""
    async for d in _door({}, {"ttft_s": 100.0}, server={"grpc_port": 0}):
        yield d


@pytest.mark.parametrize("late", ["after_admission", "after_the_last_check"])
async def test_a_pick_its_caller_never_heard_back_is_not_charged_to_its_tenant(
    roomy_grpc: Door, monkeypatch: Any, late: str
) -> None:
    """A Pick admission dispatched at once charges its tenant's fairness counter for its
    uncached prompt (as an HTTP request is). When its deadline passes before the reply
    reaches the caller (while it was admitted, or after the Pick's last check), its caller
    never learns the replica and the request never goes there: the Pick takes back its
    load and guess, and, as a held HTTP request its client left as it was committed does,
    its tenant's charge; else the tenant is ordered behind others for work it never got."""
    import time

    import router.rpc.router_service as router_service

    deadline = [0.0]

    def past_deadline() -> None:  # holds the loop past the caller's deadline
        while time.monotonic() < deadline[0]:
            time.sleep(0.05)

    d = roomy_grpc
    adm = d.state.admission
    assert adm is not None
    if late == "after_admission":
        route = adm.route

        async def slow(*a: Any, **kw: Any) -> Any:
            routed = await route(*a, **kw)
            past_deadline()
            return routed

        monkeypatch.setattr(adm, "route", slow)
    else:
        record = router_service.record

        def slow_record(st: Any, done: Any) -> None:
            record(st, done)
            past_deadline()

        monkeypatch.setattr(router_service, "record", slow_record)
    async with await d.post() as r:  # (the model's admission state is made with one)
        assert r.status == 200
    charged = d.queue().counter("")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}") as channel:
        await channel.channel_ready()
        pick = router_pb2.PickRequest(model=MODEL, text=PROMPT, request_id="late")
        deadline[0] = time.monotonic() + 2.0 + 0.2
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await router_pb2_grpc.RouterStub(channel).Pick(pick, timeout=2.0)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await eventually(lambda: d.state.load.in_flight() == 0)
    assert d.queue().counter("") == charged


async def test_a_key_that_is_no_utf8_is_a_tenant_like_any_other(pair: Door) -> None:
    """An API key header with bytes that are no UTF-8 (no keys configured: admission still
    names the tenant by it) is served, not a 500: the tenant digest encodes what the gate
    decoded."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    host, port = pair.url.removeprefix("http://").split(":")
    for key in (b"Bearer k\xff\xfe", b"Bearer k\xc3\xa9", b"k\x80"):
        name = b"Authorization" if key.startswith(b"Bearer") else b"x-api-key"
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s:%s\r\n%s: %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s"
            % (host.encode(), port.encode(), name, key, len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200 "), head


async def test_a_pick_of_another_admitted_model_keeps_off_a_held_request_s_id() -> None:
    """A held HTTP request is in no load record yet; a Pick (a caller with no client key:
    its ids share the HTTP endpoints' space) of another model that admission judges too,
    sent meanwhile with the same id, must be routed under another id, as an HTTP request
    or a Pick of a model without admission is: else the two share one load record."""
    other_model = "kimi-other"
    held_on = await Backend("b0", [MODEL]).start()
    plain = await Backend("b1", [other_model]).start()
    protective = {
        "enabled": True,
        "stall_share": [1e-9, 0.5, 0.5],
        "max_stall": [float("inf"), 1e-9, 1e-9],
        "max_hold_s": 60.0,
    }
    settings = build_settings(
        {
            "server": {"grpc_port": 0},
            "replicas": [
                {"url": held_on.url, "model": MODEL, "name": "b0"},
                {"url": plain.url, "model": other_model, "name": "b1"},
            ],
            "models": {
                MODEL: kimi_model_table(slo={"ttft_s": 100.0}, admission=protective),
                other_model: kimi_model_table(slo={"ttft_s": 100.0}, admission={"enabled": True}),
            },
        }
    )
    runner, url = await start_router(settings)
    state: RouterState = runner.app[STATE]
    held_on.gate = asyncio.Event()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{runner.app[GRPC_PORT]}")
    try:
        async with aiohttp.ClientSession() as http:

            def post(rid: str, tier: str) -> Any:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "service_tier": tier}
                return http.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid})

            first = asyncio.create_task(post("p", "priority"))
            await eventually(lambda: len(held_on.received) == 1)
            held = asyncio.create_task(post("dup", "default"))
            await eventually(lambda: len(state.admission._models[MODEL].queue) == 1)
            stub = router_pb2_grpc.RouterStub(channel)
            pick = router_pb2.PickRequest(model=other_model, text=PROMPT, request_id="dup")
            reply = await stub.Pick(pick, timeout=30)
            assert reply.replica == "b1"
            held_on.gate.set()  # the held request goes, while the Pick's decision is open
            for task in (first, held):
                async with await task as r:
                    assert r.status == 200, await r.text()
            assert state.load.in_flight() == 1  # the Pick's request is still counted
            done = router_pb2.ReportRequest(
                decision_id=reply.decision_id, phase=router_pb2.ReportRequest.COMPLETED
            )
            assert (await stub.Report(done)).accepted
            assert state.load.in_flight() == 0
    finally:
        held_on.gate.set()
        await channel.close()
        await runner.cleanup()
        await held_on.stop()
        await plain.stop()


async def test_a_request_no_replica_took_is_not_charged_to_its_tenant(pair: Door) -> None:
    """A request admission dispatched charges its tenant for its uncached prompt; when every
    attempt's connection is refused (the replicas went away), no replica computed any of
    it: the charge is taken back, or the tenant is ordered behind others for work it never
    got (as a Pick whose caller never heard back is not charged)."""
    async with await pair.post() as r:  # (the model's admission state is made with one)
        assert r.status == 200
    charged = pair.queue().counter("")
    assert charged > 0
    for b in pair.backends:
        await b.stop()
    async with await pair.post(prompt="Another question entirely. " * 40) as r:
        assert r.status in (502, 503), await r.text()
    await eventually(lambda: pair.state.load.in_flight() == 0)
    assert pair.queue().counter("") == charged


async def test_a_retried_pick_is_charged_to_its_tenant_once(roomy_grpc: Door) -> None:
    """A gateway retries a failed request with a second Pick of the same ``request_id``
    (docs/grpc.md): one request, charged to its tenant once, as the HTTP forwarder's
    retries of a request are (the first Pick's charge stands)."""
    d = roomy_grpc
    async with await d.post() as r:  # (the model's admission state is made with one)
        assert r.status == 200
    before = d.queue().counter("")
    report = router_pb2.ReportRequest
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        prompt = "A question only this request asks. " * 40
        pick = router_pb2.PickRequest(model=MODEL, text=prompt, request_id="again")
        first = await stub.Pick(pick)
        once = d.queue().counter("")
        assert once > before
        failed = report(decision_id=first.decision_id, phase=report.FAILED)
        assert (await stub.Report(failed)).accepted
        second = await stub.Pick(pick)
        assert d.queue().counter("") == once
        done = report(decision_id=second.decision_id, phase=report.COMPLETED)
        assert (await stub.Report(done)).accepted
    # a new request of that id afterwards is charged as any other
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.running.app[GRPC_PORT]}") as channel:
        await router_pb2_grpc.RouterStub(channel).Pick(
            router_pb2.PickRequest(model=MODEL, text="Something else. " * 40)
        )
    assert d.queue().counter("") > once
