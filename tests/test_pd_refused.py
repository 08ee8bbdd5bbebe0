"""Bodies vLLM 0.34 refuses for a field a disaggregated request's prefill leg overrides
(``stream_options``, ``min_tokens``: router/service/pd_serve.py): the prefill leg's own
values made them valid there, so the prefill replica computed the whole prompt and kept its
blocks for a decode leg its engine then refused at request validation, before the serving
layer that would hand them back (``_with_kv_transfer_rejection_cleanup``): they stayed until
the KV lease ran out. Such a body is kept local (router/service/disagg.py ``keep_local``):
one replica refuses it at once, as vLLM does, and nothing is prefilled."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from router.service.app import STATE
from tests.backends import Backend, metric_sample, start_router
from tests.test_pd_service import (
    MODEL,
    Mocks,
    _post,
    _Prefill,
    _prompt,
    _replicas,
    _settings,
    _stub_settings,
    mocks,  # noqa: F401 (the fixture)
)


async def test_stream_options_without_a_stream_is_refused_with_no_prefill_leg(
    mocks: Mocks,  # noqa: F811
) -> None:
    """``stream_options`` on a request that does not stream: vLLM's 400 from the replica it
    was routed to, and no prefill leg anywhere (the prefill mock counts none)."""
    router, url = await start_router(_settings(_replicas(mocks)))
    try:
        body = {"model": MODEL, "prompt": _prompt(1), "stream_options": {"include_usage": True}}
        status, raw, _ = await _post(url, body)
        assert status == 400, raw
        assert b"Stream options can only be defined when `stream=True`." in raw
        assert sum(mocks.counters(n).prefill_legs for n in ("p0", "d0", "d1")) == 0
        assert router.app[STATE].load.in_flight() == 0
    finally:
        await router.cleanup()


@pytest.mark.parametrize(
    "fields",
    [
        {"stream_options": {"include_usage": True}},  # (no stream)
        {"stream": 0, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": "usage"},
        {"stream": True, "stream_options": {"include_usage": "maybe"}},
        {"min_tokens": None},
        {"min_tokens": "few"},
        {"min_tokens": -1},
        {"max_tokens": 4, "min_tokens": 5},
        {"min_tokens": 17},  # (a completion's max_tokens: 16 when absent, as in vLLM)
    ],
)
async def test_a_body_the_decode_leg_would_refuse_is_kept_local(fields: dict[str, Any]) -> None:
    """Each such body goes, as sent, to one replica that serves requests whole (decode
    replicas prefill too), counted as kept local (``invalid_body``); the prefill replica
    gets nothing."""
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    try:
        body = {"model": MODEL, "prompt": _prompt(2, 300), **fields}
        await _post(url, body)
        assert not prefill.seen
        ((got,),) = [[r["body"] for r in decode.received]]
        assert got.get("kv_transfer_params") is None
        for key, value in fields.items():
            assert got[key] == value, key
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            page = await r.text()
        assert metric_sample(page, "kvrouter_pd_decisions_total", reason="invalid_body") == 1.0
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()


async def test_valid_stream_options_and_min_tokens_are_still_disaggregated() -> None:
    """What vLLM takes is disaggregated as before: a stream's options, an empty options
    object without a stream, ``min_tokens`` within ``max_tokens`` (``"2"`` read as 2)."""
    prefill = await _Prefill().start()
    decode = await Backend("d0", [MODEL]).start()
    router, url = await start_router(_stub_settings(prefill.url, [(decode.url, "decode")]))
    try:
        for i, fields in enumerate(
            [
                {"stream": True, "stream_options": {"include_usage": "true"}},
                {"stream_options": {}},
                {"stream": "false", "stream_options": None},
                {"max_tokens": 4, "min_tokens": "2"},
                {"min_tokens": 3},
            ]
        ):
            body = {"model": MODEL, "prompt": _prompt(10 + i, 300), **fields}
            status, raw, _ = await _post(url, body)
            assert status == 200, raw
            assert len(prefill.seen) == i + 1, fields
    finally:
        await router.cleanup()
        await prefill.runner.cleanup()
        await decode.stop()
