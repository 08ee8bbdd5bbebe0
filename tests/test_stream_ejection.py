"""Outlier ejection of a replica whose streams fail after their first token
(router/service/proxy.py books a stream's end, not its first byte, as the attempt's
success; router/core/outliers.py): a real router in front of two mock replicas, one in the
``break-stream`` or ``error-event`` fault mode (router/mock/faults.py). Such failures cannot
be retried (the client has a token already), so ejection is what stops them."""

from __future__ import annotations

import pathlib

import aiohttp
import pytest

from router.mock.server import MockSettings
from router.service.config import build_settings
from tests.backends import metric_sample, start_mock, start_router
from tests.waiting import eventually

MODEL = "m"
DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _doc_row(name: str) -> str:
    return next(line for line in DOCS.read_text().splitlines() if line.startswith(f"| `{name}`"))


@pytest.mark.parametrize(
    ("fault", "kind"), [("break-stream", "broken"), ("error-event", "error_event")]
)
async def test_a_replica_failing_every_stream_after_its_first_token_is_ejected(
    fault: str, kind: str
) -> None:
    bad, bad_url = await start_mock(MockSettings(model=MODEL, replica="bad", fault=fault))
    good, good_url = await start_mock(MockSettings(model=MODEL, replica="good", time_scale=0.01))
    settings = build_settings(
        {
            "server": {"outlier_base_ejection_s": 60.0, "health_interval_s": 60.0},
            "replicas": [
                {"name": "bad", "url": bad_url, "model": MODEL},
                {"name": "good", "url": good_url, "model": MODEL},
            ],
            "models": {MODEL: {"policy": "round_robin", "block_size": 16}},
        }
    )
    router, url = await start_router(settings)
    outcomes: list[bool] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def one() -> bool:
                body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    try:
                        data = await r.read()
                    except aiohttp.ClientPayloadError:  # cut after the router's error event
                        data = b""
                ok = data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
                outcomes.append(ok)
                return ok

            async def ejected() -> bool:
                async with http.get(url + "/metrics") as r:
                    page = await r.text()
                failures = metric_sample(
                    page, "kvrouter_replica_failures_total", replica="bad", kind=kind
                )
                ejections = metric_sample(page, "kvrouter_replica_ejections_total", replica="bad")
                return bool(failures and failures >= 3 and ejections)

            async def sent_one_then_ejected() -> bool:
                await one()  # one at a time: no overlap keeps a failure run going
                return await ejected()

            await eventually(sent_one_then_ejected, timeout=20, interval=0.0)
            # the kind an operator sees on the page is one docs/metrics.md's row names
            assert f"`{kind}`" in _doc_row("kvrouter_replica_failures_total")
            failed = outcomes.count(False)
            assert 3 <= failed <= 4, outcomes  # the third failure in a row ejects it
            for _ in range(6):  # from then on every stream goes to the good replica
                assert await one(), outcomes
    finally:
        await router.cleanup()
        await bad.cleanup()
        await good.cleanup()
