"""The mock replica serves ``n`` > 1 and completion batches as vLLM 0.34 serves them
(router/mock/multi.py): a choice per sequence, prompt ``i``'s sample ``j`` at index
``i * n + j``; streamed chunks interleaved as the engine emits them, each with one choice
and its own ``finish_reason``; usage counting each prompt once and summing the sequences'
tokens; the engine running every sequence (a batch's prompts apart, a prompt's ``n``
samples reusing the blocks the first prefilled). One sequence of one prompt is answered as
before (tests/fixtures/mock_single_answers.json)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from router.core.hashing import hash_prompt, root_hash
from router.mock.server import MockSettings, create_app
from router.mock.state import STATE, MockState
from tests import mock_single
from tests.engines import anthropic_ref
from tests.ports import free_port
from tests.test_mock_vllm_wire import _events
from tests.waiting import eventually

MODEL = "m"
B = 16
CHAT = [{"role": "user", "content": "hello there"}]
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "mock_single_answers.json"


class Mock:
    def __init__(self, url: str, app: web.Application) -> None:
        self.url = url
        self.app = app
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

    @property
    def state(self) -> MockState:
        return self.app[STATE]


@pytest.fixture
async def mock() -> AsyncIterator[Callable[..., Any]]:
    runners: list[tuple[web.AppRunner, Mock]] = []

    async def start(**overrides: Any) -> Mock:
        settings = replace(MockSettings(model=MODEL, block_size=B, time_scale=0.05), **overrides)
        app = create_app(settings)
        # as `kvrouter mock-replica` serves it (router/mock/cli.py): a client that goes away
        # cancels its handler, as vLLM's with_cancellation does
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        m = Mock(f"http://127.0.0.1:{port}", app)
        runners.append((runner, m))
        return m

    yield start
    for runner, m in runners:
        await m.client.close()
        await runner.cleanup()


def _vllm() -> dict[str, Any]:
    mods = anthropic_ref.load()
    return {
        "chat": mods["vllm.entrypoints.openai.chat_completion.protocol"],
        "completion": mods["vllm.entrypoints.openai.completion.protocol"],
    }


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        return r.status, await r.json()


async def _counters(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        page = await r.text()
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("vllm:") and "_total{" in line:
            out[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    return out


async def test_one_sequence_of_one_prompt_is_answered_as_before(mock: Callable) -> None:
    """``n`` absent or 1, a prompt or a batch of one: the same answers, usage and engine
    counters as the mock gave before it served several sequences (the live bench's
    figures rest on them)."""
    m = await mock(time_scale=1.0)
    assert await mock_single.answers(m.url, MODEL) == json.loads(FIXTURE.read_text())


async def test_a_batch_sampled_n_times_answers_a_choice_per_sequence(mock: Callable) -> None:
    m = await mock()
    p0, p1 = list(range(200, 230)), list(range(300, 350))
    answer = await m.client.completions.create(model=MODEL, prompt=[p0, p1], n=2, max_tokens=3)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert all(c.text == " tok0 tok1 tok2" for c in answer.choices)
    assert all(c.finish_reason == "length" for c in answer.choices)
    # each prompt counted once (n does not multiply it); every sequence's tokens summed
    assert answer.usage.prompt_tokens == len(p0) + len(p1)
    assert answer.usage.completion_tokens == 4 * 3
    assert answer.usage.total_tokens == len(p0) + len(p1) + 12
    texts = await m.client.completions.create(model=MODEL, prompt=["ab", "cde"], max_tokens=2)
    assert [c.index for c in texts.choices] == [0, 1]
    assert texts.usage.prompt_tokens == 5 and texts.usage.completion_tokens == 4
    sampled = await m.client.completions.create(model=MODEL, prompt=p0, n=3, max_tokens=2)
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert sampled.usage.prompt_tokens == len(p0) and sampled.usage.completion_tokens == 6
    # echo puts each choice's own prompt first
    status, echoed = await _post(
        m.url,
        "/v1/completions",
        {"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 1, "echo": True},
    )
    assert status == 200
    assert [c["text"] for c in echoed["choices"]] == ["ab tok0", "ab tok0", "cd tok0", "cd tok0"]
    # every field vLLM's CompletionResponse dumps
    v = _vllm()
    status, body = await _post(
        m.url, "/v1/completions", {"model": MODEL, "prompt": [p0, p1], "n": 2, "max_tokens": 2}
    )
    assert status == 200
    parsed = v["completion"].CompletionResponse.model_validate(body)
    dumped = parsed.model_dump(mode="json")
    assert set(dumped) <= set(body) and set(dumped["choices"][3]) <= set(body["choices"][3])


async def test_a_streamed_batch_interleaves_one_choice_a_chunk(mock: Callable) -> None:
    m = await mock()
    v = _vllm()
    p0, p1 = list(range(200, 230)), list(range(300, 350))
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": [p0, p1], "n": 2, "max_tokens": 4, "stream": True}
    events = await _events(m.url, "/v1/completions", body | {"stream_options": opts})
    assert events[-1] == "[DONE]"
    chunks = [v["completion"].CompletionStreamResponse.model_validate(e) for e in events[:-1]]
    *deltas, last = chunks
    assert all(len(c.choices) == 1 for c in deltas)
    text: dict[int, str] = {}
    finished: dict[int, list[str]] = {}
    for c in deltas:
        (choice,) = c.choices
        i = choice.index
        assert i not in finished, "a chunk after its choice's finish"
        text[i] = text.get(i, "") + choice.text
        if choice.finish_reason is not None:
            finished[i] = [choice.finish_reason]
        # continuous usage: the chunk's prompt, the choice's tokens so far
        assert c.usage.prompt_tokens == len((p0, p1)[i // 2])
        assert c.usage.completion_tokens == text[i].count("tok")
    assert text == {i: " tok0 tok1 tok2 tok3" for i in range(4)}
    assert finished == {i: ["length"] for i in range(4)}
    assert last.choices == [] and last.usage.prompt_tokens == len(p0) + len(p1)
    assert last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    # the openai client reads it too
    stream = await m.client.completions.create(
        model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=2, stream=True
    )
    seen = [c.choices[0].index async for c in stream if c.choices]
    assert set(seen) == {0, 1, 2, 3}


async def test_chat_samples_n_choices_each_with_its_role_first(mock: Callable) -> None:
    m = await mock()
    v = _vllm()
    answer = await m.client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=4)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.content == " tok0 tok1 tok2 tok3" for c in answer.choices)
    assert all(
        c.message.role == "assistant" and c.finish_reason == "length" for c in answer.choices
    )
    prompt = answer.usage.prompt_tokens
    assert answer.usage.completion_tokens == 12 and answer.usage.total_tokens == prompt + 12
    status, body = await _post(
        m.url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 2, "max_tokens": 1}
    )
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    parsed = v["chat"].ChatCompletionResponse.model_validate(body)
    assert set(parsed.model_dump(mode="json")) <= set(body)
    # streamed: vLLM sends a role chunk for every choice first, then the tokens
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = await _events(
        m.url,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "n": 3, "max_tokens": 4, "stream": True}
        | {"stream_options": opts},
    )
    chunks = [v["chat"].ChatCompletionStreamResponse.model_validate(e) for e in events[:-1]]
    *deltas, last = chunks
    roles = deltas[:3]
    assert [c.choices[0].index for c in roles] == [0, 1, 2]
    assert all(c.choices[0].delta.role == "assistant" for c in roles)
    assert all(c.choices[0].delta.content == "" for c in roles)
    assert all(c.usage.completion_tokens == 0 for c in roles)
    assert roles[0].usage.prompt_tokens_details.cached_tokens is not None
    content: dict[int, str] = {}
    ends: dict[int, str] = {}
    for c in deltas[3:]:
        (choice,) = c.choices
        assert choice.delta.role is None and choice.index not in ends
        content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            ends[choice.index] = choice.finish_reason
        assert c.usage.prompt_tokens == prompt
        assert c.usage.completion_tokens == content[choice.index].count("tok")
    assert content == {i: " tok0 tok1 tok2 tok3" for i in range(3)}
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == prompt


async def test_the_engine_runs_every_sequence_the_samples_on_the_first_s_blocks(
    mock: Callable,
) -> None:
    """n samples are n engine requests: the first prefills the prompt, the others reuse
    its blocks (vLLM's children hit the prefix cache); a batch's prompts are requests of
    their own, each with its own prefix, and their blocks are cached. The answer's
    ``cached_tokens`` is vLLM's: the last sequence to finish's (a stream: the first's)."""
    m = await mock()
    prompt = list(range(1000, 1000 + 10 * B + 5))
    hit = 10 * B
    before = await _counters(m.url)
    answer = await m.client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=2)
    after = await _counters(m.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:request_success_total"] == 3
    assert delta["vllm:prompt_tokens_total"] == 3 * len(prompt)
    assert delta["vllm:prefix_cache_hits_total"] == 2 * hit  # the two samples'
    assert delta["vllm:generation_tokens_total"] == 6
    assert answer.usage.prompt_tokens_details.cached_tokens == hit
    fresh = list(range(5000, 5000 + 4 * B + 3))
    events = await _events(
        m.url,
        "/v1/completions",
        {"model": MODEL, "prompt": fresh, "n": 2, "max_tokens": 2, "stream": True}
        | {"stream_options": {"include_usage": True}},
    )
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # a batch: each prompt its own request, its blocks cached under its own chain
    p0, p1 = list(range(7000, 7000 + 3 * B)), list(range(8000, 8000 + 5 * B))
    await m.client.completions.create(model=MODEL, prompt=[p0, p1], max_tokens=1)
    model = m.state.driver.model
    for p in (p0, p1):
        chain = hash_prompt(p, B, root_hash(MODEL, None)).hashes
        assert chain and all(model.has_block(h) for h in chain)
    assert model.pending() == 0
    # the decode batch holds every sequence at once: 2 prompts x 2 samples
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": [p0, p1], "n": 2, "max_tokens": 400, "stream": True}
        async with http.post(m.url + "/v1/completions", json=body) as r:
            await r.content.readline()
            await eventually(lambda: m.state.driver.report().running == 4)
            await r.read()
    await eventually(lambda: model.pending() == 0)


async def test_a_client_gone_mid_stream_cancels_every_sequence(mock: Callable) -> None:
    m = await mock(time_scale=1.0)
    body = {"model": MODEL, "prompt": ["ab", "cd"], "n": 3, "max_tokens": 2000, "stream": True}
    async with (
        aiohttp.ClientSession() as http,
        http.post(m.url + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200
        await r.content.readline()
        assert m.state.driver.model.pending() == 6
    await eventually(lambda: m.state.driver.model.pending() == 0)


async def test_what_it_does_not_serve_is_refused_never_answered_short(mock: Callable) -> None:
    m = await mock(kv_blocks=4)
    cases = [
        # a prompt no engine of this size can run: the whole batch is refused
        ({"prompt": ["ab", "x" * 200], "max_tokens": 1}, "cannot be served"),
        ({"prompt": "ab", "n": 2, "max_tokens": 200}, "cannot be served"),
        # vLLM's prompt is a list of strings or of token-id lists, never both
        ({"prompt": ["ab", [1, 2]], "max_tokens": 1}, "prompt"),
        ({"prompt": ["ab", ""], "max_tokens": 1}, "empty"),
        ({"prompt": "ab", "n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "'n'"),
        ({"prompt": "ab", "n": 1025, "max_tokens": 1}, "'n'"),
    ]
    for body, words in cases:
        for stream in (False, True):
            status, answer = await _post(
                m.url, "/v1/completions", {"model": MODEL, "stream": stream, **body}
            )
            assert status == 400, (body, answer)
            assert words in answer["error"]["message"], (body, answer)
    await eventually(lambda: m.state.driver.model.pending() == 0)


@pytest.mark.parametrize("time_scale", [0.05, 1e-5])
async def test_a_stream_with_a_sequence_that_cannot_run_is_refused_before_it_opens(
    mock: Callable, time_scale: float
) -> None:
    """A batch or ``n`` samples of which one sequence can never run: 400 before any byte of
    a stream, however fast the model's clock runs (at 1e-5 the first prompt's prefill
    finished between the submits, its first token opened the stream, and the refusal came
    as an error event after a 200)."""
    m = await mock(kv_blocks=4, time_scale=time_scale)
    for body in (
        {"prompt": ["ab", "x" * 200], "max_tokens": 1},
        {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 200},
    ):
        status, answer = await _post(
            m.url, "/v1/completions", {"model": MODEL, "stream": True, **body}
        )
        assert status == 400 and "cannot be served" in answer["error"]["message"], answer
    await eventually(lambda: m.state.driver.model.pending() == 0)


async def test_echo_and_logprobs_are_each_choice_s_own(mock: Callable) -> None:
    m = await mock()
    body = {"model": MODEL, "prompt": ["ab", "cd"], "n": 2, "max_tokens": 2, "stream": True}
    events = await _events(m.url, "/v1/completions", body | {"echo": True, "logprobs": 0})
    text: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["text"]
            if c["logprobs"]:
                tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
    assert text == {0: "ab tok0 tok1", 1: "ab tok0 tok1", 2: "cd tok0 tok1", 3: "cd tok0 tok1"}
    assert tokens[0] == ["a", "b", " tok0", " tok1"] and tokens[3][:2] == ["c", "d"]
    said = [*CHAT, {"role": "assistant", "content": "Once"}]
    chat = {"model": MODEL, "messages": said, "n": 2, "max_tokens": 1, "echo": True}
    chat |= {"add_generation_prompt": False}
    status, answer = await _post(m.url, "/v1/chat/completions", chat)
    assert status == 200
    assert [c["message"]["content"] for c in answer["choices"]] == ["Once tok0", "Once tok0"]
    events = await _events(m.url, "/v1/chat/completions", chat | {"stream": True})
    deltas = [e["choices"][0] for e in events[:-1]]
    assert [(d["index"], d["delta"]) for d in deltas[:4]] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
        (0, {"content": "Once"}),
        (1, {"content": "Once"}),
    ]
