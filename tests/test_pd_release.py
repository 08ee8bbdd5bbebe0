"""A prefill leg whose request then finds no decode replica: the prefill replica's blocks
are released through a decode-capable replica at once, instead of staying pinned until
vLLM's KV lease (``kv_lease_duration``) expires (router/service/disagg.py ``release``)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from router.core.types import ReplicaKey
from router.mock.server import MockSettings
from router.mock.state import STATE as MOCK
from router.service.app import FORWARDER, STATE
from router.service.config import build_settings
from tests.backends import Backend, metric_sample, start_mock, start_router
from tests.ports import free_port
from tests.waiting import eventually

MODEL = "m"
B = 16
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
          "remote_request_id": "cmpl-r1-0", "remote_block_ids": [[1, 2]],
          "remote_host": "10.0.0.9", "remote_port": 5600, "tp_size": 1}  # fmt: skip


class _Prefill:
    """A prefill stub answering ``PARAMS``; ``hook`` runs before it answers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.hook: Any = None
        self.runner: Any = None
        self.url = ""

    async def _answer(self, request: web.Request) -> web.Response:
        self.seen.append(await request.json())
        if self.hook is not None:
            self.hook()
        return web.json_response(
            {"object": "text_completion", "choices": [], "kv_transfer_params": PARAMS}
        )

    async def start(self) -> _Prefill:
        app = web.Application()
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self


def _replica(name: str, url: str, role: str) -> dict[str, Any]:
    return {"url": url, "model": MODEL, "name": name, "role": role, "rack": "r0", "region": "g0"}


def _settings(replicas: list[tuple[str, str, str]]) -> Any:
    return build_settings(
        {
            "server": {"max_retries": 2, "health_interval_s": 0},
            "replicas": [_replica(name, url, role) for name, url, role in replicas],
            "models": {MODEL: {"block_size": B, "pd": {"mode": "always"}}},
        }
    )


def _out_of_rotation(state: Any, *names: str) -> None:
    for name in names:
        state.fleet.mark_unhealthy(ReplicaKey(name), 0.0)


async def _chat(url: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 300}],
            "stream": True, "max_tokens": 9}  # fmt: skip
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body) as r,
    ):
        await r.read()
        return r.status


async def test_a_transfer_no_decode_replica_takes_is_released_through_one() -> None:
    """Every decode replica left rotation while the prefill ran: the client gets its 503,
    and a mock decode replica (vLLM 0.34's serving layer) gets the prefill's transfer params
    in a request it refuses before its engine, which frees the prefill replica's blocks at
    once (``_with_kv_transfer_rejection_cleanup``); it decodes nothing. A ``both`` prefill
    replica is no release target (it would pull from its own engine)."""
    prefill = await _Prefill().start()
    runner, d0 = await start_mock(MockSettings(model=MODEL, replica="d0", block_size=B))
    router, url = await start_router(_settings([("p0", prefill.url, "both"), ("d0", d0, "decode")]))
    state = router.app[STATE]
    prefill.hook = lambda: _out_of_rotation(state, "p0", "d0")
    state.fleet.restore_health = lambda now: None  # stays out while the request is served
    counters = runner.app[MOCK].counters
    try:
        assert await _chat(url) == 503
        await eventually(lambda: counters.released_transfers == 1)
        assert counters.decode_legs == 0 and counters.requests == 0
        assert len(prefill.seen) == 1  # the prefill leg only: p0 got no release
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        got = metric_sample(page, "kvrouter_pd_transfer_releases_total", outcome="released")
        assert got == 1.0
    finally:
        await router.cleanup()
        await runner.cleanup()
        await prefill.runner.cleanup()


async def test_the_release_is_the_prefill_answers_params_and_skips_dead_replicas() -> None:
    """What the release target receives: a streamed beam-search completion (vLLM's first
    refusal, before its model check) carrying the prefill answer's ``kv_transfer_params``
    as answered; a decode replica refusing the connection is skipped for the next one."""
    prefill = await _Prefill().start()
    dead = f"http://127.0.0.1:{free_port()}"
    live = await Backend("d1", [MODEL]).start()
    fleet = [("p0", prefill.url, "prefill"), ("d0", dead, "decode"), ("d1", live.url, "decode")]
    router, url = await start_router(_settings(fleet))
    state = router.app[STATE]
    prefill.hook = lambda: _out_of_rotation(state, "d0", "d1")
    state.fleet.restore_health = lambda now: None
    try:
        assert await _chat(url) == 503
        await eventually(lambda: len(live.received) == 1)
        (got,) = live.received
        assert got["path"] == "/v1/completions"
        body = got["body"]
        assert body["kv_transfer_params"] == PARAMS
        assert body["stream"] is True and body["use_beam_search"] is True
        assert body["model"] == MODEL and body["max_tokens"] == 1
    finally:
        await router.cleanup()
        await live.stop()
        await prefill.runner.cleanup()


async def _released(url: str) -> float | None:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        page = await r.text()
    return metric_sample(page, "kvrouter_pd_transfer_releases_total", outcome="released")


async def test_a_client_leaving_before_the_decode_leg_is_written_releases_the_transfer() -> None:
    """The prefill leg answered; the client leaves while the router is still connecting to
    the decode replica: no decode replica ever gets the transfer params, so none would
    pull or release the prefill replica's blocks (they would wait for vLLM's KV lease).
    The router hands them back through a decode-capable replica, which refuses the
    release as vLLM 0.34 does and decodes nothing."""
    prefill = await _Prefill().start()
    runner, d0 = await start_mock(MockSettings(model=MODEL, replica="d0", block_size=B))
    router, url = await start_router(
        _settings([("p0", prefill.url, "prefill"), ("d0", d0, "decode")])
    )
    pool = router.app[FORWARDER].client.pool(d0)
    connect = pool._connect
    holding, gate = asyncio.Event(), asyncio.Event()

    async def held_connect() -> Any:  # the decode leg's connection waits for the gate
        if not holding.is_set():
            holding.set()
            await gate.wait()
        return await connect()

    pool._connect = held_connect  # type: ignore[method-assign]
    counters = runner.app[MOCK].counters
    try:
        leaving = asyncio.create_task(_chat(url))
        await eventually(holding.is_set)
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await eventually(lambda: counters.released_transfers == 1)
        assert counters.decode_legs == 0 and counters.requests == 0
        await eventually(lambda: _released(url), message="no release counted")
        assert await _released(url) == 1.0
    finally:
        gate.set()
        await router.cleanup()
        await runner.cleanup()
        await prefill.runner.cleanup()


async def test_a_client_leaving_after_the_decode_leg_was_written_sends_no_release() -> None:
    """The decode replica has the transfer params when the client leaves: vLLM's decode
    side hands the blocks back itself (an abort before its pull: the connector's
    ``request_finished`` with ``do_remote_prefill`` still set; during it: once the pull
    ends), and a release through another replica could free blocks it is reading. The
    router sends none."""
    prefill = await _Prefill().start()
    d0 = await Backend("d0", [MODEL], hang=True).start()
    d1 = await Backend("d1", [MODEL]).start()
    fleet = [("p0", prefill.url, "prefill"), ("d0", d0.url, "decode"), ("d1", d1.url, "decode")]
    router, url = await start_router(_settings(fleet))
    state = router.app[STATE]
    prefill.hook = lambda: _out_of_rotation(state, "d1")  # the decode leg goes to d0
    state.fleet.restore_health = lambda now: None
    md = next(iter(state.disagg.values()))
    try:
        leaving = asyncio.create_task(_chat(url))
        await eventually(lambda: d0.received)
        assert d0.received[0]["body"]["kv_transfer_params"] == PARAMS
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        await eventually(lambda: d0.cancelled == 1)
        await eventually(lambda: state.load.in_flight() == 0)
        assert not md.releasing and md.releases == {}
        assert len(d0.received) == 1 and not d1.received
    finally:
        await router.cleanup()
        await d0.stop()
        await d1.stop()
        await prefill.runner.cleanup()


async def test_a_decode_leg_every_decode_replica_refused_is_released() -> None:
    """The only decode replica in rotation refuses the decode leg's connection (the
    forwarder's 502): the transfer params reached no decode replica, so the router releases
    them through one out of rotation that answers."""
    prefill = await _Prefill().start()
    dead = f"http://127.0.0.1:{free_port()}"
    runner, d1 = await start_mock(MockSettings(model=MODEL, replica="d1", block_size=B))
    fleet = [("p0", prefill.url, "prefill"), ("d0", dead, "decode"), ("d1", d1, "decode")]
    router, url = await start_router(_settings(fleet))
    state = router.app[STATE]
    prefill.hook = lambda: _out_of_rotation(state, "d1")
    state.fleet.restore_health = lambda now: None
    counters = runner.app[MOCK].counters
    try:
        assert await _chat(url) == 502
        await eventually(lambda: counters.released_transfers == 1)
        assert counters.decode_legs == 0
        await eventually(lambda: _released(url), message="no release counted")
    finally:
        await router.cleanup()
        await runner.cleanup()
        await prefill.runner.cleanup()


async def test_a_release_still_running_when_the_router_stops_is_awaited() -> None:
    """The router stopping while a release is out (its target slow to refuse) waits for it:
    the prefill replica's blocks are handed back and no task is destroyed pending (before,
    the task was dropped with the event loop)."""
    from router.service.pd_serve import releases

    prefill = await _Prefill().start()
    router, _ = await start_router(_settings([("p0", prefill.url, "prefill")]))
    assert releases in list(router.app.cleanup_ctx)  # a P/D router stops through it
    md = next(iter(router.app[STATE].disagg.values()))
    go = asyncio.Event()

    async def release() -> None:
        await go.wait()
        md.count(md.releases, "released")

    task = asyncio.get_running_loop().create_task(release())
    md.releasing.add(task)
    task.add_done_callback(md.releasing.discard)
    try:
        ctx = releases(router.app)
        await anext(ctx)
        stopping = asyncio.get_running_loop().create_task(anext(ctx, None))
        for _ in range(5):  # (turns of the loop, no time: the stop waits on the task)
            await asyncio.sleep(0)
        assert not stopping.done()
        go.set()
        await stopping
        assert md.releases == {"released": 1} and not md.releasing
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
