"""Models rendered by the engine (router/service/render.py): the router hashes the token ids
the replicas' render endpoints answer, so its predictions match the engine's cache for a
model whose template it cannot reproduce (here: no tokenizer at all); a refused request
keeps the engine's message; an unreachable renderer degrades routing, never requests. Real
mock replicas (render endpoints, ZMQ events), real HTTP, the official openai client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import openai
import pytest
from aiohttp import web

from router.core.errors import ConfigError
from router.core.hashing import MmItem, hash_prompt, mm_block_extras, root_hash
from router.mock.server import MockSettings
from router.service.app import STATE
from router.service.config import build_settings
from router.service.render_answer import RenderFailed, parse_rendered
from router.tokenize.pipeline import PromptProcessor
from tests.backends import kimi_model_table, metric_sample, start_mock, start_router
from tests.benches import bench_json, bench_refused
from tests.ports import free_port
from tests.waiting import eventually

B = 16


async def _fleet(n: int, runners: list[web.AppRunner], **mock: Any) -> list[dict[str, Any]]:
    """``n`` mock replicas of model "m" publishing KV events over ZMQ, as router replica
    tables."""
    replicas = []
    for i in range(n):
        zmq, replay = free_port(), free_port()
        settings = MockSettings(
            model="m", replica=f"r{i}", block_size=B, engine_block_size=B,
            zmq_endpoint=f"tcp://127.0.0.1:{zmq}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
            **mock,
        )  # fmt: skip
        runner, base = await start_mock(settings)
        runners.append(runner)
        replicas.append(
            {"url": base, "model": "m", "name": f"r{i}", "zmq": settings.zmq_endpoint,
             "zmq_replay": settings.replay_endpoint}
        )  # fmt: skip
    return replicas


def _chat(turns: int) -> list[Any]:
    messages = [{"role": "system", "content": "You are terse. " * 40}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"question {i}: " + "why? " * 30})
        messages.append({"role": "assistant", "content": f"answer {i}"})
    return messages


async def _render_server(handler: Any) -> tuple[web.AppRunner, str]:
    """A stand-in render endpoint (both paths) on loopback: (runner, base URL)."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions/render", handler)
    app.router.add_post("/v1/completions/render", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _renderer(session: Any, base: str, clock: Any = None, timeout: float = 5.0) -> Any:
    from prometheus_client import CollectorRegistry

    from router.service.loop_metrics import LoopCounter
    from router.service.render import EngineRenderer
    from router.service.settings import ModelSettings

    counter = LoopCounter("r", "", ["model", "outcome"], registry=CollectorRegistry())
    model = ModelSettings(name="m", render="engine", render_url=base, render_timeout_s=timeout)
    extra = {} if clock is None else {"clock": clock}
    return EngineRenderer({"m": model}, lambda _: [], counter, session, **extra), counter


async def test_engine_rendered_prompts_predict_the_engines_cache() -> None:
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(2, runners)
        # no tokenizer: on its own the router could only approximate this model's prompts
        model = {"block_size": B, "policy": "ours", "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {"m": model}})
        )
        runners.append(router)
        state = router.app[STATE]
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        first = await client.chat.completions.create(model="m", messages=_chat(2), max_tokens=2)
        decided = state.recent_decisions(1)[0]
        assert first.usage is not None and first.usage.prompt_tokens == decided["prompt_tokens"]
        cached = first.usage.prompt_tokens // B
        await eventually(lambda: state.index.stats().kv_entries >= cached)
        second = await client.chat.completions.create(model="m", messages=_chat(3), max_tokens=2)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        engine_hit = second.usage.prompt_tokens_details.cached_tokens
        last = state.recent_decisions(1)[0]
        assert engine_hit and engine_hit >= B * (cached - 1)
        assert last["usable_tokens"] == engine_hit and last["replica"] == decided["replica"]
        page = state.metrics.render().decode()
        assert metric_sample(page, "kvrouter_render_requests_total", model="m", outcome="ok") == 2
        assert not metric_sample(page, "kvrouter_approximate_requests_total", model="m")
        assert metric_sample(page, "kvrouter_tokenizer_mode", model="m", mode="engine") == 1
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_a_request_the_engine_refuses_gets_its_message() -> None:
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(1, runners, max_model_len=300)
        model = {"block_size": B, "render": "engine"}
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {"m": model}})
        )
        runners.append(router)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="more than max_model_len 300"):
            await client.chat.completions.create(model="m", messages=_chat(4), max_tokens=2)
        page = router.app[STATE].metrics.render().decode()
        assert metric_sample(page, "kvrouter_render_requests_total", outcome="refused") == 1
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


async def test_an_unreachable_renderer_falls_back_and_the_request_is_served() -> None:
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(1, runners)
        model = {
            "block_size": B,
            "render": "engine",
            "render_url": f"http://127.0.0.1:{free_port()}",  # nothing listens there
            "render_timeout_s": 2.0,
        }
        router, url = await start_router(
            build_settings({"replicas": replicas, "models": {"m": model}})
        )
        runners.append(router)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for _ in range(2):  # the fallback is not memoised: the same body asks again
            done = await client.chat.completions.create(model="m", messages=_chat(1), max_tokens=2)
            assert done.choices[0].finish_reason is not None
        page = router.app[STATE].metrics.render().decode()
        assert metric_sample(page, "kvrouter_render_requests_total", outcome="fallback") == 2
        assert metric_sample(page, "kvrouter_approximate_requests_total", model="m") == 2
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


def test_render_answers_are_read_as_vllm_writes_them() -> None:
    chat = {
        "token_ids": [1, 2, 3],
        "features": {
            "mm_hashes": {"image": ["b", "a"], "audio": ["c"]},
            "mm_placeholders": {
                "image": [{"offset": 9, "length": 4}, {"offset": 1, "length": 2}],
                "audio": [{"offset": 5, "length": 1}],
            },
            "kwargs_data": None,
        },
    }
    [(ids, items)] = parse_rendered("chat", chat)
    assert ids.dtype == np.uint32 and ids.tolist() == [1, 2, 3]
    assert items == [MmItem(1, "a"), MmItem(5, "c"), MmItem(9, "b")]
    batch = parse_rendered(
        "completion", [{"token_ids": [4]}, {"token_ids": [5, 6], "features": None}]
    )
    assert [i.tolist() for i, _ in batch] == [[4], [5, 6]]
    for bad in (
        {"token_ids": "x"},
        {"token_ids": [-1]},
        {"token_ids": [1], "features": {"mm_hashes": {"image": ["a"]}, "mm_placeholders": {}}},
        {
            "token_ids": [1],
            "features": {
                "mm_hashes": {"image": ["a"]},
                "mm_placeholders": {"image": [{"offset": -2}]},
            },
        },
    ):
        with pytest.raises(RenderFailed):
            parse_rendered("chat", bad)
    with pytest.raises(RenderFailed):
        parse_rendered("completion", chat)  # a completion answer is a list


def test_rendered_prompts_hash_with_the_request_root_and_image_keys() -> None:
    proc = PromptProcessor("m", B)
    ids = np.arange(1, 50, dtype=np.uint32)
    items = [MmItem(20, "img")]
    got = proc.engine_rendered([(ids, items)], {"cache_salt": "s"}, 0.01)
    root = root_hash("m", "s")
    assert got.exact and got.prompt_tokens == 49
    assert got.block_hashes == hash_prompt(ids, B, root, extras=mm_block_extras(items, B)).hashes
    assert got.block_hashes[0] == hash_prompt(ids, B, root).hashes[0]  # blocks before the image
    assert got.block_hashes[1] != hash_prompt(ids, B, root).hashes[1]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"render": "remote"}, "render"),
        ({"render": "engine", "render_url": "ftp://x"}, "render_url"),
        ({"render": "engine", "render_timeout_s": 0}, "render_timeout_s"),
    ],
)
def test_render_settings_are_checked(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_settings({"models": {"m": extra}})


def test_the_render_bench_runs_and_the_engine_renders_as_the_router() -> None:
    # the bench exits with an error when the engine's render and the router's differ
    out = bench_json("render", "--tokens", "3000", "--reps", "1")
    assert out["bench"] == "render" and out["prompt_tokens"] >= 3000
    assert out["engine_ms"] > 0 and out["answer_mb"] > 0


def test_the_render_bench_refuses_zero_rounds() -> None:
    # a median of no rounds has no figures (it failed reading one it never took)
    assert bench_refused("render", "--reps", "0").endswith("argument --reps: must be >= 1, got 0")


async def test_a_target_that_failed_rests_before_it_is_asked_again() -> None:
    """A hung renderer costs the request that finds it its timeout; later requests skip it
    (falling back at once, or going to another target) until its cooldown ends."""
    import aiohttp

    from router.service.render import COOLDOWN_S

    calls: list[str] = []
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        calls.append(request.path)
        await release.wait()
        return web.json_response({"token_ids": [1]})

    runner, base = await _render_server(hang)
    now = [100.0]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, counter = _renderer(session, base, lambda: now[0], timeout=0.2)
            assert await r.prompt("m", "chat", body, proc) is None  # waited its timeout
            assert await r.prompt("m", "chat", body, proc) is None  # resting: not asked
            assert len(calls) == 1
            now[0] += COOLDOWN_S + 0.1
            release.set()
            got = await r.prompt("m", "chat", body, proc)
            assert got is not None and got.prompt_tokens == 1 and len(calls) == 2
    finally:
        release.set()
        await runner.cleanup()
    assert counter.labels("m", "fallback").value == 2


async def test_a_long_prompts_answer_is_decoded_off_the_loop_and_hashed_alike() -> None:
    import aiohttp

    from router.service.render import THREAD_MIN_BYTES

    ids = list(range(100_000, 160_000))
    answer = json.dumps({"token_ids": ids, "features": None}).encode()
    assert len(answer) >= THREAD_MIN_BYTES

    async def render(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    runner, base = await _render_server(render)
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, _ = _renderer(session, base)
            got = await r.prompt("m", "chat", {"messages": []}, proc)
    finally:
        await runner.cleanup()
    assert got is not None and got.prompt_tokens == len(ids)
    assert got.block_hashes == hash_prompt(np.array(ids, dtype=np.uint32), B, root_hash("m")).hashes


async def test_requests_waiting_on_a_target_stop_when_another_finds_it_failing() -> None:
    import aiohttp

    calls: list[int] = []
    never = asyncio.Event()

    async def flaky(request: web.Request) -> web.Response:
        calls.append(len(calls))
        if len(calls) == 1:
            await never.wait()  # the first request hangs
        return web.json_response({"error": {"message": "down"}}, status=503)

    runner, base = await _render_server(flaky)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "ho"}]}  # not shared
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            # a timeout far longer than the test: the hung request ends only because the
            # other one found the target failing
            r, counter = _renderer(session, base, timeout=600)
            hung = asyncio.ensure_future(r.prompt("m", "chat", body, proc))
            await eventually(lambda: len(calls) == 1)
            assert await r.prompt("m", "chat", other, proc) is None  # a 503: the target rests
            assert await asyncio.wait_for(hung, 30) is None
            assert len(calls) == 2
            assert await r.prompt("m", "chat", body, proc) is None  # resting: not asked
            assert len(calls) == 2
    finally:
        never.set()
        await runner.cleanup()
    assert counter.labels("m", "fallback").value == 3


async def test_what_moves_on_without_resting_and_what_is_not_sent() -> None:
    """A 404 for the model (the target serves it under another name) and an unreadable
    answer fall back without resting the target; bodies the render endpoints refuse though
    the replica serves them (beam search, prompt embeddings) are not sent."""
    import aiohttp

    answers = [
        web.json_response(
            {"error": {"message": "The model `m` does not exist.", "type": "NotFoundError",
                       "param": "model", "code": 404}},
            status=404,
        ),
        web.Response(body=b"{not json", content_type="application/json"),
        web.json_response({"token_ids": [7, 8]}),
    ]  # fmt: skip
    calls: list[str] = []

    async def render(request: web.Request) -> web.Response:
        calls.append(request.path)
        return answers[len(calls) - 1]

    runner, base = await _render_server(render)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, counter = _renderer(session, base)
            assert await r.prompt("m", "chat", chat, proc) is None
            assert await r.prompt("m", "chat", chat, proc) is None
            beam = {**chat, "use_beam_search": True}
            assert await r.prompt("m", "chat", beam, proc) is None
            embeds = {"model": "m", "prompt": "", "prompt_embeds": "AAAA"}
            assert await r.prompt("m", "completion", embeds, proc) is None
            got = await r.prompt("m", "chat", chat, proc)
            assert got is not None and got.prompt_tokens == 2
    finally:
        await runner.cleanup()
    assert len(calls) == 3  # the refused shapes never reached it; nothing rested it
    assert counter.labels("m", "fallback").value == 4


async def test_a_fallback_of_a_template_the_router_cannot_render_is_served(
    tmp_path: Any,
) -> None:
    """The renderers down, the router's own template refuses the conversation: the request
    is routed on load and served, not refused (the engine renders it its own way)."""
    runners: list[web.AppRunner] = []
    try:
        replicas = await _fleet(1, runners)
        template = tmp_path / "t.jinja"
        template.write_text("{{ raise_exception('only the engine renders this model') }}")
        model = kimi_model_table(
            chat_template=str(template),
            render="engine",
            render_url=f"http://127.0.0.1:{free_port()}",
        )
        settings = build_settings({"replicas": replicas, "models": {"m": model}})
        router, url = await start_router(settings)
        runners.append(router)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        done = await client.chat.completions.create(model="m", messages=_chat(1), max_tokens=2)
        assert done.choices[0].finish_reason is not None
        decided = router.app[STATE].recent_decisions(1)[0]
        assert decided["usable_tokens"] == 0
        await client.close()
    finally:
        for runner in runners:
            await runner.cleanup()


def test_a_rendered_batchs_round_trip_counts_once() -> None:
    proc = PromptProcessor("m", B)
    prompts = [(np.arange(1, 40, dtype=np.uint32), []) for _ in range(3)]
    got = proc.engine_rendered(prompts, {}, 0.2)
    assert got.prompt_tokens == 3 * 39 and got.tokenize_s == pytest.approx(0.2)


async def test_an_answer_nested_too_deep_or_not_text_moves_on() -> None:
    """A render answer nested past what a parser follows, or with a multimodal item hash
    that is not text, is unreadable as any other: the router's own processing stands in
    (no error escapes to fail the request with a 500)."""
    import aiohttp

    deep = b"[" * 100_000 + b"]" * 100_000
    surrogate = (
        b'{"token_ids": [1, 2, 3], "features": {"mm_hashes": {"image": ["\\ud800"]}, '
        b'"mm_placeholders": {"image": [{"offset": 0, "length": 1}]}}}'
    )
    answers = [deep, surrogate]
    calls: list[str] = []

    async def render(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.Response(body=answers[len(calls) - 1], content_type="application/json")

    runner, base = await _render_server(render)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, counter = _renderer(session, base)
            assert await r.prompt("m", "chat", chat, proc) is None
            assert await r.prompt("m", "chat", chat, proc) is None
    finally:
        await runner.cleanup()
    assert len(calls) == 2
    assert counter.labels("m", "fallback").value == 2


async def test_an_error_answer_nested_too_deep_is_read_as_text() -> None:
    """A render target's error answer (a refusal, a 5xx, a 404) nested past what a parser
    follows: its message is read as text, as a body that is no JSON is; the parser's
    ``RecursionError`` escaped instead, and the request failed with a 500 (a refusal lost
    its 400; a failing target neither rested nor let the router's own rendering stand in)."""
    import aiohttp

    from router.core.errors import BadRequest

    deep = b"[" * 100_000 + b"]" * 100_000
    statuses = [400, 500]
    calls: list[str] = []

    async def render(request: web.Request) -> web.Response:
        calls.append(request.path)
        status = statuses[len(calls) - 1]
        return web.Response(body=deep, status=status, content_type="application/json")

    runner, base = await _render_server(render)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, _ = _renderer(session, base)
            with pytest.raises(BadRequest, match=r"^\[\[\["):
                await r.prompt("m", "chat", chat, proc)
            assert await r.prompt("m", "chat", chat, proc) is None  # 500: rests
            assert await r.prompt("m", "chat", chat, proc) is None  # (resting: not asked)
    finally:
        await runner.cleanup()
    assert len(calls) == 2


async def test_identical_requests_rendering_at_once_share_one_render() -> None:
    """Parallel sampling sent as separate requests arrives at once, before the body memo
    holds the first: one render answers them all; another body renders on its own."""
    import aiohttp

    calls: list[bytes] = []

    async def render(request: web.Request) -> web.Response:
        calls.append(await request.read())
        return web.json_response({"token_ids": list(range(1, 40))})

    runner, base = await _render_server(render)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    other = {"model": "m", "messages": [{"role": "user", "content": "ho"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, counter = _renderer(session, base)
            got = await asyncio.gather(
                *(r.prompt("m", "chat", dict(chat), proc) for _ in range(5)),
                r.prompt("m", "chat", other, proc),
            )
    finally:
        await runner.cleanup()
    assert all(p is not None and p.prompt_tokens == 39 for p in got)
    assert len(calls) == 2
    assert counter.labels("m", "ok").value == 6


async def test_a_target_refusing_the_routers_credentials_rests() -> None:
    """A 401 / 403 is the target's setup (``render_api_key`` missing or wrong), the same
    for every request: the target rests as a failing one does, and later requests fall
    back at once instead of paying the round trip each."""
    import aiohttp

    calls: list[str | None] = []

    async def render(request: web.Request) -> web.Response:
        calls.append(request.headers.get("Authorization"))
        return web.json_response({"error": {"message": "Unauthorized"}}, status=401)

    runner, base = await _render_server(render)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    proc = PromptProcessor("m", B)
    try:
        async with aiohttp.ClientSession() as session:
            r, counter = _renderer(session, base)
            assert await r.prompt("m", "chat", chat, proc) is None
            assert await r.prompt("m", "chat", chat, proc) is None  # resting: not asked
    finally:
        await runner.cleanup()
    assert calls == [None]
    assert counter.labels("m", "fallback").value == 2
