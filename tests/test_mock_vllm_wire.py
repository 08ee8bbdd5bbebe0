"""The mock replica's HTTP answers read by vLLM 0.34's own response models (the vendored
protocol files, tests/engines/README.md) and by the ``openai`` client, as vLLM's would be:
every field vLLM's non-streamed answers carry, stream chunks and their usage, error bodies
and statuses, logprobs, the context length, and the endpoints routers call."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from router.mock.server import MockSettings, create_app
from tests.engines import anthropic_ref
from tests.ports import free_port

MODEL = "m"
CHAT = [{"role": "user", "content": "hello there"}]


def _vllm() -> dict[str, Any]:
    mods = anthropic_ref.load()
    return {
        "chat": mods["vllm.entrypoints.openai.chat_completion.protocol"],
        "completion": mods["vllm.entrypoints.openai.completion.protocol"],
        "engine": mods["vllm.entrypoints.serve.engine.protocol"],
    }


@pytest.fixture
async def mock() -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []

    async def start(**overrides: Any) -> str:
        settings = replace(MockSettings(model=MODEL, block_size=16), **overrides)
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


def _missing(sent: Any, dumped: Any, path: str = "") -> list[str]:
    """Keys of vLLM's dump of the answer (``dumped``) absent from the answer (``sent``)."""
    if isinstance(dumped, dict) and isinstance(sent, dict):
        out = [f"{path}.{k}" for k in dumped if k not in sent]
        for k in dumped.keys() & sent.keys():
            out += _missing(sent[k], dumped[k], f"{path}.{k}")
        return out
    if isinstance(dumped, list) and isinstance(sent, list):
        return [
            m
            for i, (s, d) in enumerate(zip(sent, dumped, strict=True))
            for m in _missing(s, d, f"{path}[{i}]")
        ]
    return []


def _as_vllm_sends(model: Any, sent: dict[str, Any]) -> Any:
    """``sent`` read by vLLM's model; it must carry every field vLLM's ``model_dump()``
    (what vLLM's JSONResponse sends) has."""
    parsed = model.model_validate(sent)
    assert _missing(sent, parsed.model_dump(mode="json")) == []
    return parsed


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        return r.status, await r.json()


async def _events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The ``data:`` payloads of a stream, ``[DONE]`` as the string."""
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as r:
        assert r.status == 200
        text = await r.text()
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_answers_carry_every_field_of_vllm_s_response_models(mock: Callable) -> None:
    url = await mock()
    v = _vllm()
    status, chat = await _post(
        url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3}
    )
    assert status == 200
    parsed = _as_vllm_sends(v["chat"].ChatCompletionResponse, chat)
    assert parsed.choices[0].logprobs is None and parsed.choices[0].stop_reason is None
    details = parsed.usage.prompt_tokens_details
    assert details.cached_tokens == 0 and details.created_cache_tokens is not None
    assert parsed.usage.completion_tokens == 3
    status, cmpl = await _post(
        url, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    )
    assert status == 200
    parsed = _as_vllm_sends(v["completion"].CompletionResponse, cmpl)
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/models") as r:
        listed = _as_vllm_sends(v["engine"].ModelList, await r.json())
    assert listed.data[0].id == MODEL and listed.data[0].max_model_len == 1_048_576
    assert listed.data[0].owned_by == "vllm"  # a client telling engines apart sees vLLM


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_streams_as_vllm_sends_them(mock: Callable, chat: bool) -> None:
    url = await mock()
    v = _vllm()
    path, body, model = (
        ("/v1/chat/completions", {"messages": CHAT}, v["chat"].ChatCompletionStreamResponse)
        if chat
        else ("/v1/completions", {"prompt": "hi there"}, v["completion"].CompletionStreamResponse)
    )
    body |= {"model": MODEL, "max_tokens": 5, "stream": True}
    # continuous_usage_stats: every chunk carries the usage so far (vLLM's should_include_usage)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = await _events(url, path, body | {"stream_options": opts})
    assert events[-1] == "[DONE]"
    chunks = [model.model_validate(e) for e in events[:-1]]
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1])
    if chat:
        assert deltas[0].choices[0].delta.role == "assistant"
    counts = [c.usage.completion_tokens for c in deltas]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 0
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in deltas
    )
    # the keys vLLM sends in every chunk's choice (set explicitly: exclude_unset keeps them)
    keys = (
        {"index", "delta", "logprobs", "finish_reason"}
        if chat
        else {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    )
    for e in events[:-2]:
        assert keys <= e["choices"][0].keys(), e
    # without continuous_usage_stats only the last chunk has usage
    events = await _events(url, path, body | {"stream_options": {"include_usage": True}})
    assert [e.get("usage") is not None for e in events[:-1]][-2:] == [False, True]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_a_stream_opens_and_ends_its_choices_as_vllm_does(
    mock: Callable, chat: bool, n: int
) -> None:
    """vLLM 0.34's chat stream opens each choice with a chunk of its own, the role and
    empty content (``chat_completion_stream_generator``'s first iteration), and the output
    that finishes a choice is one chunk: its last tokens with the ``finish_reason``
    (``output.finish_reason`` set), on chat and completions. The mock put the role on the
    first token's chunk of a single choice and ended every choice with an extra chunk of
    no text, so a peer counting chunks or reading the role chunk saw another stream."""
    url = await mock()
    path, body = (
        ("/v1/chat/completions", {"messages": CHAT})
        if chat
        else ("/v1/completions", {"prompt": "hi there"})
    )
    body |= {"model": MODEL, "max_tokens": 3, "stream": True, "n": n}
    events = await _events(url, path, body)
    assert events[-1] == "[DONE]"
    by_choice: dict[int, list[dict[str, Any]]] = {}
    for e in events[:-1]:
        (choice,) = e["choices"]
        by_choice.setdefault(choice["index"], []).append(choice)
    assert sorted(by_choice) == list(range(n))
    for choices in by_choice.values():
        texts = [c["delta"].get("content") if chat else c["text"] for c in choices]
        if chat:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            assert all("role" not in c["delta"] for c in choices[1:])
            texts = texts[1:]
        assert all(texts), texts  # every later chunk carries output, the last one too
        assert [c["finish_reason"] for c in choices][-2:] == [None, "length"]
        assert choices[-1]["stop_reason"] is None
        assert "".join(texts).count("tok") == 3


async def test_stream_options_without_stream_is_refused_as_vllm_refuses_it(
    mock: Callable,
) -> None:
    url = await mock()
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        body |= {"model": MODEL, "max_tokens": 1, "stream_options": {"include_usage": True}}
        status, err = await _post(url, path, body)
        assert status == 400, err
        assert "Stream options can only be defined when `stream=True`." in err["error"]["message"]


async def test_error_bodies_and_statuses_are_vllm_s(mock: Callable) -> None:
    url = await mock()
    v = _vllm()
    cases = [
        # vLLM's _check_model: 404 NotFoundError naming the served model
        ("/v1/completions", {"model": "other", "prompt": [1, 2]}, 404, "NotFoundError"),
        ("/v1/chat/completions", {"model": "other", "messages": CHAT}, 404, "NotFoundError"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "BadRequestError"),
        # a batch mixing strings and token ids (vLLM's request model refuses it too)
        ("/v1/completions", {"model": MODEL, "prompt": ["ab", [1, 2]]}, 400, "BadRequestError"),
        ("/tokenize", {"model": MODEL, "prompt": "x" * 40}, 200, None),
    ]
    for path, body, status, kind in cases:
        got, answer = await _post(url, path, body)
        assert got == status, (path, body, answer)
        if kind is None:
            continue
        err = _as_vllm_sends(v["engine"].ErrorResponse, answer).error
        assert (err.type, err.code) == (kind, status), answer
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.completions.create(model="other", prompt=[1, 2], max_tokens=1)
    finally:
        await client.close()


async def test_context_length_is_vllm_s(mock: Callable) -> None:
    url = await mock(max_model_len=64)
    status, err = await _post(
        url, "/v1/completions", {"model": MODEL, "prompt": list(range(1, 80)), "max_tokens": 1}
    )
    assert status == 400 and "maximum context length is 64 tokens" in err["error"]["message"]
    # the output is cut where the context ends (vLLM's get_max_tokens)
    status, ok = await _post(
        url, "/v1/completions", {"model": MODEL, "prompt": list(range(1, 61)), "max_tokens": 10}
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 4
    assert ok["choices"][0]["finish_reason"] == "length"
    # completions have no max_completion_tokens field: vLLM ignores it (16 by default)
    status, ok = await _post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2], "max_completion_tokens": 3},
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 16
    # chat: max_completion_tokens wins over max_tokens, an explicit null defers to it
    for extra, want in (
        ({"max_completion_tokens": 2, "max_tokens": 5}, 2),
        ({"max_completion_tokens": None, "max_tokens": 3}, 3),
    ):
        status, ok = await _post(
            url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT} | extra
        )
        assert status == 200 and ok["usage"]["completion_tokens"] == want, extra


async def test_an_output_budget_beyond_the_context_is_refused_as_vllm_refuses_it(
    mock: Callable,
) -> None:
    """vLLM's ``TokenizeParams`` refuses ``max_tokens`` (chat: ``max_completion_tokens``
    first) above ``max_model_len`` with a 400 before the prompt is read; below it the
    output is cut where the context ends. The mock cut every budget silently (a 200)."""
    url = await mock(max_model_len=64)
    params = anthropic_ref.load()["vllm.renderers.params"].TokenizeParams
    cases = [
        ("/v1/completions", {"prompt": [1, 2]}, "max_tokens", 65),
        ("/v1/chat/completions", {"messages": CHAT}, "max_tokens", 100),
        ("/v1/chat/completions", {"messages": CHAT}, "max_completion_tokens", 65),
    ]
    for path, body, field, value in cases:
        with pytest.raises(ValueError) as vllm_refusal:
            params(
                max_total_tokens=64,
                max_output_tokens=value,
                max_total_tokens_param="max_model_len",
                max_output_tokens_param=field,
            )
        status, err = await _post(url, path, body | {"model": MODEL, field: value})
        assert status == 400, (path, field, err)
        assert err["error"]["message"] == vllm_refusal.value.args[0]
        assert err["error"]["type"] == "BadRequestError"
    # at the limit it is served, cut where the context ends
    status, ok = await _post(
        url, "/v1/completions", {"model": MODEL, "prompt": [1, 2], "max_tokens": 64}
    )
    assert status == 200 and ok["usage"]["completion_tokens"] == 62


async def test_logprobs_are_answered_as_vllm_answers_them(mock: Callable) -> None:
    url = await mock()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:
        chat = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=1
        )
        content = chat.choices[0].logprobs.content
        assert "".join(c.token for c in content) == chat.choices[0].message.content
        assert len(content) == 3 and all(c.top_logprobs[0].token == c.token for c in content)
        cmpl = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=1)
        lp = cmpl.choices[0].logprobs
        assert "".join(lp.tokens) == cmpl.choices[0].text and len(lp.token_logprobs) == 3
        assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
        stream = await client.completions.create(
            model=MODEL, prompt="hi", max_tokens=4, logprobs=1, stream=True
        )
        tokens, offsets = [], []
        async for c in stream:
            if c.choices and c.choices[0].logprobs is not None:
                tokens += c.choices[0].logprobs.tokens
                offsets += c.choices[0].logprobs.text_offset
        assert len(tokens) == 4 and offsets == [sum(map(len, tokens[:i])) for i in range(4)]
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, logprobs=True, stream=True
        )
        n = 0
        async for c in stream:
            if c.choices and c.choices[0].logprobs is not None:
                n += len(c.choices[0].logprobs.content or [])
        assert n == 4
    finally:
        await client.close()


async def test_the_openai_client_parses_every_answer(mock: Callable) -> None:
    url = await mock()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:
        listed = await client.models.list()
        assert [m.id for m in listed.data] == [MODEL]
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert chat.choices[0].message.role == "assistant" and chat.usage.total_tokens > 2
        cmpl = await client.completions.create(model=MODEL, prompt=[[1, 2]], max_tokens=2)
        assert len(cmpl.choices) == 1 and cmpl.choices[0].text
        # a batch is answered with a choice per prompt, as vLLM answers it
        for batch in ([[1, 2], [3, 4]], ["ab", "cd"]):
            answer = await client.completions.create(model=MODEL, prompt=batch, max_tokens=2)
            assert [c.index for c in answer.choices] == [0, 1]
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
        usage = [c.usage.completion_tokens async for c in stream if c.usage is not None]
        assert usage[-1] == 3
    finally:
        await client.close()
    async with aiohttp.ClientSession() as http:
        for path in ("/health", "/ping"):
            async with http.get(url + path) as r:
                assert r.status == 200, path
        async with http.get(f"{url}/version") as r:
            assert r.status == 200 and (await r.json()) == {"version": "0.34.0"}
        async with http.post(
            f"{url}/tokenize", json={"prompt": "ab", "return_token_strs": True}
        ) as r:
            tok = await r.json()
        assert set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
        assert "".join(tok["token_strs"]) == "ab"


async def test_the_answer_id_is_vllm_s_from_x_request_id_or_request_id(mock: Callable) -> None:
    """vLLM names an answer ``chatcmpl-`` / ``cmpl-`` + the ``X-Request-Id`` header, else the
    body's ``request_id`` (``_base_request_id``); its Anthropic answer carries the chat id,
    the Responses API the body's ``request_id``. Peers (vllm-router's P/D legs) send the
    header; a client reusing one id for concurrent requests still gets every answer."""
    import asyncio

    url = await mock()
    hdr = {"X-Request-Id": "rid-1"}
    cases = [
        ("/v1/chat/completions", {"messages": CHAT}, hdr, "chatcmpl-rid-1"),
        ("/v1/completions", {"prompt": "hi"}, hdr, "cmpl-rid-1"),
        ("/v1/chat/completions", {"messages": CHAT, "request_id": "body-2"}, {}, "chatcmpl-body-2"),
        ("/v1/completions", {"prompt": "hi", "request_id": "body-2"}, hdr, "cmpl-rid-1"),
        ("/v1/messages", {"messages": CHAT}, hdr, "chatcmpl-rid-1"),
        ("/v1/responses", {"input": "hi", "request_id": "resp_given"}, hdr, "resp_given"),
    ]
    async with aiohttp.ClientSession() as http:
        for path, body, headers, want in cases:
            body = body | {"model": MODEL, "max_tokens": 2}
            async with http.post(url + path, json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["id"] == want, (path, body, headers)
        stream = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
        async with http.post(url + "/v1/completions", json=stream, headers=hdr) as r:
            text = await r.text()
        ids = {json.loads(b[6:])["id"] for b in text.split("\n\n") if b[6:7] == "{"}
        assert ids == {"cmpl-rid-1"}

        async def one() -> int:
            body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
            async with http.post(url + "/v1/chat/completions", json=body, headers=hdr) as r:
                assert r.status == 200
                return int((await r.json())["usage"]["completion_tokens"])

        assert await asyncio.wait_for(asyncio.gather(one(), one(), one()), 30) == [4, 4, 4]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": "hello there"}),
        ("/v1/messages", {"messages": CHAT}),
        ("/v1/responses", {"input": "hello there"}),
    ],
    ids=["chat", "completion", "messages", "responses"],
)
async def test_a_prefill_leg_answers_kv_transfer_params_on_every_api(
    mock: Callable, path: str, body: dict[str, Any]
) -> None:
    """vLLM's Anthropic and Responses answers carry the prefill's ``kv_transfer_params`` as
    its chat answer does (``messages_full_converter``, ``ResponsesResponse``): a P/D proxy
    (vllm-router routes /v1/messages through its P/D pipeline) hands them to the decode
    leg. The mock's left them out: the decode leg ran without them ("No kv_transfer_params
    for prefill"), prefilling locally."""
    url = await mock()
    leg = {"do_remote_decode": True, "do_remote_prefill": False}
    body = body | {"model": MODEL, "max_tokens": 1, "kv_transfer_params": leg}
    status, answer = await _post(url, path, body)
    assert status == 200, answer
    params = answer.get("kv_transfer_params")
    assert params is not None and params["do_remote_prefill"] is True, answer
    assert params["remote_num_tokens"] > 0 and params["remote_block_ids"][0]
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        page = await r.text()
    assert 'kvrouter_mock_pd_prefill_legs_total{engine="0",model_name="m"} 1.0' in page
    # a request that is no prefill leg: vLLM's Responses answer has the field, null
    status, plain = await _post(url, path, {k: v for k, v in body.items() if k[0] != "k"})
    assert status == 200 and plain.get("kv_transfer_params") is None


# the metric families vLLM 0.34 registers (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
# that the mock serves
VLLM_034_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_time_per_output_token_seconds",
}


async def test_metrics_are_families_vllm_serves(mock: Callable) -> None:
    """Every ``vllm:`` family on the mock's ``/metrics`` is one vLLM 0.34 registers, so a
    scraper that falls back to an older name (``vllm:gpu_cache_usage_perc``, gone since
    0.16) is not fed by the mock where vLLM would leave it without."""
    from prometheus_client.parser import text_string_to_metric_families

    url = await mock()
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as r:
        page = await r.text()
    served = {f.name for f in text_string_to_metric_families(page)}
    vllm_names = {n.removesuffix("_total") for n in served if n.startswith("vllm:")}
    assert vllm_names <= VLLM_034_FAMILIES, vllm_names - VLLM_034_FAMILIES
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= vllm_names
