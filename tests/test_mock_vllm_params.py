"""The mock replica's answers to what a request asks, as vLLM 0.34 answers them: the
``system_fingerprint`` it stamps, the logprobs candidates it lists, and the sampling
parameters, salts and budgets it refuses or serves (vLLM's serving classes and
``SamplingParams``, /tmp's vLLM 0.34 source: entrypoints/openai/*, sampling_params.py)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.test_mock_vllm_wire import CHAT, MODEL, _events, _post, mock  # noqa: F401

FINGERPRINT = re.compile(r"vllm-0\.34\.0-[0-9a-f]{8}")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_answers_carry_vllm_s_system_fingerprint(
    mock: Callable,  # noqa: F811
    chat: bool,
    n: int,
) -> None:
    """vLLM 0.34 (``--fingerprint-mode full``, its default) stamps
    ``vllm-<version>-<config hash8>`` on a non-streamed answer, on a stream's usage chunk,
    and, when no usage chunk follows, on each choice's terminal chunk (finish_reason set);
    no other chunk has it. The mock sent null everywhere."""
    url = await mock()
    path, body = (
        ("/v1/chat/completions", {"messages": CHAT})
        if chat
        else ("/v1/completions", {"prompt": "hi there"})
    )
    body |= {"model": MODEL, "max_tokens": 2, "n": n}
    status, answer = await _post(url, path, body)
    assert status == 200, answer
    fingerprint = answer["system_fingerprint"]
    assert isinstance(fingerprint, str) and FINGERPRINT.fullmatch(fingerprint), fingerprint
    events = (await _events(url, path, body | {"stream": True}))[:-1]
    stamped = [e.get("system_fingerprint") for e in events]
    terminal = [e["choices"][0]["finish_reason"] is not None for e in events]
    assert stamped == [fingerprint if t else None for t in terminal]
    assert sum(terminal) == n
    opts = {"stream_options": {"include_usage": True}}
    events = (await _events(url, path, body | {"stream": True} | opts))[:-1]
    assert [e.get("system_fingerprint") for e in events] == [None] * (len(events) - 1) + [
        fingerprint
    ]
    assert events[-1]["choices"] == []
