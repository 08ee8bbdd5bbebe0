"""``usage`` read from a replica's answer without parsing the whole body
(router/service/proxy.py ``usage_of``): always what a full parse gives."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.service.answers import cached_tokens_of, usage_of

# strings that try to look like keys: quotes, backslashes, braces, the word itself
_TEXT = st.lists(
    st.sampled_from(['"', "\\", "{", "}", ":", ",", '"usage"', "usage", "a", " ", "\u00e9"]),
    max_size=8,
).map("".join)
_KEYS = st.sampled_from(
    ["usage", "choices", "kv_transfer_params", "x", 'us"age', "usage\\", 'x"usage', 'x\\"usage']
)
_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), _TEXT)
_JSON = st.recursive(
    _LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_KEYS, inner, max_size=4)),
    max_leaves=25,
)
_USAGE = st.one_of(
    st.fixed_dictionaries({"prompt_tokens": st.integers(0, 10**6)}),
    st.fixed_dictionaries(
        {"prompt_tokens_details": st.fixed_dictionaries({"cached_tokens": st.integers(0, 99)})}
    ),
    _JSON,
)


def _reference(payload: bytes) -> dict[str, Any] | None:
    obj = json.loads(payload)
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


@settings(max_examples=200, deadline=None)
@given(
    before=st.dictionaries(_KEYS, _JSON, max_size=4),
    usage=st.one_of(st.none(), _USAGE),
    after=st.dictionaries(_KEYS, _JSON, max_size=4),
    compact=st.booleans(),
    indent=st.sampled_from([None, 2]),
)
def test_same_as_a_full_parse(
    before: dict[str, Any],
    usage: Any,
    after: dict[str, Any],
    compact: bool,
    indent: int | None,
) -> None:
    body: dict[str, Any] = dict(before)
    if usage is not None:
        body.pop("usage", None)
        body["usage"] = usage
    for k, v in after.items():
        if k != "usage":
            body[k] = v
    seps = (",", ":") if compact else (", ", ": ")
    payload = json.dumps(body, separators=seps, indent=indent).encode()
    if b"data:" in payload:
        return  # read as SSE lines: another path
    assert usage_of(payload) == _reference(payload)


def test_typical_bodies() -> None:
    vllm = {
        "id": "c",
        "choices": [{"message": {"content": 'he said "usage": {"cached_tokens": 9}'}}],
        "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}},
        "prompt_logprobs": None,
        "kv_transfer_params": {"usage": {"prompt_tokens_details": {"cached_tokens": 1}}},
    }
    assert cached_tokens_of(json.dumps(vllm).encode()) == 8
    del vllm["usage"]
    assert cached_tokens_of(json.dumps(vllm).encode()) is None
    assert usage_of(b'  {"usage": {"prompt_tokens": 3}}\n') == {"prompt_tokens": 3}
    assert usage_of(b'{"usage": {"prompt_tokens": 3}') is None  # truncated body
    assert usage_of(b'{"usage": {"prompt_tokens": 3}}, "x": 1}') is None  # not one object


# raw JSON text: duplicate keys and escaped spellings, which json.dumps of a dict never makes
_SPELLINGS = st.sampled_from(['"usage"', '"us\\u0061ge"', '"\\u0075sage"', '"x"', '"choices"'])


def _object(members: list[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in members) + "}"


_VALUE_TEXT = st.recursive(
    _JSON.map(json.dumps),
    lambda inner: st.lists(st.tuples(_SPELLINGS, inner), max_size=3).map(_object),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(members=st.lists(st.tuples(_SPELLINGS, _VALUE_TEXT), max_size=6))
def test_duplicate_and_escaped_keys_as_a_full_parse(members: list[tuple[str, str]]) -> None:
    payload = _object(members).encode()
    if b'"usage"' not in payload:
        return  # no literal key at all: None without parsing (servers spell keys plainly)
    assert usage_of(payload, sse=False) == _reference(payload)


def test_json_answers_that_mention_data_or_nest_deeply() -> None:
    body = {
        "choices": [{"message": {"content": "![x](data:image/png;base64,AAAA)"}}],
        "usage": {"prompt_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    payload = json.dumps(body).encode()
    assert cached_tokens_of(payload, sse=False) == 4
    deep = b'{"usage": {"cached_tokens": 1}, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert usage_of(deep, sse=False) is None  # what json.loads cannot parse: no crash


def test_anthropic_streams_as_vllm_writes_them(monkeypatch: Any) -> None:
    """The Messages API stream of vLLM 0.34's own converter (anthropic/serving.py
    ``message_stream_converter``, run unmodified: tests/engines/anthropic_ref.py) read as the
    relay reads it: the prompt is ``input_tokens`` + ``cache_read_input_tokens`` +
    ``cache_creation_input_tokens`` (vLLM's ``_build_anthropic_usage`` takes both from its
    prompt), the hit is ``cache_read_input_tokens`` and the answer's length is
    ``message_delta``'s cumulative ``output_tokens``; the usage of ``message_start`` (nested
    in its message, output 0) is not the answer's, so a stream ending with an ``error`` event
    reports none."""
    import asyncio

    from router.service.answers import usage_tokens
    from tests.engines.anthropic_ref import load

    mods = load()
    chat = mods["vllm.entrypoints.openai.chat_completion.protocol"]
    engine = mods["vllm.entrypoints.serve.engine.protocol"]
    module = mods["vllm.entrypoints.anthropic.serving"]
    monkeypatch.setattr(module, "sanitize_message", str)  # a stand-in in anthropic_ref
    serving = module.AnthropicServingMessages
    details = engine.PromptTokenUsageInfo(cached_tokens=32, created_cache_tokens=64)

    def chunk(content: str | None, out: int, last: bool = False) -> Any:
        usage = engine.UsageInfo(
            prompt_tokens=100,
            completion_tokens=out,
            total_tokens=100 + out,
            prompt_tokens_details=details if out == 0 or last else None,
        )
        delta = chat.DeltaMessage(role="assistant" if out == 0 else None, content=content)
        choices = [] if last else [chat.ChatCompletionResponseStreamChoice(index=0, delta=delta)]
        return chat.ChatCompletionStreamResponse(id="c", model="m", choices=choices, usage=usage)

    async def stream(fail: bool) -> bytes:
        async def chunks() -> Any:
            yield chunk("", 0)  # vLLM's first chunk (continuous usage: the prompt's split)
            yield chunk("Hi", 1)
            yield chunk(" there", 2)
            if fail:
                raise RuntimeError("engine died")
            yield chunk(None, 2, last=True)

        return "".join([e async for e in serving.message_stream_converter(None, chunks())]).encode()

    whole = asyncio.run(stream(fail=False))
    assert whole.startswith(b"event: message_start") and b"message_delta" in whole
    assert usage_tokens(usage_of(whole, True)) == (100, 2, 32)
    failed = asyncio.run(stream(fail=True))
    assert failed.rstrip().endswith(b"}") and b"event: error" in failed
    assert b'"output_tokens":0' in failed and usage_of(failed, True) is None
