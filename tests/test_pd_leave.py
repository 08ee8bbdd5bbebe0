"""A disaggregated request that ends before its decode leg answers: the client leaves during
the prefill leg (no decode replica left after it: tests/test_pd_service.py). Over real HTTP
against the stub prefill server and mock backends of tests/test_pd_service.py
(router/service/disagg.py ``serve``)."""

from __future__ import annotations

import asyncio

import aiohttp

from router.core.types import ReplicaKey
from router.service.app import STATE
from tests.backends import Backend, metric_sample, start_router
from tests.test_pd_service import MODEL, _post, _Prefill, _prompt, _stub_settings
from tests.waiting import eventually


async def _page(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        return await r.text()


async def test_a_client_leaving_during_the_prefill_leg_leaves_no_load_and_one_cancel() -> None:
    """The client goes while the prefill replica holds its leg: the leg's load record goes at
    once (not when the replica answers), the request counts one ``cancelled`` on the prefill
    replica and nothing else, no decode leg is sent, and the next request is served."""
    prefill = await _Prefill().start()
    prefill.gate = asyncio.Event()  # the first leg is held until the client left
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    state = router.app[STATE]
    try:
        leaving = asyncio.create_task(_post(url, {"model": MODEL, "prompt": _prompt(21)}))
        await eventually(lambda: prefill.seen)
        leg = prefill.seen[0][1] + "#p"
        assert state.load.replica_of(leg) == ReplicaKey("p0")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await eventually(lambda: state.load.in_flight() == 0, message="a load record stayed")
        assert state.load.replica_of(leg) is None

        async def cancelled() -> float | None:
            page = await _page(url)
            return metric_sample(
                page, "kvrouter_requests_total", model=MODEL, outcome="cancelled", replica="p0"
            )

        await eventually(cancelled)
        assert await cancelled() == 1.0
        page = await _page(url)
        for outcome in ("ok", "rejected", "upstream_broken", "timeout"):
            assert not metric_sample(
                page, "kvrouter_requests_total", model=MODEL, outcome=outcome
            ), outcome
        assert not decode.received  # no decode leg for a client that is gone

        prefill.gate.set()  # the held leg answers into a closed connection
        status, raw, _ = await _post(url, {"model": MODEL, "prompt": _prompt(22)})
        assert status == 200, raw
        assert len(prefill.seen) == 2 and len(decode.received) == 1
        await eventually(lambda: state.load.in_flight() == 0)
        page = await _page(url)
        assert (
            metric_sample(
                page, "kvrouter_requests_total", model=MODEL, outcome="cancelled", replica="p0"
            )
            == 1.0
        )
    finally:
        prefill.gate.set()  # (a failure above left the leg held: its server would wait)
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()
