"""``kvrouter_requests_total``: every request a client sent ends in exactly one outcome, also
when the client leaves while the router holds it before its replica answers (a
disaggregated request's prefill leg, a request held by SLO-aware admission). Real HTTP on
loopback, scraped as Prometheus does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.core.types import ReplicaKey
from router.service.app import STATE
from tests.backends import Backend, start_router
from tests.test_pd_service import _Prefill, _prompt, _stub_settings
from tests.test_service_admission import MODEL as ADMITTED
from tests.test_service_admission import Door, _door
from tests.waiting import eventually

MODEL = "m"


async def _outcomes(url: str, model: str = MODEL) -> dict[tuple[str, str], float]:
    """(replica, outcome) -> count of ``model``'s ``kvrouter_requests_total``."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        page = await r.text()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == "kvrouter_requests_total" and s.labels["model"] == model:
                out[s.labels["replica"], s.labels["outcome"]] = float(s.value)
    return out


async def _leave(url: str, body: dict[str, Any], arrived: Any) -> None:
    """Send ``body`` and go away (the connection closed) once ``arrived()`` is true."""
    async with aiohttp.ClientSession() as http:
        task = asyncio.ensure_future(http.post(url + "/v1/completions", json=body))
        try:
            await eventually(arrived)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_leaving_during_the_prefill_leg_counts_cancelled(stream: bool) -> None:
    """A disaggregated request whose client leaves while its prefill leg runs is a request
    the router took and did not answer: ``cancelled``, once, on the replica it was at."""
    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()  # the prefill leg never answers
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        body = {"model": MODEL, "prompt": _prompt(3), "max_tokens": 3, "stream": stream}
        await _leave(url, body, lambda: prefill.seen)
        await eventually(lambda: not state.load.replica_of(prefill.seen[0][1] + "#p"))
        await eventually(lambda: _outcomes(url), message="no outcome counted")
        assert await _outcomes(url) == {(str(ReplicaKey("p0")), "cancelled"): 1.0}
        assert not decode.received
    finally:
        prefill.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


@pytest.fixture
async def door() -> AsyncIterator[Door]:
    """SLO-aware admission that holds a default request while a priority one runs."""
    knobs = {"stall_share": [1e-9, 0.5, 0.5], "max_stall": [float("inf"), 1e-9, 1e-9],
             "max_hold_s": 60.0}  # fmt: skip
    async for d in _door(knobs, {"ttft_s": 100.0}):
        yield d


async def test_a_client_leaving_while_admission_holds_it_counts_cancelled(door: Door) -> None:
    """A request held by SLO-aware admission whose client leaves was never sent: it still
    ends in one outcome, ``cancelled`` with no replica, like a refusal's ``rejected``."""
    d = door
    await d.leave_while_held()

    async def answered() -> bool:
        return ("b0", "ok") in await _outcomes(d.url, ADMITTED)

    await eventually(answered)
    assert await _outcomes(d.url, ADMITTED) == {("b0", "ok"): 1.0, ("", "cancelled"): 1.0}
    assert len(d.backend.received) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_replica_reporting_negative_counts_is_still_counted(stream: bool) -> None:
    """A replica whose usage holds negative counts (``cached_tokens: -3``: a buggy engine or
    proxy) gave an answer all the same: it counts ``ok`` once, and the counts that are no
    counts are not taken (a counter cannot go back; incrementing one by -3 raised in the
    relay, after the client had its answer, and the request was never counted)."""
    from aiohttp import web

    from router.service.config import build_settings
    from tests.backends import metric_sample
    from tests.scripted_replica import DONE, event, scripted_replica, token

    bad = {"prompt_tokens": -5, "completion_tokens": -1,
           "prompt_tokens_details": {"cached_tokens": -3}}  # fmt: skip

    async def answer(resp: web.StreamResponse) -> None:
        if not stream:
            choice = {"index": 0, "text": "x", "finish_reason": "stop"}
            await resp.write(json.dumps({"id": "c", "choices": [choice], "usage": bad}).encode())
            return
        await resp.write(token("x", "stop") + event({"id": "c", "choices": [], "usage": bad}))
        await resp.write(DONE)

    content_type = "text/event-stream" if stream else "application/json"
    async with scripted_replica(answer, content_type=content_type) as replica:
        settings = build_settings({"replicas": [{"url": replica, "model": MODEL, "name": "a"}]})
        router, url = await start_router(settings)
        try:
            body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1, "stream": stream}
            async with aiohttp.ClientSession() as http:
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                async with http.get(url + "/metrics") as r:
                    page = await r.text()
            assert await _outcomes(url) == {("a", "ok"): 1.0}
            met = metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result="met")
            assert met == 1
            for name in ("kvrouter_engine_cached_tokens_total",
                         "kvrouter_engine_prompt_tokens_drift_count"):  # fmt: skip
                assert metric_sample(page, name, model=MODEL) in (None, 0), name
        finally:
            await router.cleanup()
