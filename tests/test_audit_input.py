"""Wrong-typed input and unexpected errors, over the router's HTTP server.

Fields of the right JSON shape but the wrong type inside a chat message (a content part's
``text``, a message's ``name`` or ``tool_call_id``) are a client error: 400 with an
OpenAI-style body naming the field, nothing forwarded. They used to crash prompt processing
(``len(int)`` counting content characters, ``hash(dict)`` computing the message keys of a
conversation long enough for the incremental cache) and answer 500. Anything else that goes
wrong inside the router answers an OpenAI-style 500 JSON body, and is logged.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router

MODEL = "kimi-test"
APPROX = "approx-model"
ENGINES = ["fast"]
LONG = {"role": "system", "content": "You are an agent. " * 1200}  # > 16 K characters


@dataclass
class Router:
    url: str
    backend: Backend
    http: aiohttp.ClientSession

    async def post(self, path: str, payload: Any) -> tuple[int, dict[str, str], bytes]:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        async with self.http.post(self.url + path, data=data) as r:
            return r.status, dict(r.headers), await r.read()


@pytest.fixture(params=ENGINES)
async def router(request: pytest.FixtureRequest) -> AsyncIterator[Router]:
    backend = await Backend("b0", [MODEL, APPROX]).start()
    settings = build_settings(
        {
            "replicas": [
                {"url": backend.url, "model": MODEL, "name": "b0"},
                {"url": backend.url, "model": APPROX, "name": "a0"},
            ],
            "models": {MODEL: kimi_model_table(context_length=1_000_000)},
        }
    )
    runner, url = await start_router(settings, str(request.param))
    http = aiohttp.ClientSession()
    try:
        yield Router(url, backend, http)
    finally:
        await http.close()
        await runner.cleanup()
        await backend.stop()


def _openai_error(status: int, data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    return err  # type: ignore[no-any-return]


def _chat(model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": model, "messages": messages}


BAD_MESSAGES = [
    # (id, model, messages, expected message)
    (
        "text-int",
        MODEL,
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "'messages[0].content[0].text' must be a string",
    ),
    (
        "text-int-long",
        MODEL,
        [LONG, {"role": "user", "content": [{"type": "text", "text": 5}]}],
        "'messages[1].content[0].text' must be a string",
    ),
    (
        "text-dict-second-part",
        MODEL,
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": {"a": 1}}]}],
        "'messages[0].content[1].text' must be a string",
    ),
    (
        "text-int-approximate",
        APPROX,
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "'messages[0].content[0].text' must be a string",
    ),
    (
        "name-dict-long",
        MODEL,
        [
            LONG,
            {"role": "user", "content": "hi"},
            {"role": "tool", "name": {"a": 1}, "content": "r"},
        ],
        "'messages[2].name' must be a string",
    ),
    (
        "name-int-short",
        MODEL,
        [{"role": "user", "content": "hi", "name": 7}],
        "'messages[0].name' must be a string",
    ),
    (
        "tool-call-id-list-long",
        MODEL,
        [
            LONG,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "tool_call_id": ["c1"], "content": "r"},
        ],
        "'messages[3].tool_call_id' must be a string",
    ),
]


@pytest.mark.parametrize(
    ("model", "messages", "needle"),
    [case[1:] for case in BAD_MESSAGES],
    ids=[case[0] for case in BAD_MESSAGES],
)
async def test_wrong_typed_message_fields_are_400(
    router: Router, model: str, messages: list[dict[str, Any]], needle: str
) -> None:
    status, headers, data = await router.post("/v1/chat/completions", _chat(model, messages))
    assert status == 400, (status, data[:300])
    assert headers["Content-Type"].startswith("application/json")
    err = _openai_error(status, data)
    assert err["message"] == needle
    assert err["type"] == "invalid_request_error"
    assert router.backend.received == []
    # the router is fine afterwards, and the well-typed forms still pass
    ok = _chat(
        model, [*messages[:-1], {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    )
    status, _, data = await router.post("/v1/chat/completions", ok)
    assert status == 200, data[:300]


async def test_well_typed_optional_fields_still_pass(router: Router) -> None:
    """None (JSON null) is as good as absent for ``text``, ``name`` and ``tool_call_id``;
    string content parts are accepted as before."""
    messages = [
        LONG,
        {"role": "user", "content": [{"type": "text", "text": None}, "plain part"], "name": None},
        {"role": "assistant", "content": "ok", "name": "helper"},
        {"role": "tool", "tool_call_id": "c1", "content": "r", "name": None},
        {"role": "user", "content": "next", "tool_call_id": None},
    ]
    status, _, data = await router.post("/v1/chat/completions", _chat(MODEL, messages))
    assert status == 200, data[:300]


async def test_unexpected_error_is_openai_style_500(
    router: Router, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the router (here: prompt processing raising something unexpected) answers an
    OpenAI-style 500 JSON body, and the exception is logged; the router keeps serving."""
    from router.tokenize.pipeline import PromptProcessor

    def broken(self: PromptProcessor, body: Any) -> Any:
        raise RuntimeError("simulated bug in prompt processing")

    monkeypatch.setattr(PromptProcessor, "completion", broken)
    with caplog.at_level(logging.ERROR):
        status, headers, data = await router.post(
            "/v1/completions", {"model": MODEL, "prompt": "hi"}
        )
    assert status == 500, (status, data[:300])
    assert headers["Content-Type"].startswith("application/json")
    err = _openai_error(status, data)
    assert err["type"] == "internal_server_error"
    assert "simulated bug" not in err["message"]  # internals are logged, not sent
    assert any(r.exc_info and "simulated bug" in str(r.exc_info[1]) for r in caplog.records), (
        caplog.text
    )
    status, _, _ = await router.post("/v1/chat/completions", _chat(MODEL, [LONG]))
    assert status == 200


async def test_unexpected_error_on_a_side_endpoint_is_openai_style_500(
    router: Router, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failing handler of a route other than the hot endpoints (``/metrics``) answers
    OpenAI-style 500 JSON there too, and is logged."""
    from router.service.metrics import Metrics

    async def broken(self: Metrics) -> bytes:
        raise ValueError("simulated bug in the metrics page")

    monkeypatch.setattr(Metrics, "page", broken)
    with caplog.at_level(logging.ERROR):
        async with router.http.get(router.url + "/metrics") as r:
            status, ctype, data = r.status, r.headers.get("Content-Type", ""), await r.read()
    assert status == 500, (status, data[:300])
    assert ctype.startswith("application/json"), (ctype, data[:300])
    assert _openai_error(status, data)["type"] == "internal_server_error"
    assert any(r.exc_info and "simulated bug" in str(r.exc_info[1]) for r in caplog.records), (
        caplog.text
    )
    monkeypatch.undo()
    async with router.http.get(router.url + "/health") as r:
        assert r.status == 200
