"""A Responses stream's ``response.created`` event arriving in two reads still records the
response's replica (router/service/answer_relay.py reads the stream's start until it finds the id):
a stored response's ``GET /v1/responses/{id}`` then reaches it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from router.service.config import build_settings
from tests.backends import metric_sample, start_router
from tests.ports import free_port
from tests.waiting import eventually

MODEL = "m"
CREATED = (
    b'event: response.created\ndata: {"response":{"id":"resp_split_0001","object":"response",'
    b'"status":"in_progress"},"sequence_number":0,"type":"response.created"}\n\n'
)
DONE = (
    b'event: response.completed\ndata: {"response":{"id":"resp_split_0001","object":"response",'
    b'"status":"completed","usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":0},'
    b'"output_tokens":1,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":6}},'
    b'"sequence_number":1,"type":"response.completed"}\n\n'
)


async def _replica() -> tuple[web.AppRunner, str]:
    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cut = CREATED.index(b"split") + 2  # the id itself cut in two
        await resp.write(CREATED[:cut])
        await asyncio.sleep(0.05)  # the replica's own pace: the router reads each apart
        await resp.write(CREATED[cut:])
        await asyncio.sleep(0.05)
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def stored(request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["rid"], "object": "response"})

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{rid}", stored)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_response_id_split_across_reads_is_recorded() -> None:
    replica, base = await _replica()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": base, "model": MODEL, "name": "r0"}],
            "models": {MODEL: {}},
        }
    )
    router, url = await start_router(settings)
    body: dict[str, Any] = {"model": MODEL, "input": "hi", "stream": True}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200
                text = await r.read()
            assert text == CREATED + DONE
            async with http.get(url + "/v1/responses/resp_split_0001") as r:
                assert r.status == 200, await r.read()
                assert (await r.json())["id"] == "resp_split_0001"
    finally:
        await router.cleanup()
        await replica.cleanup()


async def test_a_final_event_split_across_reads_still_gives_its_usage() -> None:
    """The ``event: response.completed`` line cut by a read, and the final event (the whole
    response) spread over reads past the 8 KiB of stream end the relay keeps otherwise: its
    usage must still be read (the engine's cached tokens reach the metrics)."""
    big = (
        b'"output":[{"type":"message","content":[{"type":"output_text","text":"'
        + (b"x" * 20_000)
        + b'"}]}],'
    )
    done = DONE.replace(b'"status":"completed",', b'"status":"completed",' + big).replace(
        b'"cached_tokens":0', b'"cached_tokens":7'
    )
    cut = len(b"event: response.comp")

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(CREATED)
        # the replica's own pace: the router reads each piece apart, the event's data too
        half = len(done) // 2
        for piece in (done[:cut], done[cut:half], done[half:]):
            await resp.write(piece)
            await asyncio.sleep(0.05)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    replica = web.AppRunner(app)
    await replica.setup()
    port = free_port()
    await web.TCPSite(replica, "127.0.0.1", port).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": "r0"}],
            "models": {MODEL: {}},
        }
    )
    router, url = await start_router(settings)
    body: dict[str, Any] = {"model": MODEL, "input": "hi", "stream": True}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200
                assert await r.read() == CREATED + done

            async def cached() -> bool:  # booked as the relay ends, after the last byte went
                async with http.get(url + "/metrics") as r:
                    page = await r.text()
                return metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 7

            await eventually(cached)
    finally:
        await router.cleanup()
        await replica.cleanup()
