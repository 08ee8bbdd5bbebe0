"""The mock replica serves vLLM's prompt-preparation endpoints (render, tokenize, detokenize)
with the tokenizer its completions use, and takes bodies past aiohttp's 1 MiB default: what
a peer router (vllm-router) calls on a vLLM backend before it picks one."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web

from router.mock.server import MockSettings, create_app
from tests.ports import free_port

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Why is the sky blue? " * 10},
]


@pytest.fixture
async def mock() -> AsyncIterator[str]:
    runner = web.AppRunner(create_app(MockSettings(model="m", max_model_len=5000)))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _post(url: str, path: str, body: object) -> tuple[int, object]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        return r.status, await r.json()


async def test_render_gives_the_ids_the_completion_is_served_with(mock: str) -> None:
    status, rendered = await _post(mock, "/v1/chat/completions/render", {"messages": CHAT})
    assert status == 200 and isinstance(rendered, dict)
    ids = rendered["token_ids"]
    async with openai.AsyncOpenAI(base_url=mock + "/v1", api_key="x", max_retries=0) as client:
        answer = await client.chat.completions.create(model="m", messages=CHAT, max_tokens=1)
        assert answer.usage is not None and answer.usage.prompt_tokens == len(ids)
        # the rendered ids as a token-id prompt hit what the chat cached
        again = await client.completions.create(model="m", prompt=ids, max_tokens=1)
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens
    status, batch = await _post(mock, "/v1/completions/render", {"prompt": ["ab", "abc"]})
    assert status == 200 and batch == [
        {"token_ids": [97, 98], "features": None},
        {"token_ids": [97, 98, 99], "features": None},
    ]
    status, direct = await _post(mock, "/v1/completions/render", {"prompt": [5, 6, 7]})
    assert direct == [{"token_ids": [5, 6, 7], "features": None}]


async def test_tokenize_and_detokenize_round_trip(mock: str) -> None:
    status, got = await _post(mock, "/tokenize", {"prompt": "héllo"})
    assert status == 200 and isinstance(got, dict)
    assert got["count"] == len(got["tokens"]) == len("héllo".encode())
    assert got["max_model_len"] == 5000
    status, text = await _post(mock, "/detokenize", {"tokens": got["tokens"]})
    assert (status, text) == (200, {"prompt": "héllo"})
    _, chat = await _post(mock, "/tokenize", {"messages": CHAT})
    _, rendered = await _post(mock, "/v1/chat/completions/render", {"messages": CHAT})
    assert isinstance(chat, dict) and isinstance(rendered, dict)
    assert chat["tokens"] == rendered["token_ids"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": ""}),
        # vLLM's TokenizeCompletionRequest.prompt is a string: no ids, no batch
        ("/tokenize", {"prompt": [1, 2]}),
        ("/tokenize", {"prompt": ["a", "b"]}),
        ("/tokenize", {"prompt": ["a"]}),
        ("/tokenize", {"prompt": 5}),
        ("/tokenize", {}),
        ("/detokenize", {"tokens": ["x"]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/v1/chat/completions/render", {"messages": "no"}),
        ("/v1/completions/render", {"prompt": list(range(6000))}),  # past max_model_len
    ],
)
async def test_bad_input_is_an_openai_error(mock: str, path: str, body: object) -> None:
    status, got = await _post(mock, path, body)
    assert status == 400 and isinstance(got, dict) and got["error"]["type"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [1, 2]}),
        ("/v1/chat/completions/render", {"messages": CHAT}),
        ("/v1/completions/render", {"prompt": "hi"}),
    ],
)
async def test_a_model_not_served_is_a_404_as_vllm_answers(
    mock: str, path: str, body: dict[str, object]
) -> None:
    """vLLM checks the body's ``model`` on its tokenizer and render endpoints too
    (``_check_model``): another model is a 404 ``NotFoundError``; the served one, or none,
    is answered."""
    status, got = await _post(mock, path, {**body, "model": "other"})
    assert status == 404 and isinstance(got, dict)
    assert got["error"]["type"] == "NotFoundError" and "`other` does not exist" in str(got)
    for named in ({"model": "m"}, {}):
        status, got = await _post(mock, path, {**body, **named})
        assert status == 200, got


async def test_bodies_past_one_mebibyte_are_read(mock: str) -> None:
    text = "ab" * 2**20  # 2 MiB of text (/tokenize takes text only, as vLLM's)
    raw = json.dumps({"prompt": text}).encode()
    assert len(raw) > 2**21
    async with aiohttp.ClientSession() as http, http.post(mock + "/tokenize", data=raw) as r:
        assert r.status == 200
        assert (await r.json())["count"] == len(text)


async def test_detokenize_takes_ids_as_vllm_does(mock: str) -> None:
    """vLLM's DetokenizeRequest takes ids in [0, 2**63) and decodes them with the model's
    tokenizer: HF ``tokenizers`` drops an id outside its vocabulary, and refuses one past
    u32 (an OverflowError, vLLM's 400)."""
    status, got = await _post(mock, "/detokenize", {"tokens": [104, 10**6, 105]})
    assert (status, got) == (200, {"prompt": "hi"})
    status, got = await _post(mock, "/detokenize", {"tokens": [104, 2**32]})
    assert status == 400 and isinstance(got, dict)
    assert got["error"] == {
        "message": "number too large to fit in target type",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    for bad in (2**63, True, 1.5):
        status, got = await _post(mock, "/detokenize", {"tokens": [bad]})
        assert status == 400 and isinstance(got, dict)
        assert got["error"]["message"] != "number too large to fit in target type"
