"""The forwarder's retries stay within their bounds with real HTTP on loopback: the retry
budget holds when many requests fail at once, and a retry is counted only when one is sent
(router/service/retry.py, router/service/proxy.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, metric_sample, start_router
from tests.ports import RefusedPort
from tests.waiting import eventually

MODEL = "kimi-test"


async def _router(
    replicas: list[dict[str, Any]], **server: Any
) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, **server},
            "replicas": replicas,
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        yield url, session
    finally:
        await session.close()
        await runner.cleanup()


def _chat(i: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": False,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": f"question number {i}"}],
    }


async def _post(session: aiohttp.ClientSession, url: str, i: int) -> int:
    async with session.post(url + "/v1/chat/completions", json=_chat(i)) as resp:
        await resp.read()
        return resp.status


async def test_the_retry_budget_holds_when_requests_fail_at_once() -> None:
    """Requests whose attempts are all out when their replicas fail may retry only as far
    as the budget allows: whether one more retry fits is judged when it would be sent, not
    when the failed attempt was (else every request in flight retries past the budget)."""
    gate = asyncio.Event()
    backends = [
        await Backend(name, [MODEL], fail_next=100, gate=gate).start() for name in ("a", "b")
    ]
    try:
        async for url, session in _router(
            [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            max_retries=1,
            retry_budget_ratio=0.0,
            retry_budget_min=1,  # one retry in the window, whatever the traffic
            outlier_detection=False,
        ):
            calls = [asyncio.create_task(_post(session, url, i)) for i in range(6)]
            await eventually(lambda: sum(len(b.received) for b in backends) == 6)
            gate.set()
            statuses = await asyncio.gather(*calls)
            assert statuses == [500] * 6  # the replicas' own answers
            # six first attempts and the one retry the budget has room for
            assert sum(len(b.received) for b in backends) == 7
            async with session.get(url + "/metrics") as r:
                page = await r.text()
            assert metric_sample(page, "kvrouter_retries_total", model=MODEL) == 1.0
    finally:
        for b in backends:
            await b.stop()


async def test_no_retry_is_counted_when_no_replica_is_left_to_try() -> None:
    """A refused connection rules out every DP rank of the replica (one URL): with no other
    replica the request fails after one attempt, and ``kvrouter_retries_total`` counts no
    retry (none was sent)."""
    with RefusedPort() as dead:
        async for url, session in _router(
            [{"url": dead.url, "model": MODEL, "name": "dead", "dp_ranks": 2}]
        ):
            async with session.post(url + "/v1/chat/completions", json=_chat(0)) as resp:
                assert resp.status == 502
                text = await resp.text()
            assert "gave up after 1 attempt(s)" in text, text
            async with session.get(url + "/metrics") as r:
                page = await r.text()
            assert metric_sample(page, "kvrouter_retries_total", model=MODEL) is None, [
                line for line in page.splitlines() if "retries" in line
            ]


async def test_a_retry_skips_a_replica_drained_since_the_decision() -> None:
    """A drained replica takes no new requests: a retry is a new request to it, so a
    replica drained while the first attempt was out is no retry target (the first
    replica's own error answer goes to the client)."""
    gate = asyncio.Event()
    backends = [await Backend(name, [MODEL], fail_next=1, gate=gate).start() for name in ("a", "b")]
    try:
        async for url, session in _router(
            [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            admin_token="t",
            max_retries=1,
        ):
            call = asyncio.create_task(_post(session, url, 0))
            await eventually(lambda: sum(len(b.received) for b in backends) == 1)
            other = next(b for b in backends if not b.received)
            other.fail_next = 0
            async with session.post(
                f"{url}/admin/replicas/{other.name}/drain", headers={"X-Admin-Token": "t"}
            ) as r:
                assert r.status == 200, await r.text()
            gate.set()
            assert await call == 500  # the first replica's answer, not a retry's
            assert other.received == []
    finally:
        for b in backends:
            await b.stop()


async def test_retries_end_with_the_request_timeout() -> None:
    """``request_timeout_s`` bounds the request, its retries included: each attempt waits at
    most what is left of it, and no attempt starts once it is spent. Three hung replicas,
    first-byte deadlines of 1 s and a request timeout of 1.5 s: the first attempt times out,
    the second gets the half second left, and no third is sent (before: three attempts of
    1 s each, twice the request's timeout)."""
    backends = [await Backend(name, [MODEL], hang=True).start() for name in ("a", "b", "c")]
    try:
        async for url, session in _router(
            [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            max_retries=2,
            first_byte_min_s=1.0,
            first_byte_timeout_s=1.0,
            request_timeout_s=1.5,
            outlier_detection=False,  # (a latency ejection would end the attempts early)
        ):
            async with session.post(url + "/v1/chat/completions", json=_chat(0)) as resp:
                text = await resp.text()
                assert resp.status == 504, text
            assert "gave up after 2 attempt(s)" in text, text
            assert sum(len(b.received) for b in backends) == 2
            # both attempts were aborted on their replicas
            await eventually(lambda: sum(b.cancelled for b in backends) == 2)
    finally:
        for b in backends:
            await b.stop()


async def test_a_stream_past_the_request_timeout_is_no_failure_of_its_replica() -> None:
    """A stream still running when ``request_timeout_s`` is up is cut (the client gets the
    SSE error event), but that is the request's deadline, not the replica failing: it does
    not count toward ejecting the replica (before: a ``broken`` failure, so three long
    answers ejected a healthy replica)."""
    backend = await Backend("a", [MODEL], chunk_delay_s=30.0).start()
    try:
        async for url, session in _router(
            [{"url": backend.url, "model": MODEL, "name": "a"}], request_timeout_s=1.0
        ):
            body = {**_chat(0), "stream": True}
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                text = ""
                try:
                    async for piece in resp.content.iter_any():
                        text += piece.decode()
                except aiohttp.ClientPayloadError:
                    pass  # the router aborts a stream it cut
            assert '"error"' in text and "[DONE]" not in text, text
            await eventually(lambda: backend.cancelled == 1)
            async with session.get(url + "/metrics") as r:
                page = await r.text()
            failures = [x for x in page.splitlines() if x.startswith("kvrouter_replica_failures")]
            assert not [x for x in failures if not x.startswith("#")], failures
    finally:
        await backend.stop()


async def test_a_retry_goes_to_a_replica_readmitted_since_the_decision() -> None:
    """A replica of the decision's ranking taken out of rotation while the first attempt
    was out (a failed probe, a connection it dropped), whose time out has ended by the
    time the attempt fails, is a retry target again: the retry readmits replicas first,
    as routing does. Before, it read the stale health until the housekeeping's next tick
    and the client got the first replica's 500."""
    from router.core.types import ReplicaKey
    from router.service.app import STATE
    from tests.backends import without_housekeeping_readmission

    gate = asyncio.Event()
    backends = [await Backend(name, [MODEL], fail_next=1, gate=gate).start() for name in ("a", "b")]
    settings = build_settings(
        {
            "server": {"health_interval_s": 0, "max_retries": 1},
            "replicas": [{"url": b.url, "model": MODEL, "name": b.name} for b in backends],
            "models": {MODEL: kimi_model_table()},
        }
    )
    runner, url = await start_router(settings)
    state = runner.app[STATE]
    without_housekeeping_readmission(state)
    cooldown = state.settings.server.unhealthy_cooldown_s
    loop = asyncio.get_running_loop()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            call = asyncio.create_task(_post(session, url, 0))
            await eventually(lambda: sum(len(b.received) for b in backends) == 1)
            other = next(b for b in backends if not b.received)
            other.fail_next = 0
            # out of rotation until now: due back when the first attempt fails
            state.fleet.mark_unhealthy(ReplicaKey(other.name), loop.time() - cooldown)
            gate.set()
            assert await call == 200
            assert len(other.received) == 1
    finally:
        await runner.cleanup()
        for b in backends:
            await b.stop()


async def test_a_retry_carries_the_requests_id() -> None:
    """Every attempt of a request goes with the client's ``X-Request-Id``: vLLM 0.34 makes
    the engine's id unique itself (``InputProcessor.assign_request_id`` appends 8 random
    characters) and aborts a dropped attempt by that id, so the first attempt still running
    on another rank of the same server neither refuses nor cancels the retry
    (docs/service.md)."""
    backends = [await Backend(name, [MODEL], fail_next=1).start() for name in ("a", "b")]
    try:
        async for url, session in _router(
            [{"url": b.url, "model": MODEL, "name": b.name} for b in backends], max_retries=1
        ):
            headers = {"X-Request-Id": "client-7"}
            async with session.post(
                url + "/v1/chat/completions", json=_chat(0), headers=headers
            ) as resp:
                assert resp.status == 500  # both failed once: the retry's answer
            ids = [r["headers"]["x-request-id"] for b in backends for r in b.received]
            assert ids == ["client-7", "client-7"]
    finally:
        for b in backends:
            await b.stop()
