"""Chat requests with images, keyed as the engine keys them: the :class:`ImagePrompts` part
of router.tokenize.pipeline ``PromptProcessor``. Image parts are placed as the template's
content format places them, rendered, expanded to each image's token count and keyed with
its hash in the block where it starts (router.tokenize.multimodal); a medium the router
cannot place is hashed up to where it starts (``_cut_before``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from router.core.hashing import hash_prompt, mm_block_extras
from router.tokenize.keying import ProcessedPrompt, PromptKeying
from router.tokenize.multimodal import (
    ExpandedImages,
    ImageSettings,
    cut_expanded,
    expand_images,
    image_urls,
    image_uuids,
    marked_images,
    own_image_kwargs,
    with_placeholders,
)
from router.tokenize.request_fields import adds_special_tokens, kept_to_context, kept_tokens

if TYPE_CHECKING:
    from router.tokenize.template import ChatTemplate

# stands for an image in the text when the model has no image settings (a private-use char)
IMAGE_MARKER = "\ue000"


class ImagePrompts(PromptKeying):
    """The image half of a chat's processing; the chat half (its fields, rendering) is the
    subclass's (router.tokenize.pipeline ``PromptProcessor``)."""

    template: ChatTemplate | None
    images: ImageSettings | None

    if TYPE_CHECKING:  # the chat half's, which the subclass defines

        def _render_text(
            self,
            messages: list[Mapping[str, Any]],
            tools: Any,
            kwargs: Mapping[str, Any],
            add_gen: bool,
            cont: bool = False,
            from_responses: bool = False,
        ) -> tuple[str, dict[str, Any] | None]: ...

        def _chat_args(
            self,
            body: Mapping[str, Any],
            from_responses: bool = False,
            from_messages: bool = False,
        ) -> tuple[list[Mapping[str, Any]], Any, Mapping[str, Any], bool, bool]: ...

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
        to_context = kept_to_context(body, self.context_length)
        if (kept_tokens(body, self.context_length, chat=True) is not None and not to_context) or (
            adds_special_tokens(body, chat=True) and self._bos_id is not None
        ):  # ids cut by a k of the request's, or shifted: not modelled, routed on load
            return self.unknown(body)
        marker = settings.placeholder if settings is not None else IMAGE_MARKER
        with_ph, urls = self._placed(messages, tools, marker, settings is not None)
        text, _ = self._render_text(with_ph, tools, kwargs, add_gen, cont, from_responses)
        if tokenizer is None or template is None or settings is None:
            if to_context is not None:  # whether -1 cuts the start is not known
                return self.unknown(body)
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
        if to_context is not None and len(expanded) + rest > to_context:
            if known_until is not None or cut_at is not None:
                return self.unknown(body)  # cut where the unknown part decides
            expanded, items = cut_expanded(expanded, items, found.lengths, to_context, body)
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
        (:func:`with_placeholders`, interleaved where the model's engines interleave)."""
        template = self.template
        if template is not None and template.content_format_for(tools) == "openai":
            urls = image_urls(messages)
            return (messages if settings else marked_images(messages, marker)), urls
        interleave = self.images is not None and self.images.interleave
        return with_placeholders(messages, marker, interleave=interleave)

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
