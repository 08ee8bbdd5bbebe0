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
