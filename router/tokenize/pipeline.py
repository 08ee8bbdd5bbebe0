"""Request body -> what the routing core needs: prompt token count and canonical block hashes.

One :class:`PromptProcessor` per model. Chat requests are rendered with the model's chat
template and tokenized incrementally; completion requests with token-id prompts skip
tokenization. Without a tokenizer the processor runs in *approximate* mode
(:mod:`router.tokenize.approx`). The request body has been parsed as JSON by the caller; only
the fields read here are validated, with :class:`BadRequest` saying which one is wrong.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from router.core.errors import BadRequest
from router.core.hashing import MmItem, as_u32_array, hash_prompt, mm_block_extras, root_hash
from router.tokenize.approx import (
    DEFAULT_CHARS_PER_TOKEN,
    approx_hashes,
    approx_root,
    approx_tokens,
)
from router.tokenize.content_format import content_text
from router.tokenize.incremental import (
    MIN_CACHED_CHARS,
    IncrementalTokenizer,
    message_keys,
)
from router.tokenize.lax import lax_int
from router.tokenize.local_template import LocalTemplate, RenderedParts
from router.tokenize.multimodal import (
    ExpandedImages,
    ImageSettings,
    expand_images,
    first_unmodelled,
    has_images,
    image_urls,
    image_uuids,
    marked_images,
    own_image_kwargs,
    with_placeholders,
)
from router.tokenize.request_fields import (
    adds_special_tokens,
    chat_args,
    default_mm_lora,
    kept_tokens,
    sends_template,
    truncated,
)
from router.tokenize.template import (
    ChatTemplate,
    NotIncremental,
)


@dataclass(slots=True, frozen=True)
class ProcessedPrompt:
    """The routing view of one request's prompt.

    ``exact``: tokens come from the model's tokenizer (or the request's own token ids);
    False in approximate mode. ``reused_tokens``: taken from the incremental cache. For a
    batch of completion prompts (all sent to one replica) ``block_hashes`` are the longest
    prompt's and ``prompt_tokens`` counts them all.
    ``tokenize_s`` covers template rendering and tokenization, ``hash_s`` block hashing.
    """

    prompt_tokens: int
    block_hashes: list[int]
    block_size: int
    exact: bool
    reused_tokens: int = 0
    tokenize_s: float = 0.0
    hash_s: float = 0.0
    # the longest single prompt (what must fit the model's context); 0: ``prompt_tokens``.
    # Differs for a batch of completion prompts, whose ``prompt_tokens`` is their sum.
    longest_tokens: int = 0
    # a stand-in for what the engine would have rendered (router/service/render.py): not
    # kept by the body memo
    provisional: bool = False
    # False when the engine reads no prefix cache for the request (vLLM: prompt logprobs
    # asked): no replica's cache shortens it, though its blocks are cached as computed
    reads_cache: bool = True
    # prompts sent together (a batch of completion prompts) and sequences sampled for each
    # (the body's ``n``, set by the request handler): what the engine decodes
    prompts: int = 1
    samples: int = 1
    # a batch's prompts, each (prompt_tokens, block_hashes) in the body's order (the live-
    # traffic trace records one row each: router/recorder.py); empty for a single prompt
    batch: tuple[tuple[int, list[int]], ...] = ()

    @property
    def context_tokens(self) -> int:
        return self.longest_tokens or self.prompt_tokens


# stands for an image in the text when the model has no image settings (a private-use char)
_IMAGE_MARKER = "\ue000"


def _simple_render(messages: Sequence[Mapping[str, Any]], tools: Any) -> str:
    """Stand-in rendering for approximate mode when no chat template is configured."""
    parts = [json.dumps(tools, sort_keys=True)] if tools else []
    for m in messages:
        parts.append(f"<{m.get('role')}>{content_text(m.get('content')) or ''}")
        if m.get("tool_calls"):
            parts.append(json.dumps(m["tool_calls"], sort_keys=True))
    return "\n".join(parts)


def _all_ints(values: list[Any]) -> bool:
    """Every element a JSON integer (``bool`` is not one). One C-level pass over the types:
    token-id prompts run to a million elements."""
    return set(map(type, values)) == _INT_ONLY


_INT_ONLY = {int}


def _batch(entries: Sequence[ProcessedPrompt]) -> ProcessedPrompt:
    """One routing view of several prompts sent together: the longest prompt's hashes (its
    prefill dominates; the replica that holds it is the best home for the batch), every
    prompt's tokens counted (the replica prefills them all)."""
    if len(entries) == 1:
        return entries[0]
    longest = max(entries, key=lambda e: e.prompt_tokens)
    return replace(
        longest,
        prompt_tokens=sum(e.prompt_tokens for e in entries),
        tokenize_s=sum(e.tokenize_s for e in entries),
        hash_s=sum(e.hash_s for e in entries),
        longest_tokens=longest.prompt_tokens,
        prompts=len(entries),
        batch=tuple((e.prompt_tokens, e.block_hashes) for e in entries),
    )


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


def _content_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of the messages' text content (string contents and text parts)."""
    n = 0
    for m in messages:
        c = m.get("content")
        if type(c) is str:
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(p.get("text") or "") for p in c if isinstance(p, Mapping))
    return n


class PromptProcessor:
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
    ) -> None:
        """``default_kwargs`` / ``effort_map`` / ``exclude_tools_when_none``: the engine's
        ``--default-chat-template-kwargs`` / ``--reasoning-effort-map`` /
        ``--exclude-tools-when-tool-choice-none``; ``context_length``: its
        ``--max-model-len`` (``truncate_prompt_tokens: -1`` truncates to it);
        ``disabled_thinking_effort``: its ``--anthropic-disabled-thinking-effort`` ("auto" or
        an effort; read by router.tokenize.anthropic); ``mm_loras``: the adapters its
        ``--default-mm-loras`` loads (:meth:`mm_lora`)."""
        self.model = model
        self.context_length = context_length
        self.images = images
        self.default_kwargs = dict(default_kwargs or {})
        self.effort_map = dict(effort_map or {})
        self.exclude_tools_when_none = exclude_tools_when_none
        self.disabled_thinking_effort = disabled_thinking_effort
        self.mm_loras = frozenset(mm_loras)
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.template = template
        self.chars_per_token = chars_per_token
        self._bos_id: int | None = None
        self._root = root_hash(model, None)
        if tokenizer is not None and add_bos_to_completions:
            bos = tokenizer.tokenizer.bos_token
            self._bos_id = tokenizer.tokenizer.special_tokens.get(bos) if bos else None

    @property
    def exact(self) -> bool:
        """True when chat prompts are tokenized exactly (tokenizer and template present)."""
        return self.tokenizer is not None and self.template is not None

    def root(self, body: Mapping[str, Any], from_responses: bool = False) -> tuple[int, str | None]:
        """The root of the request's chain (its cache salt and :meth:`mm_lora`) and the salt."""
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise BadRequest("'cache_salt' must be a string")
        lora = self.mm_lora(body, from_responses) if self.mm_loras else None
        if salt is None and lora is None:
            return self._root, None
        return root_hash(self.model, salt, lora), salt

    def mm_lora(self, body: Mapping[str, Any], from_responses: bool = False) -> str | None:
        """The adapter of ``mm_loras`` (vLLM's ``--default-mm-loras``) vLLM serves this chat
        request with (:func:`default_mm_lora`); None for a Responses API request
        (``from_responses``), which vLLM serves without."""
        return None if from_responses else default_mm_lora(body, self.mm_loras)

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

        A body with a chat template of its own (:func:`sends_template`: the engine refuses
        it, or renders with a template the router does not run) is known only by its size
        (:meth:`unknown`), once checked."""
        t0 = time.perf_counter()
        tokenizer, template = self.tokenizer, self.template
        messages, tools, kwargs, add_gen, cont = self._chat_args(
            body, from_responses, from_messages
        )
        if sends_template(body):
            return self.unknown(body)
        unmodelled = first_unmodelled(messages)
        if unmodelled is not None:  # a medium the router cannot place: hashed up to it
            at = messages[unmodelled]
            marked = [*messages[:unmodelled], {**at, "content": _IMAGE_MARKER}]
            if has_images(marked):  # images before it: expanded and keyed as the engine does
                return self._chat_images(
                    body, marked, tools, kwargs, add_gen, cont, t0, _IMAGE_MARKER, from_responses
                )
            text, _ = self._render_text(marked, tools, kwargs, add_gen, cont, from_responses)
            return self._cut_before(text, _IMAGE_MARKER, body, t0, from_responses)
        if has_images(messages):
            return self._chat_images(
                body, messages, tools, kwargs, add_gen, cont, t0, None, from_responses
            )
        broken: LocalTemplate | None = None
        # prompts cut or given a BOS are rendered whole, then adjusted (_engine_tokens);
        # so are those continuing the final message (the render's end is cut)
        bos = adds_special_tokens(body, chat=True) and self._bos_id is not None
        keep = kept_tokens(body, self.context_length)
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
                chars = _content_chars(messages)
                if chars >= MIN_CACHED_CHARS:
                    try:
                        found = self._chat_local(
                            local, body, messages, tools, kwargs, add_gen, chars, from_responses
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

    def _chat_images(
        self,
        body: Mapping[str, Any],
        messages: list[Mapping[str, Any]],
        tools: Any,
        kwargs: Mapping[str, Any],
        add_gen: bool,
        cont: bool,
        t0: float,
        cut_at: str | None = None,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        """A chat request with image parts (router.tokenize.multimodal): placeholders as the
        engine renders them, each expanded to the image's token count and keyed with its
        hash in the block where it starts. Blocks from an image the router cannot hash (no
        image settings for the model, an URL it does not fetch, a request's own
        ``mm_processor_kwargs`` or image ``media_io_kwargs``: ``own_image_kwargs``) on are
        left out; so are those from ``cut_at`` on (a text in ``messages`` standing for a
        message the router cannot place), and the prompt is then not exact."""
        tokenizer, template, settings = self.tokenizer, self.template, self.images
        if own_image_kwargs(body):
            settings = None
        if kept_tokens(body) is not None or (
            adds_special_tokens(body, chat=True) and self._bos_id is not None
        ):  # ids cut or shifted around the images: not modelled, routed on load
            return self.unknown(body)
        marker = settings.placeholder if settings is not None else _IMAGE_MARKER
        with_ph, urls = self._placed(messages, tools, marker, settings is not None)
        text, _ = self._render_text(with_ph, tools, kwargs, add_gen, cont, from_responses)
        if tokenizer is None or template is None or settings is None:
            # nothing known from the first image on
            return self._cut_before(text, marker, body, t0, from_responses)
        root, _ = self.root(body, from_responses)
        rest = 0  # tokens after ``cut_at``, not hashed
        if cut_at is not None and (cut := text.find(cut_at)) >= 0:
            # (the last token before it may merge with what follows: left out)
            tokens = tokenizer.encode_text(text[:cut])[:-1]
            rest = len(tokenizer.encode_text(text[cut:]))
        else:
            tokens = tokenizer.encode_text(text)
        t1 = time.perf_counter()
        bs = self.block_size
        found = self._expand(tokens, messages, urls, settings)
        expanded, items, known_until = found.tokens, found.items, found.known_until
        hashed = expanded if known_until is None else expanded[:known_until]
        extras = mm_block_extras(items, bs) if items else None
        hashes = hash_prompt(hashed, bs, root, extras=extras).hashes
        return ProcessedPrompt(
            len(expanded) + rest,
            hashes,
            bs,
            known_until is None and cut_at is None,
            0,
            t1 - t0,
            time.perf_counter() - t1,
        )

    def _placed(
        self, messages: list[Mapping[str, Any]], tools: Any, marker: str, settings: bool
    ) -> tuple[list[Mapping[str, Any]], list[str]]:
        """Messages with each image placed as the template's content format places it, and
        the image URLs in prompt order: in the "openai" format the template places
        ``{"type": "image"}`` parts itself (without ``settings`` a text ``marker`` where the
        first image is finds the prompt before it); else ``marker`` goes into string content
        (:func:`with_placeholders`)."""
        template = self.template
        if template is not None and template.content_format_for(tools) == "openai":
            urls = image_urls(messages)
            return (messages if settings else marked_images(messages, marker)), urls
        return with_placeholders(messages, marker)

    def _expand(
        self,
        tokens: np.ndarray,
        messages: Sequence[Mapping[str, Any]],
        urls: Sequence[str],
        settings: ImageSettings,
    ) -> ExpandedImages:
        assert self.tokenizer is not None
        token_id = self.tokenizer.tokenizer.special_tokens[settings.token]
        model_id = settings.model_id or self.model
        return expand_images(tokens, token_id, urls, image_uuids(messages), settings, model_id)

    def image_prompt(
        self,
        body: Mapping[str, Any],
        *,
        from_responses: bool = False,
        from_messages: bool = False,
    ) -> ExpandedImages:
        """The token ids of a chat with images as the engine runs them (placed, rendered and
        expanded as :meth:`chat` does for its hashes) and its images, for a processor with a
        tokenizer, a template and image settings (the mock replica's engine side). The
        request's own image kwargs, truncation and special tokens are not applied."""
        settings, template = self.images, self.template
        if settings is None or template is None or self.tokenizer is None:
            raise ValueError("image_prompt needs a tokenizer, a template and image settings")
        messages, tools, kwargs, add_gen, cont = self._chat_args(
            body, from_responses, from_messages
        )
        with_ph, urls = self._placed(messages, tools, settings.placeholder, True)
        text, _ = self._render_text(with_ph, tools, kwargs, add_gen, cont, from_responses)
        tokens = self.tokenizer.encode_text(text)
        return self._expand(tokens, messages, urls, settings)

    def _cut_before(
        self,
        text: str,
        marker: str,
        body: Mapping[str, Any],
        t0: float,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        """Routing view of a rendered prompt known only up to ``marker`` (where a medium
        the router cannot expand starts): the blocks before it, not exact."""
        tokenizer = self.tokenizer
        if tokenizer is None or self.template is None:
            return self._approximate(
                text, body, time.perf_counter() - t0, cut_at=marker, from_responses=from_responses
            )
        root, _ = self.root(body, from_responses)
        tokens = tokenizer.encode_text(text)
        t1 = time.perf_counter()
        cut = len(tokenizer.encode_text(text[: text.find(marker)])) - 1
        hashes = hash_prompt(tokens[: max(cut, 0)], self.block_size, root).hashes
        return ProcessedPrompt(
            len(tokens), hashes, self.block_size, False, 0, t1 - t0, time.perf_counter() - t1
        )

    def _chat_local(
        self,
        local: LocalTemplate,
        body: Mapping[str, Any],
        messages: list[Mapping[str, Any]],
        tools: Any,
        kwargs: Mapping[str, Any],
        add_gen: bool,
        chars: int,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        """A long conversation with a message-local template: render and tokenize only the
        messages a cached conversation does not hold (router.tokenize.local_template)."""
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
            chars,
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

    # ------------------------------------------------------------------ completions

    def completion(self, body: Mapping[str, Any]) -> ProcessedPrompt:
        """Routing view of a completion request. A batch (several prompts, answered by one
        replica) is routed by its longest prompt and counted with all its tokens.

        ``prompt_embeds`` (vLLM: one base64 tensor or a list, run before the text prompts in
        the same batch) cannot be hashed: each is one more prompt of the batch (its decode
        sequences counted, its prefill not), the text prompts are routed as without them,
        and the view is not exact (the engine's usage counts tokens the router did not)."""
        embeds = body.get("prompt_embeds")
        embedded = 0 if embeds is None else len(embeds) if isinstance(embeds, list) else 1
        if not embedded:
            return self._completion_text(body)
        prompt = body.get("prompt")
        if prompt is None or (isinstance(prompt, list) and not prompt):
            return ProcessedPrompt(0, [], self.block_size, False, prompts=embedded)
        text = self._completion_text(body)
        return replace(text, exact=False, prompts=text.prompts + embedded)

    def _completion_text(self, body: Mapping[str, Any]) -> ProcessedPrompt:
        """:meth:`completion` of the body's ``prompt``."""
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is a required property")
        if not isinstance(prompt, list):
            if not isinstance(prompt, str):
                raise BadRequest("'prompt' must be a string, an array of strings or token ids")
            return self._text_prompt(prompt, body)
        if not prompt:
            raise BadRequest("'prompt' must not be empty")
        if _all_ints(prompt):
            return self._token_ids(prompt, body)
        if isinstance(prompt[0], list):
            for item in prompt:
                if not isinstance(item, list) or not item or not _all_ints(item):
                    raise BadRequest("'prompt' token-id arrays must be non-empty integer arrays")
            return _batch([self._token_ids(item, body) for item in prompt])
        if not all(isinstance(p, str) for p in prompt):
            raise BadRequest("'prompt' must be a string, an array of strings or token ids")
        return _batch([self._text_prompt(p, body) for p in prompt])

    def _text_prompt(self, prompt: str, body: Mapping[str, Any]) -> ProcessedPrompt:
        t0 = time.perf_counter()
        if self.tokenizer is None:
            return self._approximate(prompt, body, 0.0)
        if len(prompt) < MIN_CACHED_CHARS:
            tokens = self.tokenizer.encode_short(prompt)
        else:
            tokens = self.tokenizer.encode_text(prompt)
        tokens = self._engine_tokens(tokens, body, chat=False)
        t1 = time.perf_counter()
        root, _ = self.root(body)
        hashes = hash_prompt(tokens, self.block_size, root).hashes
        return ProcessedPrompt(
            len(tokens), hashes, self.block_size, True, 0, t1 - t0, time.perf_counter() - t1
        )

    def _engine_tokens(self, tokens: Any, body: Mapping[str, Any], *, chat: bool) -> Any:
        """The ids vLLM hands the engine for a prompt tokenized as ``tokens``: a BOS first
        when the request adds special tokens (:func:`adds_special_tokens`) and the tokenizer
        has one (a second one before a text that starts with it: the tokenizer does not
        look, nor does vLLM), then ``truncate_prompt_tokens`` of them (:func:`kept_tokens`,
        :func:`truncated`). ``tokens`` itself when neither changes it.

        Without a ``truncation_side`` vLLM has the tokenizer truncate while it encodes
        (``TokenizeParams.get_encode_kwargs``), which keeps the BOS it adds and cuts the
        text: a BOS and the text's last k - 1 ids. With one, it cuts the encoded ids, the
        BOS among them."""
        bos = self._bos_id
        keep = kept_tokens(body, self.context_length)
        if bos is not None and adds_special_tokens(body, chat):
            if keep is not None and body.get("truncation_side") is None:
                if keep <= len(tokens):  # k - 1 text ids after the BOS (none for k = 1)
                    tokens = tokens[len(tokens) - (keep - 1) :]
                keep = None
            tokens = np.concatenate([np.array([bos], dtype=np.uint32), tokens])
        if keep is not None:
            tokens = truncated(tokens, keep, body)
        return tokens

    def engine_rendered(
        self,
        prompts: Sequence[tuple[np.ndarray, Sequence[MmItem]]],
        body: Mapping[str, Any],
        render_s: float,
    ) -> ProcessedPrompt:
        """Routing view of prompts the engine rendered itself (router/service/render.py):
        their token ids as the engine will run them (template, truncation and special
        tokens already applied) and their multimodal items, keyed into the blocks as the
        engine keys them. Several prompts: a completion batch (:func:`_batch`)."""
        if not prompts:
            raise BadRequest("the engine rendered no prompt")
        root, _ = self.root(body)
        bs = self.block_size
        entries: list[ProcessedPrompt] = []
        for ids, items in prompts:
            t0 = time.perf_counter()
            extras = mm_block_extras(items, bs) if items else None
            hashes = hash_prompt(ids, bs, root, extras=extras).hashes
            # one round trip rendered them all: its time counts once in the batch's sum
            spent = 0.0 if entries else render_s
            entries.append(
                ProcessedPrompt(len(ids), hashes, bs, True, 0, spent, time.perf_counter() - t0)
            )
        return _batch(entries)

    def unknown(self, body: Mapping[str, Any]) -> ProcessedPrompt:
        """A prompt of which nothing is known but a rough size (the body's characters):
        no blocks to match, so it is routed on load alone."""
        size = len(json.dumps(body, default=str))
        return ProcessedPrompt(
            max(1, round(size / self.chars_per_token)), [], self.block_size, False
        )

    def token_array(
        self, tokens: Sequence[int] | np.ndarray, body: Mapping[str, Any] | None = None
    ) -> ProcessedPrompt:
        """Routing view of a prompt whose ids are already known to be uint32 (an array, or a
        protobuf ``repeated uint32``): no per-element type checks."""
        return self._token_ids(tokens, body or {})

    def _token_ids(
        self, ids: Sequence[int] | np.ndarray, body: Mapping[str, Any]
    ) -> ProcessedPrompt:
        t0 = time.perf_counter()
        try:
            arr = as_u32_array(ids)
        except ValueError as exc:
            raise BadRequest(f"'prompt' {exc}") from None
        keep = kept_tokens(body, self.context_length)
        if keep is not None:
            arr = truncated(arr, keep, body)
        root, _ = self.root(body)
        hashes = hash_prompt(arr, self.block_size, root).hashes
        return ProcessedPrompt(
            len(arr), hashes, self.block_size, True, 0, 0.0, time.perf_counter() - t0
        )

    def _approximate(
        self,
        text: str,
        body: Mapping[str, Any],
        render_s: float,
        cut_at: str | None = None,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        """``cut_at``: hash only the text before its first occurrence (an image)."""
        t0 = time.perf_counter()
        _, salt = self.root(body)
        lora = self.mm_lora(body, from_responses) if self.mm_loras else None
        hashed = text if cut_at is None or cut_at not in text else text[: text.find(cut_at)]
        hashes = approx_hashes(
            hashed, self.block_size, approx_root(self.model, salt, lora), self.chars_per_token
        )
        return ProcessedPrompt(
            approx_tokens(text, self.chars_per_token),
            hashes,
            self.block_size,
            False,
            0,
            render_s,
            time.perf_counter() - t0,
        )
