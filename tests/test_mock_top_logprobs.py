"""How many top logprobs the mock replica lists, and which it refuses, as vLLM 0.34 does.

vLLM's engine gives each position the sampled token then the ``k`` best
(``append_logprobs_for_next_position``, vllm/logprobs.py: one dict, so a sampled token among
the best is there once); the mock's filler token is the best, so ``max(k, 1)`` candidates.
Chat lists the first ``top_logprobs`` of them, none when unset
(``chat_top_logprobs_limit``); completions the first ``logprobs + 1``
(``completion_top_logprobs_limit``). The others are tokens the filler's certainty leaves
impossible: logprob -inf, which vLLM writes as -9999.0."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from router.mock.server import MockSettings
from tests.backends import start_mock
from tests.test_mock_prompt_logprobs import _models

CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def post() -> AsyncIterator[Callable[..., Any]]:
    runner, url = await start_mock(MockSettings(model="m", block_size=16))
    session = aiohttp.ClientSession()

    async def send(path: str, body: dict[str, Any], status: int = 200) -> Any:
        async with session.post(f"{url}{path}", json={"model": "m", **body}) as r:
            assert r.status == status, await r.text()
            if body.get("stream"):
                return await r.text()
            return await r.json()

    yield send
    await session.close()
    await runner.cleanup()


@pytest.mark.parametrize("top", [None, 0, 1, 3])
async def test_chat_lists_top_logprobs_of_the_entries_asked(
    post: Callable[..., Any], top: int | None
) -> None:
    _, chat = _models()
    body: dict[str, Any] = {"messages": CHAT, "max_tokens": 2, "logprobs": True}
    if top is not None:
        body["top_logprobs"] = top
    answer = await post("/v1/chat/completions", body)
    chat.model_validate(answer)
    for entry in answer["choices"][0]["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        assert len(tops) == (top or 0)
        if tops:  # the sampled token first, certain; the rest impossible
            assert tops[0]["token"] == entry["token"] and tops[0]["logprob"] == 0.0
            assert all(t["logprob"] == -9999.0 for t in tops[1:])
            assert len({t["token"] for t in tops}) == len(tops)


@pytest.mark.parametrize("k", [0, 1, 4])
async def test_completions_list_logprobs_plus_one_of_max_k_1_candidates(
    post: Callable[..., Any], k: int
) -> None:
    completion, _ = _models()
    answer = await post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "logprobs": k})
    completion.model_validate(answer)
    logprobs = answer["choices"][0]["logprobs"]
    for token, tops in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
        assert len(tops) == max(k, 1)
        assert tops[token] == 0.0
        assert sorted(tops.values()) == [-9999.0] * (len(tops) - 1) + [0.0]


async def test_streamed_chat_top_logprobs_match_the_answer(post: Callable[..., Any]) -> None:
    body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    text = await post("/v1/chat/completions", {**body, "stream": True})
    counts = [
        len(entry["top_logprobs"])
        for line in text.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
        for entry in ((choice.get("logprobs") or {}).get("content") or [])
    ]
    assert counts == [2, 2]


# vLLM's engine (SamplingParams._validate_logprobs, run when the engine takes the request)
# refuses more logprobs than --max-logprobs (20 by default): a 400 naming the parameter, or,
# on a stream (opened before the engine takes the request), its error event then [DONE]
OVER = [
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", {"prompt": "abc", "logprobs": 21}),
    ("/v1/completions", {"prompt": "abc", "logprobs": 21, "n": 2}),
]


def _over_error(value: int, param: str = "logprobs", kind: str = "sample") -> dict[str, Any]:
    message = (
        f"Requested {kind} logprobs of {value}, which is greater than max allowed: 20 "
        f"(parameter={param}, value={value})"
    )
    return {"message": message, "type": "BadRequestError", "param": param, "code": 400}


@pytest.mark.parametrize(("path", "body"), OVER)
async def test_more_logprobs_than_the_max_are_refused(
    post: Callable[..., Any], path: str, body: dict[str, Any]
) -> None:
    answer = await post(path, {**body, "max_tokens": 2}, status=400)
    assert answer == {"error": _over_error(21)}


@pytest.mark.parametrize(("path", "body"), OVER)
async def test_a_stream_asking_too_many_logprobs_ends_with_the_error(
    post: Callable[..., Any], path: str, body: dict[str, Any]
) -> None:
    text = await post(path, {**body, "max_tokens": 2, "stream": True})
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 2
    assert json.loads(events[0]) == {"error": _over_error(21)}


async def test_too_many_prompt_logprobs_are_refused(post: Callable[..., Any]) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "prompt_logprobs": 25}
    answer = await post("/v1/completions", body, status=400)
    assert answer == {"error": _over_error(25, "prompt_logprobs", "prompt")}


async def test_the_max_itself_is_served(post: Callable[..., Any]) -> None:
    body = {"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 20}
    answer = await post("/v1/chat/completions", body)
    assert len(answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}),
        ("/v1/completions", {"prompt": "abc", "logprobs": -1}),
    ],
)
async def test_all_of_the_vocabulary_is_more_than_the_max(
    post: Callable[..., Any], path: str, body: dict[str, Any]
) -> None:
    """vLLM reads -1 as the vocabulary's size, above its default max (the mock, without a
    model vocabulary, names it -1)."""
    answer = await post(path, {**body, "max_tokens": 2}, status=400)
    assert answer["error"]["param"] == "logprobs"
    assert "greater than max allowed: 20" in answer["error"]["message"]
