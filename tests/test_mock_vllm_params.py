"""The mock replica's answers to what a request asks, as vLLM 0.34 answers them: the
``system_fingerprint`` it stamps, the logprobs candidates it lists, and the sampling
parameters, salts and budgets it refuses or serves (vLLM's serving classes and
``SamplingParams``, /tmp's vLLM 0.34 source: entrypoints/openai/*, sampling_params.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from tests.engines import anthropic_ref
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


# (chat, body fields, vLLM 0.34's message, its param): SamplingParams._verify_args and
# _verify_greedy_sampling, the chat request's check_logprobs; a VLLMValidationError naming a
# parameter adds it and the value to its message and gives it as the error's ``param``
def _named(message: str, param: str, value: object = None) -> tuple[str, str]:
    """vLLM's message and ``param`` of a VLLMValidationError naming ``param``."""
    extra = f"parameter={param}" + ("" if value is None else f", value={value}")
    return f"{message} ({extra})", param


TOP = "top_logprobs"
REFUSED: list[tuple[bool, dict[str, Any], tuple[str, str | None]]] = [
    (True, {"n": 0}, ("n must be at least 1, got 0.", None)),
    (
        False,
        {"temperature": -1},
        _named("temperature must be non-negative, got -1.0.", "temperature", -1.0),
    ),
    (
        True,
        {"temperature": 2.5},
        _named("temperature must be in [0, 2], got 2.5.", "temperature", 2.5),
    ),
    (False, {"top_p": 0}, _named("top_p must be in (0, 1], got 0.0.", "top_p", 0.0)),
    (True, {"top_k": -2}, ("top_k must be 0 (disable), or at least 1, got -2.", None)),
    (False, {"min_p": 1.5}, ("min_p must be in [0, 1], got 1.5.", None)),
    (True, {"presence_penalty": 3}, ("presence_penalty must be in [-2, 2], got 3.0.", None)),
    (False, {"frequency_penalty": -3}, ("frequency_penalty must be in [-2, 2], got -3.0.", None)),
    (
        True,
        {"repetition_penalty": 0},
        ("repetition_penalty must be greater than zero, got 0.0.", None),
    ),
    (
        False,
        {"min_tokens": 5, "max_tokens": 2},
        ("min_tokens must be less than or equal to max_tokens=2, got 5.", None),
    ),
    (True, {"stop": ["x", ""]}, ("stop cannot contain an empty string.", None)),
    (False, {"temperature": 0, "n": 2}, ("n must be 1 when using greedy sampling, got 2.", None)),
    (False, {"logprobs": -2}, _named("`logprobs` must be a positive value or -1.", "logprobs", -2)),
    (True, {TOP: 2}, _named("when using `top_logprobs`, `logprobs` must be set to true.", TOP)),
    (
        True,
        {TOP: -3, "logprobs": True},
        _named("`top_logprobs` must be a positive value or -1.", TOP, -3),
    ),
]


@pytest.mark.parametrize(("chat", "fields", "refusal"), REFUSED)
async def test_sampling_parameters_vllm_refuses_are_refused_in_its_words(
    mock: Callable,  # noqa: F811
    chat: bool,
    fields: dict[str, Any],
    refusal: tuple[str, str | None],
) -> None:
    """vLLM 0.34 builds a request's ``SamplingParams`` before it answers, so a parameter out
    of its range is a 400 ``BadRequestError`` before any stream opens. The mock served
    every such request (a temperature of -1, ``n`` of 0, ``top_logprobs`` without
    ``logprobs``), so a peer's error handling never saw the refusal vLLM gives."""
    url = await mock()
    path, body = (
        ("/v1/chat/completions", {"messages": CHAT})
        if chat
        else ("/v1/completions", {"prompt": "hi there"})
    )
    body = {"model": MODEL, "max_tokens": 3} | body | fields
    message, param = refusal
    for stream in (False, True):
        status, err = await _post(url, path, body | {"stream": stream})
        assert status == 400, (fields, stream, err)
        assert err["error"] == {
            "message": message,
            "type": "BadRequestError",
            "param": param,
            "code": 400,
        }


async def test_sampling_parameters_in_vllm_s_ranges_are_served(
    mock: Callable,  # noqa: F811
) -> None:
    url = await mock()
    fields = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "n": 2}
    fields |= {"presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 1.1}
    fields |= {"min_tokens": 2, "max_tokens": 2, "stop": "x", "seed": 1}
    for path, body in (
        # (-1, all of the vocabulary, is more than vLLM's default --max-logprobs of 20:
        # tests/test_mock_top_logprobs.py)
        ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 20}),
        ("/v1/completions", {"prompt": "hi", "logprobs": 20}),
        ("/v1/completions", {"prompt": "hi", "temperature": "0", "n": 1, "top_p": None}),
    ):
        status, ok = await _post(url, path, {"model": MODEL} | fields | body)
        assert status == 200, (body, ok)


@pytest.mark.parametrize("salt", ["a/b", "a@b", "a\\b", "a\x00b", "s" * 129])
async def test_a_cache_salt_vllm_refuses_is_refused(
    mock: Callable,  # noqa: F811
    salt: str,
) -> None:
    """vLLM 0.34's ``validate_cache_salt`` refuses a salt over 128 characters or holding
    '@', '/', '\\' or NUL (they would break the cache backends' keys); the mock hashed and
    published it."""
    validate = anthropic_ref.load()["vllm.entrypoints.generate.base.protocol"].validate_cache_salt
    with pytest.raises(ValueError) as refusal:
        validate(salt)
    url = await mock()
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt}
    status, err = await _post(url, "/v1/completions", body)
    assert status == 400, err
    # (the vendored module's stand-in error leaves out the parameter vLLM's names)
    assert err["error"]["message"] == f"{refusal.value} (parameter=cache_salt)"
    assert err["error"]["param"] == "cache_salt"
    validate("s" * 128)
    status, ok = await _post(url, "/v1/completions", body | {"cache_salt": "s" * 128})
    assert status == 200, ok
