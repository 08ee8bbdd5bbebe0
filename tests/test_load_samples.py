"""Requests that decode several sequences (``n`` > 1, a batch of completion prompts) load
their replica's decode batch with every one of them: the load tracker counts each sequence
(LoadTracker.dispatch ``samples`` / ``prompts``), and the request handler reads ``n`` as
vLLM does. Before, such a request counted as one sequence, so its replica looked up to ``n``
times lighter than it was to the goodput policy."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest

from router.core.load import LoadTracker, decode_weight
from router.core.types import ReplicaKey
from router.service.app import STATE
from router.service.config import build_settings
from router.service.state import RouterState
from router.tokenize.request_fields import MAX_SAMPLES, sampled_sequences
from tests.backends import Backend, kimi_model_table, start_router
from tests.waiting import eventually

A = ReplicaKey("a")
MODEL = "kimi-test"


def test_each_sampled_sequence_is_counted_while_it_decodes() -> None:
    t = LoadTracker()
    t.dispatch("one", A, prompt_tokens=1000, cached_tokens=0, max_output_tokens=50)
    t.dispatch("n4", A, prompt_tokens=2000, cached_tokens=500, max_output_tokens=11, samples=4)
    v = t.view(A, 0.0)
    assert (v.prefilling, v.queued_prefill_tokens, v.decoding) == (2, 1000 + 1500, 0)
    assert v.decode_weight == pytest.approx(decode_weight(50) + 4 * decode_weight(11))
    t.first_token("n4")  # its prompt was prefilled once; its 4 sequences decode
    v = t.view(A, 0.0)
    assert (v.prefilling, v.queued_prefill_tokens, v.decoding) == (1, 1000, 4)
    assert v.decode_context_tokens == 4 * 2000
    cols = t.columns([A])  # the array mirror the columnar policies read agrees
    assert int(cols.decoding[0]) == 4 and int(cols.decode_context_tokens[0]) == 8000
    assert float(cols.decode_weight[0]) == pytest.approx(v.decode_weight)
    t.first_token("one")
    t.complete("n4")
    v = t.view(A, 0.0)
    assert (v.decoding, v.decode_context_tokens) == (1, 1000)
    assert v.decode_weight == pytest.approx(decode_weight(50))
    t.complete("one")
    v = t.view(A, 0.0)
    assert (v.in_flight, v.decoding, v.decode_context_tokens, v.decode_weight) == (0, 0, 0, 0.0)
    assert np.all(t.columns([A]).decoding == 0)


def test_a_batch_of_prompts_decodes_one_sequence_per_prompt_and_sample() -> None:
    t = LoadTracker()
    # 3 prompts of 300 tokens in all, 2 samples each
    t.dispatch("b", A, prompt_tokens=300, cached_tokens=0, samples=2, prompts=3)
    t.first_token("b")
    v = t.view(A, 0.0)
    assert (v.decoding, v.decode_context_tokens) == (6, 600)
    assert v.decode_weight == pytest.approx(6 * decode_weight(None))
    t.complete("b")
    assert t.view(A, 0.0).decoding == 0


@pytest.mark.parametrize(
    ("body", "kind", "samples"),
    [
        ({"n": 3}, "chat", 3),
        ({"n": "3"}, "completion", 3),  # vLLM's lax reading: "3" and 3.0 are 3
        ({"n": 3.0}, "chat", 3),
        ({"n": 1}, "chat", 1),
        ({}, "chat", 1),
        ({"n": 0}, "chat", 1),  # the engine refuses these itself
        ({"n": "many"}, "chat", 1),
        ({"n": True}, "chat", 1),
        ({"n": 10**9}, "chat", MAX_SAMPLES),  # the load view stays bounded
        ({"n": 3}, "messages", 1),  # no such field in the Messages / Responses APIs
        ({"n": 3}, "responses", 1),
    ],
)
def test_n_is_read_as_vllm_reads_it(body: dict[str, Any], kind: str, samples: int) -> None:
    assert sampled_sequences(body, kind) == samples


async def test_a_request_with_n_loads_its_replica_with_every_sequence() -> None:
    backend = await Backend("b0", [MODEL], chunks=3).start()
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": [{"url": backend.url, "model": MODEL, "name": backend.name}],
            "models": {MODEL: kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    state: RouterState = running.app[STATE]
    (key,) = [ep.key for ep in state.registry.endpoints()]
    http = aiohttp.ClientSession()

    def view() -> Any:
        return state.load.view(key, asyncio.get_running_loop().time())

    try:
        backend.gate = asyncio.Event()
        messages = [{"role": "user", "content": "sample this " * 30}]
        body = {"model": MODEL, "max_tokens": 5, "n": 3, "messages": messages}

        async def ask(path: str, payload: dict[str, Any]) -> int:
            async with http.post(url + path, json=payload) as r:
                await r.read()
                return r.status

        asked = asyncio.create_task(ask("/v1/chat/completions", body))
        await eventually(lambda: backend.received)
        assert view().in_flight == 1
        assert view().decode_weight == pytest.approx(3 * decode_weight(5))
        backend.gate.set()
        assert await asked == 200
        await eventually(lambda: view().in_flight == 0)
        assert view().decode_weight == 0.0

        # a streamed batch of 2 completion prompts, 2 samples each: 4 sequences decode
        backend.gate = asyncio.Event()
        backend.chunk_delay_s = 0.2
        prompt = ["first prompt " * 20, "second prompt " * 20]
        completion = {"model": MODEL, "max_tokens": 5, "n": 2, "prompt": prompt, "stream": True}
        asked = asyncio.create_task(ask("/v1/completions", completion))
        await eventually(lambda: len(backend.received) == 2)
        assert view().decode_weight == pytest.approx(4 * decode_weight(5))
        backend.gate.set()
        await eventually(lambda: view().decoding == 4)
        assert await asked == 200
        await eventually(lambda: view().in_flight == 0)
        assert (view().decoding, view().decode_context_tokens) == (0, 0)
    finally:
        await http.close()
        await running.cleanup()
        await backend.stop()
