"""What of a request decides the prompt vLLM runs, read and checked as vLLM reads it: the
chat template's arguments (messages, tools, template variables), truncation and special
tokens. router.tokenize.pipeline (chats) and router.tokenize.keying (truncation, special
tokens, the chain root) turn them into tokens and block hashes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from router.core.errors import BadRequest
from router.tokenize.lax import INVALID, lax_bool, lax_int
from router.tokenize.template_inputs import prepare_tools

# the most sequences a request's ``n`` adds to its replica's load view (a larger ``n`` is the
# engine's to refuse or serve; the router's view stays bounded)
MAX_SAMPLES = 1024


def kept_tokens(
    body: Mapping[str, Any], context_length: int | None = None, *, chat: bool = False
) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: k >= 1 sends only the prompt's last k tokens to the
    engine (left truncation of the token ids), so those are what the router must hash; -1 is
    the model's context length less one (vLLM 0.34 ``TokenizeParams.max_truncation_tokens``:
    a token held back for output), the whole context for a request asking no output tokens
    (:func:`_asks_no_output`), when ``context_length`` is known. None when absent, 0, or -1
    with no known context length; BadRequest for anything but an integer >= -1."""
    k = lax_int(body.get("truncate_prompt_tokens"))  # "10" and 10.0 are 10, as in vLLM
    if k is None:
        return None
    if type(k) is not int or k < -1:
        raise BadRequest("'truncate_prompt_tokens' must be an integer >= -1")
    if k == -1:
        if not context_length:
            return None
        return context_length if _asks_no_output(body, chat) else max(context_length - 1, 1)
    return k if k >= 1 else None


def kept_to_context(body: Mapping[str, Any], context_length: int | None) -> int | None:
    """The tokens ``truncate_prompt_tokens: -1`` keeps of a chat (:func:`kept_tokens`: the
    context length less one, or all of it); None for any other value, or without a known
    context length."""
    if lax_int(body.get("truncate_prompt_tokens")) != -1:
        return None
    return kept_tokens(body, context_length, chat=True)


def _asks_no_output(body: Mapping[str, Any], chat: bool) -> bool:
    """Whether vLLM 0.34 tokenizes the prompt of ``body`` with ``max_output_tokens`` 0 (then
    truncating to the whole context): a chat's ``max_completion_tokens``, else its
    ``max_tokens`` (``ChatCompletionRequest.build_tok_params``), or a completion's
    ``max_tokens`` (``CompletionRequest.build_tok_params``: ``max_tokens or 0``, a null
    being its default 16) of 0; a Responses API body's chat carries its
    ``max_output_tokens`` as ``max_completion_tokens`` (router.tokenize.responses)."""
    found = body.get("max_completion_tokens") if chat else None
    if found is None:
        found = body.get("max_tokens")
    return found is not None and lax_int(found) == 0


def truncated(tokens: Any, keep: int, body: Mapping[str, Any]) -> Any:
    """``tokens`` cut to ``keep`` as vLLM cuts them: the last ``keep`` (truncation side
    "left", the default), or the first with a request's ``"truncation_side": "right"``."""
    side = body.get("truncation_side")
    if side is None or side == "left":
        return tokens[-keep:] if keep < len(tokens) else tokens
    if side == "right":
        return tokens[:keep]
    raise BadRequest('\'truncation_side\' must be "left" or "right"')


def adds_special_tokens(body: Mapping[str, Any], chat: bool) -> bool:
    """vLLM's ``add_special_tokens``: the tokenizer's special tokens (a BOS) added to the
    prompt; false by default for chat (the template writes them), true for completions.
    Read as vLLM's request models read it (``"no"`` and ``0`` are false: lax_bool)."""
    if "add_special_tokens" not in body:
        return not chat
    add = lax_bool(body["add_special_tokens"])
    if add is None or add is INVALID:
        raise BadRequest("'add_special_tokens' must be a boolean")
    return add


def sends_template(body: Mapping[str, Any]) -> bool:
    """Whether a chat body brings a chat template of its own: ``chat_template``, or one in
    ``chat_template_kwargs``. vLLM 0.34 refuses such a request unless it runs with
    ``--trust-request-chat-template`` (``OnlineRenderer.validate_chat_template``), and then
    renders it with that template (``ChatParams.chat_template``; the one in the kwargs when
    the engine has no ``--chat-template``), which the router does not run: an arbitrary
    template from a client is not the router's to execute."""
    if body.get("chat_template") is not None:
        return True
    kwargs = body.get("chat_template_kwargs")
    return isinstance(kwargs, Mapping) and kwargs.get("chat_template") is not None


# apply_chat_template's own parameters (transformers 5.22, the newest vLLM 0.34 takes):
# a template kwarg of one of these names is consumed by it (continue_final_message as the
# request's: vLLM puts the request's flag over the kwargs') and never reaches the template
# as a variable (tools, documents and add_generation_prompt it hands over itself)
_APPLY_ARGUMENTS = frozenset(
    {
        "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


# apply_chat_template's arguments that change the ids it makes when it tokenizes (transformers
# 5.22 ``apply_chat_template``: truncated, padded, control tokens sanitised, or another shape)
_TOKENIZING_ARGUMENTS = frozenset(_APPLY_ARGUMENTS - {"continue_final_message", "tokenize"})


def tokenizes_in_template(body: Mapping[str, Any], prompt_embeds: bool = False) -> bool:
    """Whether vLLM 0.34 has the template step tokenize a chat (``tokenize`` True reaching
    ``apply_chat_template``): the request's ``chat_template_kwargs.tokenize`` (not null nor
    "auto": ``merge_kwargs``), else the engine's (``OnlineRenderer.preprocess_chat`` sets
    ``tokenize`` for a Mistral tokenizer or ``--enable-prompt-embeds``: ``prompt_embeds``;
    an engine's ``--default-chat-template-kwargs`` ``tokenize`` is overridden by that).
    transformers then encodes the rendered text with ``add_special_tokens=False`` and vLLM
    runs the ids through ``apply_post_tokenization``: no BOS whatever the request's
    ``add_special_tokens``, ``truncate_prompt_tokens`` cut from the ids."""
    kwargs = body.get("chat_template_kwargs")
    found = kwargs.get("tokenize") if isinstance(kwargs, Mapping) else None
    if found is None or found == "auto":
        return prompt_embeds
    return bool(found)


def tokenizing_arguments(body: Mapping[str, Any]) -> bool:
    """Whether a chat's ``chat_template_kwargs`` set an ``apply_chat_template`` argument that,
    when the template step tokenizes (:func:`tokenizes_in_template`), changes the ids it
    makes (truncation, padding, control-token sanitising, tensors): not reproduced."""
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, Mapping) or _TOKENIZING_ARGUMENTS.isdisjoint(kwargs):
        return False
    return any(
        kwargs[k] not in (None, False, "auto") for k in _TOKENIZING_ARGUMENTS & kwargs.keys()
    )


def check_messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest(
            "'messages' is a required property",
        )
    if not isinstance(messages, list):
        raise BadRequest("'messages' must be an array of message objects")
    if not messages:
        raise BadRequest("'messages' must contain at least one message")
    for i, m in enumerate(messages):
        # type() checks first: JSON bodies hold plain dicts/strs, and isinstance against the
        # Mapping ABC is slow, once per message of sessions with thousands of messages.
        if type(m) is not dict and not isinstance(m, Mapping):
            raise BadRequest(f"messages[{i}] must be an object")
        if type(m.get("role")) is not str:
            raise BadRequest(f"messages[{i}].role must be a string")
        c = m.get("content")
        if c is not None and type(c) is not str and not isinstance(c, str):
            if not isinstance(c, list):
                raise BadRequest(f"messages[{i}].content must be a string or an array")
            for j, part in enumerate(c):
                # string parts and parts without text are accepted (content_text skips them)
                if isinstance(part, Mapping):
                    t = part.get("text")
                    if t is not None and type(t) is not str:
                        raise BadRequest(f"'messages[{i}].content[{j}].text' must be a string")
        # hashed into the incremental cache's message keys and read by templates
        n = m.get("name")
        if n is not None and type(n) is not str:
            raise BadRequest(f"'messages[{i}].name' must be a string")
        n = m.get("tool_call_id")
        if n is not None and type(n) is not str:
            raise BadRequest(f"'messages[{i}].tool_call_id' must be a string")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array")
    return messages


def chat_args(
    body: Mapping[str, Any],
    default_kwargs: Mapping[str, Any],
    effort_map: Mapping[str, str],
    exclude_tools_when_none: bool = False,
    over_defaults: bool = True,
    keep_empty_tools: bool = False,
) -> tuple[list[Mapping[str, Any]], Any, Mapping[str, Any], bool, bool]:
    """(messages, tools as vLLM dumps them, template kwargs, add_generation_prompt,
    continue_final_message) of a chat request, checked: the template's variables as vLLM
    0.34 builds them (``ChatCompletionRequest.build_chat_params``): the request's
    ``chat_template_kwargs`` over the engine's defaults (``default_kwargs``; a request's null
    or "auto" leaves the default, or reaches no template: vLLM's chat and Messages paths
    merge over defaults that always hold ``tokenize``; ``over_defaults`` False: a Responses
    API request's chat, which vLLM merges only over configured defaults), its
    ``reasoning_effort`` (rewritten by ``effort_map``) and the ``enable_thinking`` it
    implies, its ``documents``; no tools for an empty ``tools`` array (unless ``tool_choice``
    names one: vLLM refuses that; or ``keep_empty_tools``: the chat vLLM builds from an
    Anthropic Messages API request, whose tools it sets after validation, so an empty list
    reaches the template), nor for a ``tool_choice`` of ``"none"`` when the engine
    runs with ``--exclude-tools-when-tool-choice-none`` (``exclude_tools_when_none``; vLLM
    0.34 ``OnlineRenderer``)."""
    messages = check_messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise BadRequest("'chat_template_kwargs' must be an object")
    effort, documents = body.get("reasoning_effort"), body.get("documents")
    if effort is not None or documents is not None:
        extra: dict[str, Any] = {}
        if effort is not None:
            if not isinstance(effort, str):
                raise BadRequest("'reasoning_effort' must be a string")
            effort = effort_map.get(effort, effort)
            extra["reasoning_effort"] = effort
            if "enable_thinking" not in kwargs:
                extra["enable_thinking"] = effort != "none"
        if documents is not None:
            if not isinstance(documents, list):
                raise BadRequest("'documents' must be an array of objects")
            extra["documents"] = documents
        kwargs = {**kwargs, **extra}
    if default_kwargs or over_defaults:
        unset = {k for k, v in kwargs.items() if v is None or v == "auto"}
        kwargs = {**default_kwargs, **{k: kwargs[k] for k in kwargs if k not in unset}}
    if not _APPLY_ARGUMENTS.isdisjoint(kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_ARGUMENTS}
    # vLLM's check_generation_prompt runs on the values as sent, before they are read
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise BadRequest(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    add_gen = lax_bool(body.get("add_generation_prompt", True))
    cont = lax_bool(body.get("continue_final_message", False))
    if add_gen is None or add_gen is INVALID or cont is None or cont is INVALID:
        raise BadRequest("'add_generation_prompt' and 'continue_final_message' are booleans")
    if cont and add_gen:
        # add_generation_prompt left at its default (true), or sent as a lax true: vLLM
        # renders with both, and transformers' apply_chat_template refuses that (vLLM
        # answers 400); the prompt the router would render is none the engine runs
        raise BadRequest(
            "continue_final_message and add_generation_prompt are not compatible: "
            "send add_generation_prompt false to continue the final message"
        )
    tools = body.get("tools")
    tool_choice = body.get("tool_choice")
    if tools == [] and not keep_empty_tools and not isinstance(tool_choice, Mapping):
        # vLLM's request model reads an empty array as no tools, as OpenAI does
        # (``ChatCompletionRequest.check_tool_usage``): the template sees null
        tools = None
    if exclude_tools_when_none and tool_choice == "none":
        tools = None
    tools, kwargs = _template_tools(body, prepare_tools(tools), kwargs, default_kwargs)
    return messages, tools, kwargs, add_gen, cont


def _template_tools(
    body: Mapping[str, Any],
    tools: Any,
    kwargs: Mapping[str, Any],
    default_kwargs: Mapping[str, Any],
) -> tuple[Any, Mapping[str, Any]]:
    """(the tools the template gets, the other template kwargs): a ``tools`` in the
    request's ``chat_template_kwargs`` (not null nor "auto") over the request's own
    ``tools`` (``tools``, as vLLM dumps them) over a ``tools`` in the engine's default
    kwargs. vLLM 0.34's ``OnlineRenderer.preprocess_chat`` merges the request's tools over
    the defaults (``merge_kwargs``: a null leaves them), then the request's kwargs over both
    (``ChatParams.with_defaults``), and ``HfRenderer.render_messages`` reads the template
    (the ``tool_use`` one), the content format and ``apply_chat_template``'s ``tools`` from
    that one merged ``tools``. transformers' ``render_jinja_template`` takes each element as
    a tool, refusing any that is not an object (vLLM answers 400); so does the router."""
    own = body.get("chat_template_kwargs")
    sent = own.get("tools") if isinstance(own, Mapping) else None
    if sent is not None and sent != "auto":
        tools = _tool_list(sent)
    elif tools is None and default_kwargs.get("tools") is not None:
        tools = _tool_list(default_kwargs["tools"])
    if "tools" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "tools"}
    return tools, kwargs


def _tool_list(tools: Any) -> list[Any]:
    """``tools`` from template kwargs as transformers iterates them: the objects of an
    array (an empty string or object is no tool); BadRequest for anything else."""
    if isinstance(tools, (list, str, Mapping)) and all(isinstance(t, Mapping) for t in tools):
        return list(tools) if isinstance(tools, list) else []
    raise BadRequest("'chat_template_kwargs.tools' must be an array of objects")


# vLLM 0.34 chat_message.py: the content part types that carry no media
# (``_TEXT_CONTENT_PART_TYPES``) and the keys that mark a part as media whatever its type
# (``_MEDIA_CONTENT_PART_KEYS``: its ``MM_PARSER_MAP``'s other types)
_TEXT_PART_TYPES = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
_MEDIA_PART_KEYS = frozenset(
    {
        "input_image", "image_url", "image_embeds", "audio_embeds", "video_embeds",
        "prompt_embeds", "image_pil", "audio_url", "input_audio", "video_url",
    }
)  # fmt: skip


def has_non_text_content(messages: Any) -> bool:
    """vLLM 0.34's ``has_non_text_content`` (renderers/chat_utils/chat_message.py): a
    content part that is media (a media key, or a type other than the text ones), or a
    reasoning given as prompt embeddings."""
    if not isinstance(messages, list):
        return False
    for msg in messages:
        if not isinstance(msg, Mapping):
            continue
        for key in ("reasoning", "reasoning_content"):
            reasoning = msg.get(key)
            if isinstance(reasoning, Mapping) and reasoning.get("type") == "prompt_embeds":
                return True
        content = msg.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, Mapping) and (
                not _MEDIA_PART_KEYS.isdisjoint(part)
                or not isinstance(kind := part.get("type", "text"), str)
                or kind not in _TEXT_PART_TYPES
            ):
                return True
    return False


def forwarded_prompt_ids(body: Mapping[str, Any], messages: Sequence[Any]) -> list[int] | None:
    """The prompt token ids a chat body forwards in ``kv_transfer_params`` that vLLM 0.34
    runs instead of rendering ``messages`` (``online_renderer._reused_prompt_token_ids``,
    the decode side's reuse of a prefill's tokens; any client may send them): None when
    there are none, when the body asks ``echo`` or the messages have non-text content
    (:func:`has_non_text_content`: vLLM renders those). BadRequest, as vLLM answers, for
    anything but a non-empty array of non-negative integers."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, Mapping):
        return None
    ids = params.get("prompt_token_ids")
    if ids is None or lax_bool(body.get("echo", False)) is True:
        return None
    if has_non_text_content(messages if isinstance(messages, list) else list(messages)):
        return None
    # bool is an int subclass, hence the exact type check (as vLLM checks)
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise BadRequest(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list "
            "of non-negative integers."
        )
    return ids


def asks_prompt_logprobs(body: dict[str, Any], kind: str | None) -> bool:
    """Whether the parsed body of ``kind`` (``chat`` / ``completion``) asks prompt logprobs:
    ``prompt_logprobs``, or ``echo`` with chat's ``top_logprobs`` (default 0) / completions'
    ``logprobs`` (vLLM 0.34's ``to_sampling_params``). vLLM then reads no prefix cache for
    it (``SamplingParams.skip_reading_prefix_cache``), and no transferred KV. An Anthropic
    Messages API body (``messages``) and a Responses API one (``responses``) ask none: vLLM's
    request models have no such field."""
    if kind in ("messages", "responses"):
        return False
    if body.get("prompt_logprobs") is not None:
        return True
    if lax_bool(body.get("echo")) is True:
        echoed = body.get("top_logprobs", 0) if kind == "chat" else body.get("logprobs")
        return echoed is not None
    return False


def sampled_sequences(body: Mapping[str, Any], kind: str) -> int:
    """How many sequences the engine samples for each prompt: a chat or completion body's
    ``n`` (read as vLLM reads it: ``"2"`` and ``2.0`` are 2), at most ``MAX_SAMPLES`` for
    the load view; 1 for the other kinds and for a value the engine will refuse (it answers
    that itself)."""
    if kind not in ("chat", "completion"):
        return 1
    n = lax_int(body.get("n"))
    return min(n, MAX_SAMPLES) if type(n) is int and n > 1 else 1


def default_mm_lora(body: Mapping[str, Any], loras: AbstractSet[str]) -> str | None:
    """The adapter vLLM 0.34 serves a chat request for the base model with, of ``loras`` (the
    adapters its ``--default-mm-loras`` loads): the one whose name is among the types of the
    messages' content parts (a type up to its first "_", or after an "input_" prefix:
    ``OpenAIServing._get_message_types``), None if none or several are (vLLM's rule). Chat
    completions (and the Messages API, which vLLM serves as a chat); a body without
    ``messages`` (a completion) has none."""
    messages = body.get("messages")
    if not loras or not isinstance(messages, list):
        return None
    found: set[str] = set()
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if isinstance(kind, str):
                name = kind[6:] if kind.startswith("input_") else kind.split("_")[0]
                if name in loras:
                    found.add(name)
    return found.pop() if len(found) == 1 else None
