"""``kvrouter_prediction_error_tokens`` / ``_ratio`` judge the router's predicted hit against
the engine's cached tokens only when those are the cached tokens of the prompt it predicted:
one sequence of one prompt. With ``n`` > 1 samples vLLM's usage holds one sequence's
(``num_cached_tokens`` of the child request that completed the answer), and the children
after the first reuse the blocks the first one just computed, so a cold prompt reports
nearly all of itself cached; with a batch of completion prompts it is one prompt's. Real
mock replicas (vLLM 0.34's answers, router/mock/multi.py) behind a real router over HTTP,
and gRPC Pick / Report on loopback."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from router.rpc.gen import router_pb2, router_pb2_grpc
from router.service.config import build_settings
from tests.backends import metric_sample, start_mock_fleet, start_router
from tests.test_grpc_parity import AUTH, _serve, _state
from tests.test_grpc_parity import MODEL as RPC_MODEL

B = 16
MODEL = "m"


@pytest.fixture
async def router() -> AsyncIterator[str]:
    """A router in front of one mock replica (every request lands there), exact mode."""
    runners: list[Any] = []
    try:
        replicas = await start_mock_fleet(1, runners, model=MODEL, block_size=B)
        settings = build_settings({"replicas": replicas, "models": {MODEL: {"block_size": B}}})
        running, url = await start_router(settings)
        runners.append(running)
        yield url
    finally:
        for r in reversed(runners):
            await r.cleanup()


def _prompt(seed: int, n: int = 10 * B + 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


async def _send(url: str, body: dict[str, Any]) -> tuple[int, str]:
    """(the engine's cached tokens, the /metrics page after the answer)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        async with http.get(url + "/metrics") as r:
            page = await r.text()
    return int(usage["prompt_tokens_details"]["cached_tokens"]), page


def _judged(page: str) -> float:
    got = metric_sample(page, "kvrouter_prediction_error_tokens_count", model=MODEL)
    ratio = metric_sample(page, "kvrouter_prediction_error_ratio_count", model=MODEL)
    assert got == ratio
    return got or 0.0


async def test_one_sequence_of_a_cold_prompt_is_judged(router: str) -> None:
    """The baseline: a single sequence's cached tokens are the prompt's, and are judged."""
    cached, page = await _send(router, {"model": MODEL, "prompt": _prompt(1), "max_tokens": 2})
    assert cached == 0
    assert _judged(page) == 1
    assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == 0


async def test_several_samples_of_a_prompt_are_not_judged(router: str) -> None:
    """``n`` = 2 of a prompt no replica holds: the router rightly predicts no hit, the engine
    reports the second sample's hit on the first's blocks. Judged, every such request would
    read as an under-prediction of nearly its whole prompt."""
    body = {"model": MODEL, "prompt": _prompt(2), "max_tokens": 2, "n": 2}
    cached, page = await _send(router, body)
    assert cached > 0  # the sibling's hit (vLLM's parallel sampling), not the router's to predict
    assert _judged(page) == 0
    # what the engine reported still counts (its hit rate)
    assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=MODEL) == cached


@pytest.fixture
async def rpc() -> AsyncIterator[tuple[Any, router_pb2_grpc.RouterStub]]:
    state = _state()
    async for channel in _serve(state):
        yield state, router_pb2_grpc.RouterStub(channel)


@pytest.mark.parametrize(
    "extra",
    [{"n": 2}, {"prompt": [list(range(1000, 1320)), list(range(5000, 5100))]}],
    ids=["samples", "batch"],
)
async def test_a_picks_several_sequences_are_not_judged_over_grpc(
    rpc: Any, extra: dict[str, Any]
) -> None:
    """As over HTTP: a Report's cached tokens of a request of several sequences (``n`` > 1,
    a batch of completion prompts) are one sequence's, counted but not judged."""
    state, stub = rpc
    body = {"model": RPC_MODEL, "prompt": list(range(1000, 1320)), "max_tokens": 2, **extra}
    pick = router_pb2.PickRequest(model=RPC_MODEL, request_json=json.dumps(body))
    done = await stub.Pick(pick, metadata=AUTH)
    report = router_pb2.ReportRequest
    end = report(decision_id=done.decision_id, phase=report.COMPLETED, cached_tokens=304)
    assert (await stub.Report(end, metadata=AUTH)).accepted
    page = state.metrics.render().decode()
    assert metric_sample(page, "kvrouter_engine_cached_tokens_total", model=RPC_MODEL) == 304
    for name in ("kvrouter_prediction_error_tokens", "kvrouter_prediction_error_ratio"):
        assert not metric_sample(page, name + "_count", model=RPC_MODEL), name
