"""vLLM 0.34's Responses API rendering, run unmodified without torch, a model or a server.

``load()`` executes the vendored copies (README.md) of the Responses request model
(``vllm/entrypoints/openai/responses/protocol.py``: ``ResponsesRequest`` with its
``input_item_parsing``, ``build_chat_params``, ``build_tok_params``), the conversion of a
request to chat messages and tools (``vllm/entrypoints/openai/responses/utils.py``:
``construct_input_messages``, ``construct_tool_dicts``, ``should_continue_final_message``),
the tool helpers it uses (``vllm/tool_parsers/utils.py``: namespaces flattened, custom tools
as a function shim) and the online renderer (``vllm/renderers/online_renderer.py``), whose
``OnlineRenderer.render_responses`` is what vLLM's ``/v1/responses`` (and
``/v1/responses/render``) runs for a non-harmony model. The chat request model and the
renderer parameters are ``anthropic_ref.load()``'s, vLLM's chat message parsing
``chat_ref.load()``'s.

What those modules import from the rest of vLLM is a stand-in (``_names``): the harmony
helpers (the renderer is built for a non-harmony model), the tool / reasoning parser (none:
an engine without ``--tool-call-parser``), the mistral checks (not a mistral tokenizer), the
engine input types. The renderer ``render_responses`` hands its result to
(``self.renderer.render_chat_async``, vLLM's ``HfRenderer``) is :class:`Renderer`: vLLM's
``parse_chat_messages`` (chat_ref), transformers' ``render_jinja_template``
(transformers_ref) with what ``safe_apply_chat_template`` passes it, then the tokenizer with
the ``TokenizeParams`` special tokens.

The vendored modules import lazily (``from vllm.tool_parsers.utils import ...`` inside a
validator): calls into them run under :func:`installed`, which puts the vLLM names back in
``sys.modules`` for the call and restores what other tests see afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.engines import anthropic_ref, chat_ref, transformers_ref

HERE = Path(__file__).parent

# (module name in vLLM, vendored file), in import order
FILES = (
    ("vllm.entrypoints.openai.responses.protocol", "vllm_0_34_0_responses_protocol.py"),
    ("vllm.tool_parsers.utils", "vllm_0_34_0_tool_parser_utils.py"),
    ("vllm.entrypoints.openai.responses.utils", "vllm_0_34_0_responses_utils.py"),
    ("vllm.renderers.online_renderer", "vllm_0_34_0_online_renderer.py"),
)
PREFIX = "responses_ref."


def _error_init(self: ValueError, message: str = "", **kwargs: Any) -> None:
    ValueError.__init__(self, message)


VLLMValidationError = type("VLLMValidationError", (ValueError,), {"__init__": _error_init})


def _create_error_response(message: Any, *args: Any, **kwargs: Any) -> Any:
    raise VLLMValidationError(str(message))


def _tokens_input(
    prompt_token_ids: list[int], *, prompt: str | None = None, cache_salt: str | None = None
) -> dict[str, Any]:
    """vllm/inputs/engine.py ``tokens_input`` (a TypedDict built as a dict)."""
    inputs: dict[str, Any] = {"type": "token", "prompt_token_ids": prompt_token_ids}
    if prompt is not None:
        inputs["prompt"] = prompt
    if cache_salt is not None:
        inputs["cache_salt"] = cache_salt
    return inputs


def _names(base: dict[str, types.ModuleType]) -> dict[str, dict[str, Any]]:
    """Stand-in modules (by vLLM name) and their explicit attributes."""
    params = base["vllm.renderers.params"]
    chat_types = base["vllm.renderers.chat_utils.types"]
    chat_utils = {key: getattr(chat_types, key) for key in chat_types.__all__}
    return {
        "vllm": {},
        "vllm.envs": {"VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS": []},
        "vllm.logger": {"init_logger": anthropic_ref._init_logger},
        "vllm.utils": {"random_uuid": lambda: "0" * 32},
        "vllm.utils.mistral": {
            "is_mistral_tokenizer": lambda tokenizer: False,
            "is_mistral_tool_parser": lambda parser: False,
        },
        "vllm.config": {},
        "vllm.exceptions": {"VLLMValidationError": VLLMValidationError},
        "vllm.inputs": {"tokens_input": _tokens_input},
        "vllm.parser": {},
        "vllm.sampling_params": {"ThinkingTokenBudget": int | None},
        "vllm.entrypoints": {},
        "vllm.entrypoints.serve": {"create_error_response": _create_error_response},
        "vllm.entrypoints.serve.utils": {},
        "vllm.entrypoints.serve.utils.request_logger": {},
        "vllm.entrypoints.openai": {},
        "vllm.entrypoints.openai.parser": {},
        "vllm.entrypoints.openai.parser.harmony_utils": {},
        "vllm.entrypoints.openai.responses": {},
        "vllm.entrypoints.openai.responses.harmony": {},
        "vllm.tool_parsers": {},
        "vllm.renderers": {
            "ChatParams": params.ChatParams,
            "TokenizeParams": params.TokenizeParams,
            "map_reasoning_effort": params.map_reasoning_effort,
            "merge_kwargs": params.merge_kwargs,
        },
        "vllm.renderers.chat_utils": {
            **chat_utils,
            "make_tool_call_id": lambda *a, **k: "chatcmpl-tool-0",
            # vLLM's own (chat_ref's vendored chat_message.py)
            "has_non_text_content": chat_ref.load()[chat_ref.NAME].has_non_text_content,
        },
        "vllm.renderers.inputs": {},
        "vllm.renderers.inputs.preprocess": {
            "extract_prompt_components": anthropic_ref._extract_prompt_components
        },
        "vllm.renderers.metrics": {},
        "openai_harmony": {},
        "partial_json_parser": {},
        "partial_json_parser.core": {},
        "partial_json_parser.core.options": {},
    }


_stubs: dict[str, types.ModuleType] = {}
_loaded: dict[str, types.ModuleType] = {}
# the modules anthropic_ref loaded, under their vLLM names (the vendored ones import them)
_REAL = (
    "vllm.entrypoints.serve.engine.protocol",
    "vllm.entrypoints.generate.base.protocol",
    "vllm.entrypoints.openai.chat_completion.protocol",
    "vllm.entrypoints.openai.completion.protocol",
    "vllm.renderers.params",
    "vllm.renderers.chat_utils.types",
)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The stand-ins and the vendored modules under their vLLM names for the duration."""
    modules = {**_stubs, **_loaded}
    saved = {name: sys.modules.get(name) for name in modules}
    try:
        sys.modules.update(modules)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def load() -> dict[str, types.ModuleType]:
    """The vendored modules by vLLM name ("vllm.renderers.online_renderer", ...)."""
    if _loaded:
        return _loaded
    base = anthropic_ref.load()
    # the chat request model's check of forwarded prompt ids against media: vLLM's own
    chat_protocol = base["vllm.entrypoints.openai.chat_completion.protocol"]
    chat_protocol.has_non_text_content = chat_ref.load()[chat_ref.NAME].has_non_text_content
    for name, attrs in _names(base).items():
        mod = anthropic_ref._Stub(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        _stubs[name] = mod
    for name in _REAL:
        _stubs[name] = base[name]
    for name, mod in _stubs.items():
        parent, _, child = name.rpartition(".")
        if parent in _stubs:
            setattr(_stubs[parent], child, mod)
    with installed():
        for name, filename in FILES:
            spec = importlib.util.spec_from_file_location(name, HERE / filename)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            _loaded[name] = mod
            parent, _, child = name.rpartition(".")
            setattr(_stubs[parent], child, mod)
    return _loaded


def conversation_of(messages: list[Any], content_format: str = "string") -> list[dict[str, Any]]:
    """The conversation vLLM's ``parse_chat_messages`` makes of chat ``messages`` (as the
    renderer gets them: not validated as a chat request's), in ``content_format``."""
    config = types.SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)
    parse = chat_ref.load()[chat_ref.NAME].parse_chat_messages
    conv, _, _ = parse(copy.deepcopy(messages), config, content_format)
    return [dict(m) for m in conv]


@dataclass(frozen=True)
class Rendered:
    """What vLLM renders for a Responses request: the chat messages it built, the
    conversation the template saw, the template's keyword arguments (``tools`` among them),
    the text and the prompt token ids."""

    messages: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    kwargs: dict[str, Any]
    text: str
    token_ids: list[int]


class Renderer:
    """vLLM's ``HfRenderer`` as ``OnlineRenderer.preprocess_chat`` calls it
    (``render_chat_async([messages], chat_params, tok_params, ...)``), for a text-only
    conversation: the messages parsed by vLLM's ``parse_chat_messages`` in
    ``content_format``, rendered by transformers' ``render_jinja_template`` with
    ``chat_params.get_apply_chat_template_kwargs()`` (``safe_apply_chat_template``: the
    template's variables, ``tools``; ``chat_template`` / ``tokenize`` / ``return_dict`` are
    apply_chat_template's own) and the tokenizer's named special tokens, then encoded by
    ``encode`` (text, add_special_tokens)."""

    def __init__(
        self,
        template: str,
        special_tokens: dict[str, str],
        encode: Callable[[str, bool], list[int]],
        content_format: str = "string",
        tool_template: str | None = None,
        tool_content_format: str | None = None,
    ) -> None:
        self.template = template
        self.special_tokens = special_tokens
        self.encode = encode
        self.content_format = content_format
        self.tool_template = tool_template
        self.tool_content_format = tool_content_format or content_format
        self.vocab_size = 1 << 20
        self.tokenizer = None
        self.last: dict[str, Any] = {}

    def validate_token_ids(self, token_ids: Any, *, parameter: str | None = None) -> None:
        """``BaseRenderer.validate_token_ids`` with a vocabulary of ``vocab_size`` ids."""
        if token_ids and not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
            raise VLLMValidationError("Token id is out of vocabulary")

    def get_tokenizer(self) -> None:
        return None

    async def render_chat_async(
        self,
        conversations: list[list[Any]],
        chat_params: Any,
        tok_params: Any,
        prompt_extras: dict[str, Any] | None = None,
        skip_mm_cache: bool = False,
    ) -> tuple[tuple[list[dict[str, Any]]], tuple[dict[str, Any]]]:
        (messages,) = conversations
        before = json.loads(json.dumps(messages))
        # HfRenderer.render_messages: the content format and (resolve_chat_template:
        # the tokenizer's get_chat_template) the template are those for the merged kwargs'
        # tools; a tokenizer with a "tool_use" template takes it whenever they are not None
        tools = chat_params.chat_template_kwargs.get("tools")
        with_tools = tools is not None and self.tool_template is not None
        content_format = self.tool_content_format if with_tools else self.content_format
        conversation = conversation_of(messages, content_format)
        kwargs = dict(chat_params.get_apply_chat_template_kwargs())
        for key in ("chat_template", "tokenize", "return_dict"):
            kwargs.pop(key, None)
        tools = kwargs.pop("tools", None)
        text = transformers_ref.render(
            self.tool_template if with_tools and self.tool_template else self.template,
            conversation,
            special_tokens=self.special_tokens,
            tools=tools,
            **kwargs,
        )
        ids = self.encode(text, tok_params.add_special_tokens)
        if tok_params.truncate_prompt_tokens is not None:
            raise NotImplementedError("truncation: not modelled by this stand-in")
        self.last = {
            "messages": before,
            "conversation": conversation,
            "kwargs": {**kwargs, "tools": tools},
            "text": text,
        }
        prompt = {"prompt": text, "prompt_token_ids": ids, **(prompt_extras or {})}
        return (conversation,), (prompt,)


def render(
    body: dict[str, Any],
    renderer: Renderer,
    *,
    default_kwargs: dict[str, Any] | None = None,
    effort_map: dict[str, str] | None = None,
    exclude_tools_when_none: bool = False,
    previous_messages: list[dict[str, Any]] | None = None,
) -> Rendered:
    """vLLM 0.34 rendering the Responses ``body``: the body validated as its
    ``ResponsesRequest``, then ``OnlineRenderer.render_responses`` of a server with the
    engine options given (``--default-chat-template-kwargs``, ``--reasoning-effort-map``,
    ``--exclude-tools-when-tool-choice-none``) and ``renderer``. ``previous_messages``: the
    chat messages of the response a ``previous_response_id`` names, as the server's store
    hands them to ``render_responses`` (``serving._render_resolved_response_inputs``)."""
    mods = load()
    with installed():
        proto = mods["vllm.entrypoints.openai.responses.protocol"]
        request = proto.ResponsesRequest.model_validate(json.loads(json.dumps(body)))
        server = _server(renderer, default_kwargs, effort_map, exclude_tools_when_none)
        result = asyncio.run(server.render_responses(request, previous_messages=previous_messages))
    return _rendered(renderer, result.engine_input)


def render_chat(
    body: dict[str, Any],
    renderer: Renderer,
    *,
    default_kwargs: dict[str, Any] | None = None,
    effort_map: dict[str, str] | None = None,
    exclude_tools_when_none: bool = False,
) -> Rendered:
    """vLLM 0.34 rendering the chat completion ``body``: the body validated as its
    ``ChatCompletionRequest``, then ``OnlineRenderer.render_chat`` (what ``/v1/chat/
    completions`` runs before the engine) of a non-harmony server with
    ``--enable-auto-tool-choice`` and no tool parser (``tool_choice`` "auto" or "none"), the
    engine options given, and ``renderer``."""
    load()
    with installed():
        proto = _stubs["vllm.entrypoints.openai.chat_completion.protocol"]
        request = proto.ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
        server = _server(renderer, default_kwargs, effort_map, exclude_tools_when_none)
        server.enable_auto_tools = True
        renderer.last = {}
        _, (engine_input,) = asyncio.run(server.render_chat(request))
    return _rendered(renderer, engine_input)


def _server(
    renderer: Renderer,
    default_kwargs: dict[str, Any] | None,
    effort_map: dict[str, str] | None,
    exclude_tools_when_none: bool,
) -> Any:
    online = _loaded["vllm.renderers.online_renderer"]
    server = object.__new__(online.OnlineRenderer)
    server.model_config = types.SimpleNamespace(
        multimodal_config=None,
        enable_prompt_embeds=False,
        max_model_len=1 << 20,
        served_model_name="m",
    )
    server.renderer = renderer
    server.use_harmony = False
    server.parser = None
    server.chat_template = None
    server.chat_template_content_format = renderer.content_format
    server.default_chat_template_kwargs = dict(default_kwargs or {})
    server.reasoning_effort_map = dict(effort_map or {})
    server.exclude_tools_when_tool_choice_none = exclude_tools_when_none
    server.trust_request_chat_template = False
    server.trust_request_mm_kwargs = False
    return server


def _rendered(renderer: Renderer, engine_input: Any) -> Rendered:
    last = renderer.last  # empty: nothing rendered (prompt ids forwarded in kv_transfer_params)
    return Rendered(
        messages=last.get("messages", []),
        conversation=last.get("conversation", []),
        kwargs=last.get("kwargs", {}),
        text=last.get("text", ""),
        token_ids=list(engine_input["prompt_token_ids"]),
    )
