"""The mock replica sends the same bytes as when tests/fixtures/mock_golden.json was
captured, for every shape of request (tests/mock_golden.py): one sequence and several
(``n`` > 1, completion batches), streamed or not, chat and completions, logprobs, ``echo``,
prompt logprobs, ``include_usage`` and ``continuous_usage_stats``, a prefill leg, the
Messages and Responses APIs, and the errors; the live bench's figures rest on them. And a
client gone mid-stream cancels its sequence on the engine."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import aiohttp
import pytest

from router.mock.server import MockSettings
from router.mock.state import STATE
from tests import mock_golden
from tests.waiting import eventually

CHAT = mock_golden.CHAT
FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "mock_golden.json"


async def test_every_answer_is_byte_for_byte_as_captured() -> None:
    runner, url = await mock_golden.start()
    try:
        captured = await mock_golden.capture(url, runner.app)
    finally:
        await runner.cleanup()
    expected = json.loads(FIXTURE.read_text())
    assert len(captured) == len(expected)
    for got, want in zip(captured, expected, strict=True):
        assert got == want


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "ab", "max_tokens": 4000, "stream": True}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4000, "stream": True}),
    ],
)
async def test_a_client_gone_mid_stream_cancels_its_sequence(
    path: str, body: dict[str, Any]
) -> None:
    settings = MockSettings(model=mock_golden.MODEL, block_size=16, time_scale=1.0)
    runner, url = await mock_golden.start(settings, stepped=False)
    model = runner.app[STATE].driver.model
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + path, json={"model": mock_golden.MODEL, **body}) as r,
        ):
            assert r.status == 200
            await r.content.readline()
            assert model.pending() == 1
        await eventually(lambda: model.pending() == 0)
    finally:
        await runner.cleanup()
