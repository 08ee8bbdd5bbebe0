"""The /metrics page after real traffic through the router (official openai client, both HTTP
engines): stream timings, index gauges, decision phases, the engine-reported cached tokens of
a non-streamed body and of a stream's usage chunk (the SSE feedback path), and the
approximate-mode request counter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest

from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from tests.backends import Backend, kimi_model_table, start_router

MODEL = "kimi-test"
APPROX = "approx-model"
ENGINES = ["fast"]


@dataclass
class Fleet:
    url: str
    backend: Backend
    approx: Backend
    client: openai.AsyncOpenAI
    app: Any  # the running router's aiohttp application (its state, for white-box checks)

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


@pytest.fixture(params=ENGINES)
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    # one replica per model: the second request of a conversation finds the first one's
    # prompt in the backend's prefix cache, so it reports cached tokens
    backend = await Backend("b0", [MODEL]).start()
    backend.chunk_delay_s = 0.01  # stream chunks arrive apart: inter-token gaps to measure
    approx = await Backend("a0", [APPROX]).start()
    settings = build_settings(
        {
            "replicas": [
                {"url": backend.url, "model": MODEL, "name": "b0"},
                {"url": approx.url, "model": APPROX, "name": "a0"},
            ],
            "models": {MODEL: kimi_model_table(context_length=100_000)},
        }
    )
    runner, url = await start_router(settings, str(request.param))
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    try:
        yield Fleet(url, backend, approx, client, runner.app)
    finally:
        await client.close()
        await runner.cleanup()
        await backend.stop()
        await approx.stop()


def series(text: str, name: str) -> dict[str, float]:
    """label block (``{...}`` or ``""``) -> value, for the samples named exactly ``name``."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, brace, labels = head.partition("{")
        if metric == name:
            out[brace + labels] = float(value)
    return out


def value(text: str, name: str, labels: str) -> float:
    got = series(text, name)
    assert labels in got, (name, labels, got)
    return got[labels]


CONVERSATION = [
    {"role": "system", "content": "You are terse. " * 40},
    {"role": "user", "content": "Why is the sky blue? " * 30},
]


async def test_metrics_after_a_streamed_and_a_non_streamed_chat(fleet: Fleet) -> None:
    labels = f'{{model="{MODEL}"}}'
    resp = await fleet.client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_tokens=4
    )
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    first_cached = resp.usage.prompt_tokens_details.cached_tokens or 0
    text = await fleet.metrics()
    # the non-streamed body's usage is fed back once it went out
    before = value(text, "kvrouter_engine_cached_tokens_total", labels)
    assert before == first_cached

    stream = await fleet.client.chat.completions.create(
        model=MODEL,
        messages=CONVERSATION,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    pieces = 0
    async for chunk in stream:
        if chunk.choices:
            pieces += 1
        if chunk.usage is not None:
            usage = chunk.usage
    assert pieces == 4
    assert usage is not None and usage.prompt_tokens_details is not None
    stream_cached = usage.prompt_tokens_details.cached_tokens
    assert stream_cached and stream_cached > 0  # the same conversation, seen before

    # the stream's usage chunk (SSE feedback path) is counted, exactly once
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        text = await fleet.metrics()
        after = value(text, "kvrouter_engine_cached_tokens_total", labels)
        if after != before or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.05)
    assert after - before == stream_cached, (before, after, stream_cached)
    assert value(text, "kvrouter_prediction_error_tokens_count", labels) == 2
    # both answers reported their cached tokens: the hit rate's denominator counts both
    routed = value(text, "kvrouter_prompt_tokens_total", labels)
    assert value(text, "kvrouter_engine_cached_prompt_tokens_total", labels) == routed

    # stream timings at the router
    assert value(text, "kvrouter_ttft_seconds_count", labels) >= 1
    assert value(text, "kvrouter_ttft_seconds_sum", labels) > 0
    assert value(text, "kvrouter_itl_seconds_count", labels) >= 1
    assert value(text, "kvrouter_itl_seconds_sum", labels) > 0

    # index gauges: the dispatches left speculative entries
    entries = series(text, "kvrouter_index_entries")
    assert set(entries) == {'{kind="kv"}', '{kind="state"}', '{kind="speculative"}'}, entries
    assert entries['{kind="speculative"}'] > 0
    assert value(text, "kvrouter_index_replicas", "") == 2

    # one observation per phase per request; tokenizing and hashing took measurable time
    for phase in ("tokenize", "hash", "lookup", "score"):
        assert value(text, "kvrouter_decision_seconds_count", f'{{phase="{phase}"}}') == 2
        buckets = {
            k: v
            for k, v in series(text, "kvrouter_decision_seconds_bucket").items()
            if f'phase="{phase}"' in k
        }
        assert buckets and max(buckets.values()) == 2, (phase, buckets)
    assert value(text, "kvrouter_decision_seconds_sum", '{phase="tokenize"}') > 0
    assert value(text, "kvrouter_decision_seconds_sum", '{phase="hash"}') > 0

    ok = value(text, "kvrouter_requests_total", f'{{model="{MODEL}",outcome="ok",replica="b0"}}')
    assert ok == 2


async def test_approximate_requests_are_counted(fleet: Fleet) -> None:
    """A model without a tokenizer is routed in approximate mode: each request counts in
    ``kvrouter_approximate_requests_total``; exact-mode requests do not."""
    name = "kvrouter_approximate_requests_total"
    before = series(await fleet.metrics(), name).get(f'{{model="{APPROX}"}}', 0.0)
    await fleet.client.chat.completions.create(
        model=APPROX, messages=[{"role": "user", "content": "hello " * 300}]
    )
    await fleet.client.completions.create(model=APPROX, prompt="once upon a time " * 50)
    await fleet.client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=1)
    text = await fleet.metrics()
    got = series(text, name)
    assert got[f'{{model="{APPROX}"}}'] - before == 2, got
    assert got.get(f'{{model="{MODEL}"}}', 0.0) == 0, got
    assert value(text, "kvrouter_tokenizer_mode", f'{{mode="approximate",model="{APPROX}"}}') == 1
    assert len(fleet.approx.received) == 2


async def test_cache_turnover_gauges_follow_the_engines_evictions(fleet: Fleet) -> None:
    page = await fleet.metrics()
    labels = f'{{model="{MODEL}",replica="b0"}}'
    assert value(page, "kvrouter_cache_horizon_seconds", labels) == float("inf")
    assert value(page, "kvrouter_cache_eviction_risk", labels) == 0.0
    # the replica's engine reports 10 blocks a second removed out of 100 held, then the
    # router's meter samples it (as routing does every 5 s)
    state = fleet.app[STATE]
    key = next(k for k in state.load.replicas() if k.replica == "b0")
    assert isinstance(key, ReplicaKey)
    turnover = state.engines[MODEL].turnover
    held = list(range(1, 101))
    state.index.store(key, held)
    keys = (key,)
    for t in range(0, 600, 5):
        churn = list(range(10_000 + 50 * t, 10_050 + 50 * t))
        state.index.store(key, churn)
        state.index.remove(key, churn)
        turnover.sample(float(t), keys, state.index.evicted_blocks, lambda k: 100)
    page = await fleet.metrics()
    assert value(page, "kvrouter_cache_horizon_seconds", labels) == pytest.approx(10.0, rel=0.02)
    assert value(page, "kvrouter_cache_eviction_risk", labels) == 0.0  # it is the calmest


def _bounds(page: str, name: str) -> list[float]:
    """The finite ``le`` bounds of histogram ``name`` on a scraped page."""
    les = {k.split('le="', 1)[1].split('"', 1)[0] for k in series(page, name + "_bucket")}
    return sorted(float(le) for le in les if le != "+Inf")


async def test_the_ttft_buckets_reach_a_long_prompts_first_token(fleet: Fleet) -> None:
    """``kvrouter_ttft_seconds`` resolves the first tokens the router itself expects: a
    1M-token prompt's prefill on an idle replica (the default cost model), and the longest
    default SLO target of the most lenient service class. A TTFT past the last finite
    bucket only lands in ``+Inf``, where ``histogram_quantile`` reports that bucket's
    lower bound: every such p99 would read as the same number."""
    from router.core.admission import AdmissionSettings
    from router.core.load import CostModel
    from router.core.slo import DEFAULT_TIERS

    stream = await fleet.client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_tokens=2, stream=True
    )
    async for _ in stream:
        pass
    bounds = _bounds(await fleet.metrics(), "kvrouter_ttft_seconds")
    assert bounds, "no TTFT series after a stream"
    cost = CostModel()
    tokens = 1 << 20
    long_prompt = cost.prefill_s(tokens) + cost.steps_for(tokens) * cost.step_overhead_s
    lenient = max(t.ttft_s for t in DEFAULT_TIERS) * max(AdmissionSettings().ttft_factor)
    assert bounds[-1] >= max(long_prompt, lenient), (bounds, long_prompt, lenient)
