"""Chat requests -> the routing view (:class:`ProcessedPrompt`): the per-model processor.

One :class:`PromptProcessor` per model; callers construct it and ask it for every kind of
prompt. Chat requests (:meth:`PromptProcessor.chat`) are handled here: their fields read as
vLLM reads them (:func:`router.tokenize.request_fields.chat_args`), rendered with the model's
chat template and tokenized incrementally (a long conversation with a message-local template
renders only the messages a cached one does not hold: ``_chat_local``), image parts expanded
and keyed as the engine keys them and a medium the router cannot place hashed up to where it
starts (the base class router.tokenize.image_prompts ``ImagePrompts``). Everything else a
prompt is keyed with - the
chain's root, BOS and truncation, completion requests, token ids, engine-rendered prompts,
approximate and size-only views - comes from the base class
:class:`router.tokenize.keying.PromptKeying`.

Without a tokenizer, or without a chat template (rendered then by a stand-in), chats are
processed in *approximate* mode (:mod:`router.tokenize.approx`). The request body has been
parsed as JSON by the caller; only the fields read here are validated, with
:class:`BadRequest` saying which one is wrong.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from router.core.hashing import hash_prompt
from router.tokenize.approx import DEFAULT_CHARS_PER_TOKEN
from router.tokenize.cache_entries import message_keys, text_bytes
from router.tokenize.content_format import content_text
from router.tokenize.image_prompts import IMAGE_MARKER, ImagePrompts
from router.tokenize.incremental import MIN_CACHED_CHARS, IncrementalTokenizer
from router.tokenize.keying import ProcessedPrompt
from router.tokenize.lax import lax_int
from router.tokenize.multimodal import (
    ImageSettings,
    first_unmodelled,
    has_images,
)
from router.tokenize.request_fields import (
    adds_special_tokens,
    chat_args,
    check_messages,
    forwarded_prompt_ids,
    kept_to_context,
    kept_tokens,
    sends_template,
    tokenizes_in_template,
    tokenizing_arguments,
)
from router.tokenize.responses import is_harmony

if TYPE_CHECKING:
    # Jinja2 and the template machinery load only for a model with a chat template
    # (router/service/prompts.py builds it at start-up); without one nothing here runs them
    from router.tokenize.local_template import LocalTemplate, RenderedParts
    from router.tokenize.template import ChatTemplate


def _simple_render(messages: Sequence[Mapping[str, Any]], tools: Any) -> str:
    """Stand-in rendering for approximate mode when no chat template is configured."""
    parts = [json.dumps(tools, sort_keys=True)] if tools else []
    for m in messages:
        parts.append(f"<{m.get('role')}>{content_text(m.get('content')) or ''}")
        if m.get("tool_calls"):
            parts.append(json.dumps(m["tool_calls"], sort_keys=True))
    return "\n".join(parts)


def _key_context(
    tools: Any,
    kwargs: Mapping[str, Any],
    add_gen: bool,
    cont: bool = False,
    from_responses: bool = False,
) -> dict[str, Any]:
    """What besides the messages selects a cached conversation (part of message keys)."""
    context = {"tools": tools, "kwargs": kwargs, "gen": add_gen}
    if cont:
        context["cont"] = True
    if from_responses:
        context["from_responses"] = True
    return context


def _content_size(messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """Characters of the messages' text content (string contents and text parts), and the
    bytes the tokenizer cache's budget counts them at (:func:`text_bytes`; text parts at
    twice their size: as sent, and joined into one string in the prepared messages)."""
    chars = nbytes = 0
    for m in messages:
        c = m.get("content")
        if type(c) is str:
            chars += len(c)
            nbytes += text_bytes(c)
        elif isinstance(c, list):
            for p in c:
                if isinstance(p, Mapping):
                    text = p.get("text") or ""
                    chars += len(text)
                    nbytes += 2 * sys.getsizeof(text)
    return chars, nbytes


class PromptProcessor(ImagePrompts):
    """Prompt processing for one model (see module docstring)."""

    def __init__(
        self,
        model: str,
        block_size: int,
        *,
        tokenizer: IncrementalTokenizer | None = None,
        template: ChatTemplate | None = None,
        add_bos_to_completions: bool = False,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        images: ImageSettings | None = None,
        default_kwargs: Mapping[str, Any] | None = None,
        effort_map: Mapping[str, str] | None = None,
        context_length: int | None = None,
        exclude_tools_when_none: bool = False,
        disabled_thinking_effort: str = "auto",
        mm_loras: Collection[str] = (),
        harmony: bool | None = None,
        prompt_embeds: bool = False,
    ) -> None:
        """``default_kwargs`` / ``effort_map`` / ``exclude_tools_when_none``: the engine's
        ``--default-chat-template-kwargs`` / ``--reasoning-effort-map`` /
        ``--exclude-tools-when-tool-choice-none``; ``images``: the model's image settings
        (router.tokenize.multimodal; None: a chat is hashed only up to its first image);
        ``disabled_thinking_effort``: its ``--anthropic-disabled-thinking-effort`` ("auto" or
        an effort; read by router.tokenize.anthropic); ``harmony``: vLLM renders the model's
        chats with openai_harmony, not its chat template (gpt-oss; None: judged by the
        model's name, :func:`is_harmony`); ``prompt_embeds``: the engine runs with
        ``--enable-prompt-embeds`` (its template step tokenizes: :func:`tokenizes_in_template`);
        the rest: :class:`PromptKeying`."""
        super().__init__(
            model,
            block_size,
            tokenizer=tokenizer,
            add_bos_to_completions=add_bos_to_completions,
            chars_per_token=chars_per_token,
            context_length=context_length,
            mm_loras=mm_loras,
        )
        self.template = template
        self.images = images
        self.default_kwargs = dict(default_kwargs or {})
        self.effort_map = dict(effort_map or {})
        self.exclude_tools_when_none = exclude_tools_when_none
        self.disabled_thinking_effort = disabled_thinking_effort
        self.harmony = is_harmony(model) if harmony is None else harmony
        self.prompt_embeds = prompt_embeds

    @property
    def exact(self) -> bool:
        """True when chat prompts are tokenized exactly (tokenizer and template present)."""
        return self.tokenizer is not None and self.template is not None

    # ------------------------------------------------------------------ chat

    def render_chat(
        self,
        body: Mapping[str, Any],
        *,
        from_responses: bool = False,
        from_messages: bool = False,
    ) -> tuple[str, list[int]]:
        """Rendered prompt text and message-prefix keys of a chat request (``from_responses``,
        ``from_messages``: see :meth:`chat`)."""
        text, messages, context = self._render(body, from_responses, from_messages)
        return text, message_keys(messages, context) if context is not None else []

    def _render(
        self, body: Mapping[str, Any], from_responses: bool = False, from_messages: bool = False
    ) -> tuple[str, list[Mapping[str, Any]], dict[str, Any] | None]:
        """Rendered text, the messages and the key context (None without a template)."""
        messages, tools, kwargs, add_gen, cont = self._chat_args(
            body, from_responses, from_messages
        )
        text, context = self._render_text(messages, tools, kwargs, add_gen, cont, from_responses)
        return text, messages, context

    def _render_text(
        self,
        messages: list[Mapping[str, Any]],
        tools: Any,
        kwargs: Mapping[str, Any],
        add_gen: bool,
        cont: bool = False,
        from_responses: bool = False,
    ) -> tuple[str, dict[str, Any] | None]:
        if self.template is None:
            return _simple_render(messages, tools), None
        prepared = self.template.prepare(messages, tools, from_responses)
        text = self.template.render(
            prepared,
            tools=tools,
            add_generation_prompt=add_gen,
            kwargs=kwargs,
            continue_final_message=cont,
        )
        return text, _key_context(tools, kwargs, add_gen, cont, from_responses)

    def _chat_args(
        self, body: Mapping[str, Any], from_responses: bool = False, from_messages: bool = False
    ) -> tuple[list[Mapping[str, Any]], Any, Mapping[str, Any], bool, bool]:
        """(messages, tools as vLLM dumps them, template kwargs, add_generation_prompt,
        continue_final_message), checked (router.tokenize.request_fields)."""
        return chat_args(
            body,
            self.default_kwargs,
            self.effort_map,
            self.exclude_tools_when_none,
            over_defaults=not from_responses,
            keep_empty_tools=from_messages,
        )

    def chat(
        self,
        body: Mapping[str, Any],
        *,
        from_responses: bool = False,
        from_messages: bool = False,
    ) -> ProcessedPrompt:
        """Routing view of a chat request; ``from_responses``: the chat vLLM builds from a
        Responses API request, which no chat request model validates (its assistant tool
        calls reach the template with their keys in their own order, not the chat request
        model's) and whose template kwargs are merged only over configured defaults;
        ``from_messages``: the chat vLLM builds from an Anthropic Messages API request (its
        tools set after validation: an empty list reaches the template as one).

        A body forwarding prompt token ids in ``kv_transfer_params`` that vLLM runs instead
        of the messages (:func:`forwarded_prompt_ids`) is keyed by those ids; the service
        hands a disaggregated model's bodies here without them (the router replaces them).
        A body with a chat template of its own (:func:`sends_template`: the engine refuses
        it, or renders with a template the router does not run) is known only by its size
        (:meth:`unknown`), once checked."""
        t0 = time.perf_counter()
        if self.harmony:
            # vLLM 0.34 renders a harmony model's chat with openai_harmony
            # (OnlineRenderer.render_chat's use_harmony branch, _make_request_with_harmony),
            # not the chat template: only ids it is forwarded (looked for whatever the
            # content) are known, else the prompt is known by its size alone
            check_messages(body)
            ids = forwarded_prompt_ids(body, [])
            return self.unknown(body) if ids is None else self.forwarded(ids, body, from_responses)
        tokenizer, template = self.tokenizer, self.template
        messages, tools, kwargs, add_gen, cont = self._chat_args(
            body, from_responses, from_messages
        )
        forwarded = forwarded_prompt_ids(body, messages)
        if forwarded is not None:  # the engine runs these ids, not the messages
            return self.forwarded(forwarded, body, from_responses)
        if sends_template(body):
            return self.unknown(body)
        if tokenizes_in_template(body, self.prompt_embeds):
            # transformers encodes the render without special tokens: no BOS, whatever the
            # request's add_special_tokens (checked all the same, as vLLM's request model
            # reads it); truncation cuts the ids (TokenizeParams.apply_post_tokenization)
            if tokenizing_arguments(body):
                return self.unknown(body)
            adds_special_tokens(body, chat=True)
            body = {**body, "add_special_tokens": False}
        unmodelled = first_unmodelled(messages)
        if unmodelled is not None:  # a medium the router cannot place: hashed up to it
            at = messages[unmodelled]
            marked = [*messages[:unmodelled], {**at, "content": IMAGE_MARKER}]
            if has_images(marked):  # images before it: expanded and keyed as the engine does
                return self._chat_images(
                    body, marked, tools, kwargs, add_gen, cont, t0, IMAGE_MARKER, from_responses
                )
            if kept_to_context(body, self.context_length) is not None:
                # its size unknown, so whether -1 cuts the prompt's start: nothing known
                return self.unknown(body)
            text, _ = self._render_text(marked, tools, kwargs, add_gen, cont, from_responses)
            return self._cut_before(text, IMAGE_MARKER, body, t0, from_responses)
        if has_images(messages):
            return self._chat_images(
                body, messages, tools, kwargs, add_gen, cont, t0, None, from_responses
            )
        broken: LocalTemplate | None = None
        # prompts cut or given a BOS are rendered whole, then adjusted (_engine_tokens);
        # so are those continuing the final message (the render's end is cut)
        bos = adds_special_tokens(body, chat=True) and self._bos_id is not None
        keep = kept_tokens(body, self.context_length, chat=True)
        # -1 (the context length) cuts only prompts longer than it: checked once rendered
        plain = (keep is None or lax_int(body.get("truncate_prompt_tokens")) == -1) and not bos
        if (
            tokenizer is not None
            and template is not None
            and tokenizer.budget_bytes > 0
            and not cont
            and plain
            # developer messages merged into the first system one: no stable history
            and not template.converts_developer(messages, tools)
        ):
            local = template.local_for(tools)
            if local is not None:
                from router.tokenize.template import NotIncremental

                chars, content_bytes = _content_size(messages)
                if chars >= MIN_CACHED_CHARS:
                    try:
                        found = self._chat_local(
                            local,
                            body,
                            messages,
                            tools,
                            kwargs,
                            add_gen,
                            content_bytes,
                            from_responses,
                        )
                        if keep is None or found.prompt_tokens <= keep:
                            return found
                        plain = False  # over the context length: rendered whole and cut
                    except NotIncremental:
                        # rendered whole below (and refused there if it must be); when the
                        # plain render succeeds this counts against the instrumented form
                        # (LocalTemplate.failed: not tried again after a few in a row)
                        broken = local
        text, context = self._render_text(messages, tools, kwargs, add_gen, cont, from_responses)
        if broken is not None:
            broken.failed()
        render_s = time.perf_counter() - t0
        if tokenizer is None or template is None:
            return self._approximate(text, body, render_s, from_responses=from_responses)
        root, _ = self.root(body, from_responses)
        # message keys only serve the incremental cache, which short prompts skip
        keys = message_keys(messages, context) if len(text) >= MIN_CACHED_CHARS else []
        enc = tokenizer.encode(text, keys, root, self.block_size)
        if keep is not None and len(enc.tokens) > keep:
            plain = False
        tokens = enc.tokens if plain else self._engine_tokens(enc.tokens, body, chat=True)
        if tokens is not enc.tokens:
            t1 = time.perf_counter()
            hashes = hash_prompt(tokens, self.block_size, root).hashes
            return ProcessedPrompt(
                len(tokens), hashes, self.block_size, True, 0, t1 - t0, time.perf_counter() - t1
            )
        return ProcessedPrompt(
            len(enc.tokens),
            enc.hashes,
            self.block_size,
            True,
            enc.reused_tokens,
            render_s + enc.tokenize_s,
            enc.hash_s,
        )

    def head_hashes(
        self, body: Mapping[str, Any], count: int, *, from_responses: bool = False
    ) -> list[int]:
        """The block hashes of a chat of which only the first ``count`` messages of
        ``body`` are known, messages the router does not have following them (a Responses
        API request's stored history, vLLM's ``construct_input_messages``): the token ids
        the template writes before the next message whatever its role (those the renders
        with a user and with an assistant message next begin with, the last of them left
        out: it may merge with what follows), with the body's special tokens. None (no
        hashes) with a truncation (the unknown rest may have the engine cut the prompt's
        start), without a tokenizer or template, or when neither render succeeds."""
        tokenizer, template = self.tokenizer, self.template
        if tokenizer is None or template is None or body.get("truncate_prompt_tokens"):
            return []
        from router.tokenize.template import TemplateError

        head = list(check_messages(body)[:count]) if count else []
        ids: list[list[int]] = []
        for role in ("user", "assistant"):
            probe = {**body, "messages": [*head, {"role": role, "content": IMAGE_MARKER}]}
            try:
                text = self._render(probe, from_responses)[0]
            except TemplateError:
                continue
            ids.append(tokenizer.encode_text(text[: text.find(IMAGE_MARKER)]).tolist())
        if not ids:
            return []
        # compared as ids: a text cut inside a special token (``<|im_`` of ``<|im_user|>``
        # and ``<|im_assistant|>``) is not the start of its tokens
        same = min(map(len, ids))
        for i, column in enumerate(zip(*ids, strict=False)):
            if column.count(column[0]) != len(column):
                same = i
                break
        known = ids[0][: max(same - 1, 0)]
        tokens = self._engine_tokens(np.array(known, dtype=np.uint32), body, chat=True)
        root, _ = self.root(body, from_responses)
        return hash_prompt(tokens, self.block_size, root).hashes

    def _chat_local(
        self,
        local: LocalTemplate,
        body: Mapping[str, Any],
        messages: list[Mapping[str, Any]],
        tools: Any,
        kwargs: Mapping[str, Any],
        add_gen: bool,
        content_bytes: int,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        """A long conversation with a message-local template: render and tokenize only the
        messages a cached conversation does not hold (router.tokenize.local_template)."""
        from router.tokenize.template import NotIncremental

        tokenizer, template = self.tokenizer, self.template
        assert tokenizer is not None and template is not None
        t0 = time.perf_counter()
        keys = message_keys(messages, _key_context(tools, kwargs, add_gen, False, from_responses))
        # the instrumented template too: models sharing a tokenizer share its cache, and a
        # render state is only valid for the template that made it
        context = (tools, kwargs, add_gen, local, from_responses)
        root, _ = self.root(body, from_responses)
        bs = self.block_size
        out = None
        parts: RenderedParts | None = None  # the render ``out`` was encoded from
        prepared: list[Mapping[str, Any]]
        prefix = tokenizer.probe_local(messages, keys, context)
        if prefix is not None:
            start = prefix.start
            cached = prefix.prepared
            prepared = [*cached, *template.prepare(messages[len(cached) :], tools, from_responses)]
            try:
                parts = template.render_parts(
                    local,
                    prepared,
                    start,
                    resume=prefix.resume,
                    tools=tools,
                    add_generation_prompt=add_gen,
                    kwargs=kwargs,
                )
            except NotIncremental:
                pass  # from the first message below
            else:
                out = tokenizer.encode_local(parts, prefix, root, bs)
        if out is None:
            prepared = template.prepare(messages, tools, from_responses)
            parts = template.render_parts(
                local, prepared, 0, tools=tools, add_generation_prompt=add_gen, kwargs=kwargs
            )
            fallback = prefix.entry if prefix is not None else None
            out = tokenizer.encode_local(parts, None, root, bs, fallback)
            assert out is not None  # without a prefix there is nothing to refuse
            before: str | None = parts.head  # the text before this render's bodies
            # a cut a later turn can use, with the conversation ahead of it (not in the tail)
            size = len(parts.head) + len(parts.bodies) + len(parts.tail)
            local.observe(out[1] >= 0 and 2 * len(parts.tail) <= size)
        else:
            assert prefix is not None and parts is not None
            old = prefix.entry.text
            before = old[: prefix.entry.text_at] if old is not None else None
        enc, loop_idx = out
        text = None
        if parts.head_reads_end and parts.resume is not None and before is not None:
            # kept with the entry (see IncrementalTokenizer.remember_local)
            text = (before + parts.bodies + parts.tail, len(before) + parts.resume.offset)
        tokenizer.remember_local(
            keys[-1],
            messages,
            prepared,
            context,
            parts,
            enc,
            loop_idx,
            root,
            bs,
            content_bytes,
            text,
            extends=prefix,
        )
        total_s = time.perf_counter() - t0
        return ProcessedPrompt(
            len(enc.tokens),
            enc.hashes,
            bs,
            True,
            enc.reused_tokens,
            total_s - enc.hash_s,
            enc.hash_s,
        )
