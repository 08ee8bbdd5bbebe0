"""A disaggregated request's time upstream: ``server.request_timeout_s`` bounds both legs
together, from the prefill leg's dispatch (router/service/pd_serve.py ``serve``), as it
bounds a request's attempts, retries included. Over real HTTP against the stub prefill
server of tests/test_pd_service.py."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from router.service.app import FORWARDER, STATE
from tests.backends import Backend, metric_sample, start_router
from tests.test_pd_service import MODEL, _post, _Prefill, _prompt, _stub_settings
from tests.waiting import eventually


async def test_a_prefill_leg_outliving_the_request_time_ends_it_with_504() -> None:
    """The prefill replica holds its leg past ``request_timeout_s``: the request's time is
    spent, so it ends there with a 504 (not a local prefill on the decode replica with a
    new ``request_timeout_s`` of its own), no failure of the prefill replica's (its
    first-byte deadline had not come), no fallback."""
    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()  # held until the test ends
    decode = await Backend("d0", [MODEL]).start()
    # the first-byte deadline (10 s at least) is far past the request's time
    settings = _stub_settings(prefill.url, [(decode.url, "decode")], request_timeout_s=0.3)
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(31)})
        assert status == 504, raw
        assert len(prefill.seen) == 1 and not decode.received
        md = next(iter(state.disagg.values()))
        assert md.fallbacks == {}
        await eventually(lambda: state.load.in_flight() == 0)
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        assert not metric_sample(page, "kvrouter_replica_failures_total", replica="p0")
        assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="timeout")
        assert not metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok")
    finally:
        prefill.gate.set()
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_the_decode_leg_gets_what_is_left_of_the_request_time() -> None:
    """The decode leg's attempts end by the request's deadline, counted from the prefill
    leg's dispatch: what the forwarder is given is no later than the prefill leg's arrival
    at its replica plus ``request_timeout_s`` (before, the decode leg started a count of
    its own when it was sent)."""
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    settings = _stub_settings(prefill.url, [(decode.url, "decode")], request_timeout_s=600.0)
    router, url = await start_router(settings)
    loop = asyncio.get_running_loop()
    arrived: list[float] = []
    prefill.hook = lambda: arrived.append(loop.time())
    forwarder = router.app[FORWARDER]
    forward = forwarder.forward
    given: list[dict[str, Any]] = []

    async def recording(*args: Any, **kwargs: Any) -> None:
        given.append({"called": loop.time(), **kwargs})
        await forward(*args, **kwargs)

    forwarder.forward = recording  # type: ignore[method-assign]
    try:
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(32)})
        assert status == 200, raw
        (leg,) = given
        assert leg["called"] >= arrived[0]
        ends_by = leg.get("ends_by")
        assert ends_by is not None and ends_by <= arrived[0] + 600.0
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()
