"""vLLM routes the router passes to a replica of the model without routing them
(router/service/pass_through.py): ``/tokenize`` and ``/detokenize`` answer as the replica's
own, a pooling route reaches the replica as sent (its answer relayed whatever it is), and
the body is checked as a hot endpoint's first (real HTTP, mock replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from router.mock.server import MockSettings
from router.service.config import build_settings
from tests.backends import start_mock, start_router
from tests.waiting import eventually

MODEL = "m"


async def test_tokenize_and_pooling_routes_reach_a_replica() -> None:
    runners: list[Any] = []
    try:
        mock, base = await start_mock(MockSettings(model=MODEL, replica="r0"))
        runners.append(mock)
        settings = build_settings(
            {"replicas": [{"url": base, "model": MODEL, "name": "r0"}], "models": {MODEL: {}}}
        )
        router, url = await start_router(settings)
        runners.append(router)
        body = {"model": MODEL, "prompt": "the same words, twice over"}
        async with aiohttp.ClientSession() as http:
            async with http.post(base + "/tokenize", json=body) as r:
                direct = await r.json()
            async with http.post(url + "/tokenize", json=body) as r:
                assert r.status == 200
                assert await r.json() == direct
            async with http.post(url + "/tokenize", json={"prompt": "no model named"}) as r:
                assert r.status == 200  # the one model routed
            ids = {"model": MODEL, "tokens": direct["tokens"]}
            async with http.post(url + "/detokenize", json=ids) as r:
                assert r.status == 200
                assert (await r.json())["prompt"] == "the same words, twice over"
            # a pooling route the mock does not serve: its own 404, relayed
            async with http.post(url + "/v1/embeddings", json={"model": MODEL, "input": "x"}) as r:
                assert r.status == 404
            # the router's own checks first, in OpenAI's shape
            async with http.post(url + "/tokenize", json={"model": "nope", "prompt": "x"}) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"
            async with http.post(url + "/tokenize", data=b"{not json") as r:
                assert r.status == 400 and "error" in await r.json()
            async with http.get(url + "/tokenize") as r:
                assert r.status == 405
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


async def test_pooling_work_goes_to_the_replica_with_the_least_in_flight() -> None:
    """A replica busy with a long embedding batch is passed by: the next requests go to the
    idle one, not in turn. (The mock replica is a generative engine and serves no pooling
    routes: the two replicas here are stand-ins answering ``/v1/embeddings``.)"""
    release = asyncio.Event()
    served: dict[str, int] = {"a": 0, "b": 0}
    held: list[str] = []

    def replica(name: str) -> web.Application:
        async def embeddings(request: web.Request) -> web.Response:
            body = await request.json()
            served[name] += 1
            if body["input"] == "long batch":
                held.append(name)
                await release.wait()
            return web.json_response({"object": "list", "data": [], "model": MODEL})

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post("/v1/embeddings", embeddings)
        app.router.add_get("/health", health)
        return app

    runners: list[Any] = []
    try:
        replicas = []
        for name in ("a", "b"):
            runner = web.AppRunner(replica(name))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            base = f"http://127.0.0.1:{runner.addresses[0][1]}"
            replicas.append({"url": base, "model": MODEL, "name": name})
        router, url = await start_router(build_settings({"replicas": replicas}))
        runners.append(router)
        async with aiohttp.ClientSession() as http:
            long = asyncio.create_task(
                http.post(url + "/v1/embeddings", json={"model": MODEL, "input": "long batch"})
            )
            await eventually(lambda: len(held) == 1)
            busy = held[0]
            idle = "b" if busy == "a" else "a"
            for _ in range(4):
                body = {"model": MODEL, "input": "short"}
                async with http.post(url + "/v1/embeddings", json=body) as r:
                    assert r.status == 200
            assert served[idle] == 4 and served[busy] == 1  # in turn: 2 and 3
            release.set()
            async with await long as r:
                assert r.status == 200
            for _ in range(4):  # both idle again: in turn
                async with http.post(url + "/v1/embeddings", json=body) as r:
                    assert r.status == 200
            assert served[busy] == 3 and served[idle] == 6
    finally:
        release.set()
        for runner in reversed(runners):
            await runner.cleanup()
