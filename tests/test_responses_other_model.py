"""A follow-up naming another model of the engine that holds its previous response.

vLLM 0.34 keeps a stored response in the API server process that made it, keyed by its id
alone (entrypoints/openai/responses/serving.py ``self.response_store.get(prev_response_id)``,
after ``_check_model``): a follow-up naming a LoRA adapter that server has loaded (or any
other name it serves) continues a response made with its base model. The router has such a
name as replica entries of their own on the engines' URLs (docs/configuration.md, "LoRA
adapters"): the follow-up must reach the entry on the holder's URL, not any replica of the
adapter, where the engine could only answer 404. Real HTTP, the official openai client,
replicas that keep a store per process as vLLM does."""

from __future__ import annotations

import json
import uuid
from typing import Any

import openai
from aiohttp import web

from router.service.app import STATE
from router.service.config import build_settings
from router.service.errors import response_not_found_body
from tests.backends import start_router

BASE = "base"
ADAPTER = "sql-lora"
USAGE = {
    "input_tokens": 5,
    "input_tokens_details": {"cached_tokens": 0},
    "output_tokens": 1,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 6,
}


async def _engine(name: str) -> tuple[web.AppRunner, str]:
    """An API server serving ``BASE`` and its adapter ``ADAPTER`` with one response store
    (vLLM's order: the model checked, then the previous response looked up)."""
    store: dict[str, str] = {}

    async def responses(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if body.get("model") not in (BASE, ADAPTER):
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in store:
            return web.Response(
                body=response_not_found_body(previous), status=404, content_type="application/json"
            )
        rid = f"resp_{uuid.uuid4().hex}"
        store[rid] = body["model"]
        answer = {"id": rid, "object": "response", "model": body["model"], "status": "completed",
                  "output": [], "metadata": {"engine": name}, "usage": USAGE}  # fmt: skip
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_follow_up_naming_an_adapter_of_the_holders_engine_reaches_that_engine() -> None:
    runners: list[Any] = []
    try:
        urls = []
        for i in range(2):
            runner, url = await _engine(f"e{i}")
            runners.append(runner)
            urls.append(url)
        replicas = [
            {"url": url, "model": model, "name": f"e{i}-{model}"}
            for i, url in enumerate(urls)
            for model in (BASE, ADAPTER)
        ]
        table = {"block_size": 16, "policy": "round_robin"}
        settings = build_settings(
            {
                "replicas": replicas,
                "models": {BASE: table, ADAPTER: {**table, "lora_base": BASE}},
            }
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = await client.responses.create(model=BASE, input="hi")
        engine = (first.metadata or {})["engine"]
        # round robin over the adapter's two entries would reach the other engine once
        for i in range(2):
            turn = await client.responses.create(
                model=ADAPTER, input=f"and then {i}", previous_response_id=first.id
            )
            assert (turn.metadata or {})["engine"] == engine
            assert state.recent_decisions(1)[0]["replica"] == f"{engine}-{ADAPTER}"
        await client.close()
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
