"""A client's ``kv_transfer_params.prompt_token_ids`` on a chat, over real HTTP.

vLLM 0.34 runs those ids as the chat's prompt instead of rendering its messages
(``OnlineRenderer.preprocess_chat`` / ``_reused_prompt_token_ids``: the decode side of a
disaggregating proxy reusing the prefill's tokens; any client may send them), unless the
chat asks ``echo`` or has media, and answers 400 for ids that are not a non-empty array of
non-negative integers. The router keys such a chat by the ids (a model it does not
disaggregate: the body reaches the replica as sent) and refuses malformed ones as vLLM does;
a disaggregated model's bodies go upstream without the client's ``kv_transfer_params``
(service/disagg.py), so there the messages are the prompt and nothing is refused."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from router.service.config import build_settings
from tests.backends import Backend, start_router
from tests.test_service_api import MODEL, make_fleet

IDS = [(i * 7919) % 90_000 + 1 for i in range(300)]
CHAT = [{"role": "user", "content": "hi"}]


def _decision(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return dict(p.split("=", 1) for p in resp.headers["X-KVRouter-Decision"].split("; "))


async def test_a_chat_forwarding_prompt_ids_is_keyed_by_them() -> None:
    async for fleet in make_fleet():
        r = await fleet.post("/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 1})
        assert r.status == 200, await r.text()
        first = _decision(r)
        await r.read()
        params = {"prompt_token_ids": IDS, "do_remote_prefill": False}
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "kv_transfer_params": params}
        r = await fleet.post("/v1/chat/completions", body)
        assert r.status == 200, await r.text()
        got = _decision(r)
        await r.read()
        # the engine's prompt is the ids: their count, and the blocks the completion left
        assert got["prompt_tokens"] == str(len(IDS)) and got["exact"] == "true"
        assert got["replica"] == first["replica"] and int(got["usable_tokens"]) > 0
        sent = next(b for b in fleet.backends if b.name == got["replica"]).received[-1]["body"]
        assert sent["kv_transfer_params"] == body["kv_transfer_params"]  # passed on as sent

        # echo (and media) make vLLM render the messages: so does the router
        r = await fleet.post("/v1/chat/completions", {**body, "echo": True})
        assert r.status == 200, await r.text()
        assert int(_decision(r)["prompt_tokens"]) < 50
        await r.read()


async def test_malformed_forwarded_prompt_ids_are_a_400_as_in_vllm() -> None:
    async for fleet in make_fleet():
        before = sum(len(b.received) for b in fleet.backends)
        for ids in ([], [1, -2], [1, 2.5], [True], "1 2"):
            body = {
                "model": MODEL,
                "messages": CHAT,
                "kv_transfer_params": {"prompt_token_ids": ids},
            }
            r = await fleet.post("/v1/chat/completions", body)
            assert r.status == 400, (ids, await r.text())
            error = (await r.json())["error"]
            assert (
                "prompt_token_ids" in error["message"] and error["type"] == "invalid_request_error"
            )
        assert sum(len(b.received) for b in fleet.backends) == before  # none went upstream


async def test_a_disaggregated_model_drops_forwarded_ids_before_keying() -> None:
    """The router speaks the P/D protocol for such a model: the client's params never reach
    a replica, so ids there neither key the request nor are checked."""
    prefill = await Backend("p0", [MODEL]).start()  # answers no kv_transfer_params: fallback
    decode = await Backend("d0", [MODEL]).start()
    settings = build_settings(
        {
            "server": {"max_retries": 2, "health_interval_s": 0, "debug_header": True},
            "replicas": [
                {"url": prefill.url, "model": MODEL, "name": "p0", "role": "prefill"},
                {"url": decode.url, "model": MODEL, "name": "d0", "role": "decode"},
            ],
            "models": {MODEL: {"block_size": 16, "pd": {"mode": "always"}}},
        }
    )
    router, url = await start_router(settings)
    try:
        async with aiohttp.ClientSession() as http:
            for ids in (IDS, [-1]):
                params = {"prompt_token_ids": ids}
                body: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 1}
                body["kv_transfer_params"] = params
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert int(_decision(r)["prompt_tokens"]) < 50  # the messages, not the ids
                got = decode.received[-1]["body"]
                assert got.get("kv_transfer_params") is None, json.dumps(got)[:200]
    finally:
        await router.cleanup()
        await prefill.stop()
        await decode.stop()
