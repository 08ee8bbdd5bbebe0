"""vLLM routes the router passes to a replica of the model without routing them
(router/service/pass_through.py): ``/tokenize`` and ``/detokenize`` answer as the replica's
own, a pooling route reaches the replica as sent (its answer relayed whatever it is), and
the body is checked as a hot endpoint's first (real HTTP, mock replicas)."""

from __future__ import annotations

from typing import Any

import aiohttp

from router.mock.server import MockSettings
from router.service.config import build_settings
from tests.backends import start_mock, start_router

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
