"""A non-streamed answer in the service's ``kvrouter_slo_requests_total``: judged as the
simulator and the live replay judge it (router.core.slo ``answered_as(streamed=False)``),
its E2E as the router saw it against its tier's TTFT target, its TPOT not judged. An
error answer and a client that left are not judged, and a disaggregated request counts
once. ``kvrouter serve`` in front of a ``kvrouter mock-replica`` process (the P/D case: the
router and mock replicas in this process), real HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp

from router.service.config import build_settings
from tests.backends import start_router
from tests.procs import FAST, Fleet, http_get, token_prompt
from tests.test_audit_metrics import series
from tests.test_pd_service import MODEL, B, Mocks, _prompt, _replicas
from tests.test_pd_service import _post as pd_post
from tests.test_pd_service import mocks as mocks  # the fixture: P/D mock replicas
from tests.waiting import eventually

# prompts of at most 64 tokens: 1000 s to answer (met); longer ones: 1 us (missed); the TPOT
# target of 1 us, which a non-streamed answer is never judged against
SLO_ENV = {
    "KVROUTER_MODELS__M__SLO__TTFT_TIERS": "64:1000,*:0.000001",
    "KVROUTER_MODELS__M__SLO__TPOT_S": "0.000001",
}
SLO = "kvrouter_slo_requests_total"


def _key(tier: str, result: str) -> str:
    return f'{{class="default",model="m",result="{result}",tier="{tier}"}}'


async def _page(url: str) -> str:
    _, page = await asyncio.to_thread(http_get, url + "/metrics")
    return str(page)


async def _slo(url: str) -> dict[str, float]:
    return series(await _page(url), SLO)


async def _outcome(url: str, outcome: str) -> float:
    got = series(await _page(url), "kvrouter_requests_total")
    return sum(v for k, v in got.items() if f'outcome="{outcome}"' in k)


async def _post(
    session: aiohttp.ClientSession, url: str, seed: int, tokens: int, **extra: Any
) -> tuple[int, bytes]:
    body = {"model": "m", "prompt": token_prompt(seed, tokens), "max_tokens": 4, **extra}
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.read()


async def test_a_non_streamed_answer_is_judged_by_its_e2e_against_the_ttft_target(
    tmp_path: Path,
) -> None:
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("b0", time_scale=FAST)
        router = fleet.router("router", [("b0", mock.url)], env=SLO_ENV)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            # a short prompt: its E2E is within 1000 s, and its TPOT is not judged
            status, data = await _post(s, router.url, 1, 40)
            assert status == 200 and b'"usage"' in data
            await eventually(
                lambda: _expect(router.url, {_key("le64", "met"): 1.0}), 10.0, message="met"
            )
            # a long prompt: its E2E misses 1 us; TTFT missed, never both (TPOT unjudged)
            status, _ = await _post(s, router.url, 2, 100)
            assert status == 200
            await eventually(
                lambda: _expect(
                    router.url, {_key("le64", "met"): 1.0, _key("any", "ttft_missed"): 1.0}
                ),
                10.0,
                message="ttft_missed",
            )


async def test_an_error_answer_and_a_client_that_left_are_not_judged(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("b0", time_scale=FAST)
        router = fleet.router("router", [("b0", mock.url)], env=SLO_ENV)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(mock.url + "/admin/fault", json={"mode": "400"}) as r:
                assert r.status == 200
            status, _ = await _post(s, router.url, 1, 40)
            assert status == 400
            await eventually(lambda: _outcome(router.url, "upstream_4xx"), 10.0)
            async with s.post(mock.url + "/admin/fault", json={"mode": "slow:30"}) as r:
                assert r.status == 200
            left = asyncio.create_task(_post(s, router.url, 2, 40))
            # the client leaves once its request is held at the replica (the second one the
            # fault hit)
            await eventually(lambda: _injected(mock.url, 2), 10.0)
            left.cancel()
            await eventually(lambda: _outcome(router.url, "cancelled"), 10.0)
            async with s.post(mock.url + "/admin/fault", json={"mode": "none"}) as r:
                assert r.status == 200
            # an answer after them: the books are up to date, and it is the only one judged
            status, _ = await _post(s, router.url, 3, 40)
            assert status == 200
            await eventually(lambda: _expect(router.url, {_key("le64", "met"): 1.0}), 10.0)


async def _injected(mock_url: str, count: int) -> bool:
    """The mock's fault mode hit ``count`` requests."""
    _, state = await asyncio.to_thread(http_get, mock_url + "/admin/fault")
    return isinstance(state, dict) and state.get("injected") == count


async def _expect(url: str, counts: dict[str, float]) -> bool:
    """The SLO counter holds exactly ``counts`` (every other series absent or zero)."""
    got = {k: v for k, v in (await _slo(url)).items() if v}
    return got == counts


async def test_a_disaggregated_non_streamed_answer_is_judged_once(mocks: Mocks) -> None:
    """Its prefill leg (a non-streamed 2xx answer the router reads itself) is no answer of
    the client's: the request counts once, by the decode leg's answer the client gets."""
    settings = build_settings(
        {
            "server": {"health_interval_s": 0},
            "replicas": _replicas(mocks),
            "models": {
                MODEL: {"block_size": B, "hybrid": True, "pd": {"mode": "always"},
                        "slo": {"ttft_s": 1000.0, "tpot_s": 0.000001}}
            },
        }
    )  # fmt: skip
    router, url = await start_router(settings)
    try:
        status, raw, _ = await pd_post(url, {"model": MODEL, "prompt": _prompt(1), "max_tokens": 5})
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 5
        assert mocks.counters("p0").prefill_legs == 1 and mocks.counters("d0").decode_legs == 1
        key = f'{{class="default",model="{MODEL}",result="met",tier="any"}}'
        await eventually(lambda: _expect(url, {key: 1.0}), 10.0)
    finally:
        await router.cleanup()
