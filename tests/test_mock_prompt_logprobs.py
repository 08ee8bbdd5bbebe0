"""Prompt logprobs and ``echo`` from the mock replica over real HTTP, as vLLM 0.34 answers
them: ``prompt_logprobs`` (the choice's on completions, the answer's on chat) is one entry a
prompt token, ``None`` for the first and ``{token id: Logprob}`` holding the prompt's own
token after; completions' ``echo`` puts the prompt text before the answer's, and with
``logprobs`` the prompt's tokens before the answer's in the logprobs (the first with no
logprob); chat's ``echo`` puts the last message's content before the answer when that
message has the role answered. Every answer is read by vLLM's own response models."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from router.mock.server import MockSettings
from tests.backends import metric_sample, start_mock
from tests.engines import anthropic_ref


@pytest.fixture
async def post() -> AsyncIterator[Callable[..., Any]]:
    runner, url = await start_mock(MockSettings(model="m", block_size=16))
    session = aiohttp.ClientSession()

    async def send(
        path: str, body: dict[str, Any] | None = None, status: int = 200, raw: bool = False
    ) -> Any:
        if body is None:  # a GET of a text page
            async with session.get(f"{url}{path}") as r:
                return await r.text()
        async with session.post(f"{url}{path}", json={"model": "m", **body}) as r:
            assert r.status == status, await r.text()
            return await (r.text() if raw else r.json())

    yield send
    await session.close()
    await runner.cleanup()


def _models() -> tuple[Any, Any]:
    mods = anthropic_ref.load()
    return (
        mods["vllm.entrypoints.openai.completion.protocol"].CompletionResponse,
        mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionResponse,
    )


PROMPT = [5, 17, 300, 42, 9, 1000, 7]


def _check_prompt_logprobs(entries: Any, ids: list[int]) -> None:
    assert isinstance(entries, list) and len(entries) == len(ids)
    assert entries[0] is None  # nothing before the first token to predict it from
    for entry, token in zip(entries[1:], ids[1:], strict=True):
        assert str(token) in entry
        assert set(entry[str(token)]) == {"logprob", "rank", "decoded_token"}


async def test_completion_prompt_logprobs_cover_the_prompt(post: Callable[..., Any]) -> None:
    completion, _ = _models()
    answer = await post(
        "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1}
    )
    completion.model_validate(answer)
    _check_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], PROMPT)


async def test_chat_prompt_logprobs_cover_the_prompt(post: Callable[..., Any]) -> None:
    _, chat = _models()
    messages = [{"role": "user", "content": "hello there"}]
    rendered = await post("/tokenize", {"messages": messages})
    answer = await post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}
    )
    chat.model_validate(answer)
    assert answer["usage"]["prompt_tokens"] == len(rendered["tokens"])
    _check_prompt_logprobs(answer["prompt_logprobs"], rendered["tokens"])


async def test_completion_echo_puts_the_prompt_before_the_answer(
    post: Callable[..., Any],
) -> None:
    completion, _ = _models()
    plain = await post("/v1/completions", {"prompt": "hello there", "max_tokens": 3})
    echoed = await post("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "echo": True})
    completion.model_validate(echoed)
    assert echoed["choices"][0]["text"] == "hello there" + plain["choices"][0]["text"]
    assert echoed["usage"]["completion_tokens"] == 3


async def test_completion_echo_with_logprobs_lists_the_prompts_tokens_first(
    post: Callable[..., Any],
) -> None:
    completion, _ = _models()
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1}
    answer = await post("/v1/completions", body)
    completion.model_validate(answer)
    choice = answer["choices"][0]
    logprobs = choice["logprobs"]
    n = len(PROMPT) + 3
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][len(PROMPT)] == len(choice["text"]) - len(
        "".join(logprobs["tokens"][len(PROMPT) :])
    )
    _check_prompt_logprobs(choice["prompt_logprobs"], PROMPT)


async def test_chat_echo_repeats_a_last_message_of_the_answered_role(
    post: Callable[..., Any],
) -> None:
    _, chat = _models()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    body = {"messages": messages, "max_tokens": 2, "add_generation_prompt": False}
    plain = await post("/v1/chat/completions", body)
    echoed = await post("/v1/chat/completions", {**body, "echo": True})
    chat.model_validate(echoed)
    content = echoed["choices"][0]["message"]["content"]
    assert content == "Once" + plain["choices"][0]["message"]["content"]
    # echo with chat's default top_logprobs (0) asks prompt logprobs (vLLM's to_sampling_params)
    assert len(echoed["prompt_logprobs"]) == echoed["usage"]["prompt_tokens"]


async def test_streamed_prompt_logprobs_are_refused_as_vllm_refuses_them(
    post: Callable[..., Any],
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}
    answer = await post("/v1/completions", body, status=400)
    assert "prompt_logprobs" in answer["error"]["message"]


async def test_a_request_reading_no_cache_is_no_prefix_cache_query(
    post: Callable[..., Any],
) -> None:
    """vLLM counts ``vllm:prefix_cache_queries`` / ``_hits`` only for requests that looked
    the prefix cache up (``record_prefix_cache_stats``); prompt-logprobs requests do not."""
    prompt = list(range(1, 41))
    await post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    await post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})
    looked_up = await post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    page = await post("/metrics")
    labels = {"model_name": "m"}
    assert metric_sample(page, "vllm:prompt_tokens_total", **labels) == 3 * len(prompt)
    assert metric_sample(page, "vllm:prefix_cache_queries_total", **labels) == 2 * len(prompt)
    hits = looked_up["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hits > 0
    assert metric_sample(page, "vllm:prefix_cache_hits_total", **labels) == hits


async def test_without_a_generation_prompt_the_answer_has_the_last_messages_role(
    post: Callable[..., Any],
) -> None:
    """vLLM's ``get_chat_request_role``: the last message's role when
    ``add_generation_prompt`` is false, in the answer's message and a stream's role chunk."""
    _, chat = _models()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Once"}]
    body = {"messages": messages, "max_tokens": 2, "add_generation_prompt": False}
    answer = await post("/v1/chat/completions", body)
    chat.model_validate(answer)
    assert answer["choices"][0]["message"]["role"] == "user"
    for n in (1, 2):
        text = await post("/v1/chat/completions", {**body, "n": n, "stream": True}, raw=True)
        roles = [
            choice["delta"]["role"]
            for line in text.splitlines()
            if line.startswith("data: {")
            for choice in json.loads(line[6:])["choices"]
            if "role" in choice["delta"]
        ]
        assert roles == ["user"] * n
    many = await post("/v1/chat/completions", {**body, "n": 2})
    assert [c["message"]["role"] for c in many["choices"]] == ["user", "user"]


async def test_echo_without_generation_answers_the_prompt_alone(
    post: Callable[..., Any],
) -> None:
    """Completions' ``echo`` with ``max_tokens: 0`` (lm-eval's loglikelihood request): vLLM
    runs the engine for one token (``echo_without_generation``) and answers the prompt's
    text and, asked, its logprobs alone; the one token is counted in
    ``completion_tokens`` (``len(output.token_ids)``), and it ends with ``length``."""
    completion, _ = _models()
    body = {"prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1}
    answer = await post("/v1/completions", body)
    completion.model_validate(answer)
    choice = answer["choices"][0]
    assert choice["text"] == "hello" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == list("hello")
    assert choice["logprobs"]["token_logprobs"] == [None, 0.0, 0.0, 0.0, 0.0]
    assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 1
    plain = await post("/v1/completions", {**body, "logprobs": None, "n": 2})
    assert [c["text"] for c in plain["choices"]] == ["hello", "hello"]
    assert [c["logprobs"] for c in plain["choices"]] == [None, None]
    opts = {"stream_options": {"include_usage": True}}
    text = await post("/v1/completions", {**body, "stream": True, **opts}, raw=True)
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    assert "".join(c["text"] for c in choices) == "hello"
    assert [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]] == list("hello")
    assert choices[-1]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 1


async def test_no_output_without_echo_is_still_refused(post: Callable[..., Any]) -> None:
    await post("/v1/completions", {"prompt": "hello", "max_tokens": 0}, status=400)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "echo": True}
    await post("/v1/chat/completions", body, status=400)
