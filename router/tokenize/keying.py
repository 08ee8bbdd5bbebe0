"""The routing view of a prompt, and how one model's prompts are keyed into it.

:class:`ProcessedPrompt` is what the routing core needs of a request's prompt: its token
count and canonical block hashes, with the facts and timings the service reports.

:class:`PromptKeying` holds what one model's prompts are keyed with and keys the prompts that
need no chat template:

* the root of a request's block chain (:meth:`PromptKeying.root`): the model, the request's
  ``cache_salt`` and the adapter vLLM's ``--default-mm-loras`` serves it with;
* the ids vLLM hands the engine for a tokenized prompt: a BOS and ``truncate_prompt_tokens``
  (``_engine_tokens``);
* completion requests (a text, token ids, a batch of either, ``prompt_embeds``), prompts the
  engine rendered itself (router/service/render.py), token arrays known to be uint32 (gRPC),
  and prompts known only by their size (:meth:`PromptKeying.unknown`);
* without a tokenizer, *approximate* views (:mod:`router.tokenize.approx`).

Chat requests, rendered with the model's chat template, are keyed by its subclass
:class:`router.tokenize.pipeline.PromptProcessor`, the class callers construct. The request
body has been parsed as JSON by the caller; only the fields read here are validated, with
:class:`BadRequest` saying which one is wrong.
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
from router.tokenize.incremental import MIN_CACHED_CHARS, IncrementalTokenizer
from router.tokenize.request_fields import (
    adds_special_tokens,
    default_mm_lora,
    kept_tokens,
    truncated,
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


class PromptKeying:
    """What one model's prompts are keyed with, and the prompts keyed without a chat
    template (see module docstring)."""

    def __init__(
        self,
        model: str,
        block_size: int,
        *,
        tokenizer: IncrementalTokenizer | None = None,
        add_bos_to_completions: bool = False,
        chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
        context_length: int | None = None,
        mm_loras: Collection[str] = (),
    ) -> None:
        """``add_bos_to_completions``: the engine's tokenizer puts its BOS before a text it
        encodes with special tokens (router.tokenize.tokenizers.adds_bos; ``_engine_tokens``);
        ``context_length``: the engine's ``--max-model-len`` (``truncate_prompt_tokens: -1``
        truncates to it); ``mm_loras``: the adapters its ``--default-mm-loras`` loads
        (:meth:`mm_lora`)."""
        self.model = model
        self.context_length = context_length
        self.mm_loras = frozenset(mm_loras)
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.chars_per_token = chars_per_token
        self._bos_id: int | None = None
        self._root = root_hash(model, None)
        if tokenizer is not None and add_bos_to_completions:
            bos = tokenizer.tokenizer.bos_token
            self._bos_id = tokenizer.tokenizer.special_tokens.get(bos) if bos else None

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

    # ------------------------------------------------------------------ completions

    def completion(self, body: Mapping[str, Any]) -> ProcessedPrompt:
        """Routing view of a completion request. A batch (several prompts, answered by one
        replica) is routed by its longest prompt and counted with all its tokens.

        ``prompt_embeds`` (vLLM: one base64 tensor or a list, run before the text prompts in
        the same batch) cannot be hashed: each is one more prompt of the batch (its decode
        sequences counted, its prefill not), the text prompts are routed as without them,
        and the view is not exact (the engine's usage counts tokens the router did not).
        Prompts sent with a ``suffix`` are counted, not hashed (the engine's renderer
        makes them fill-in-the-middle prompts, or refuses them)."""
        embeds = body.get("prompt_embeds")
        embedded = 0 if embeds is None else len(embeds) if isinstance(embeds, list) else 1
        if body.get("suffix") is not None:
            # vLLM 0.34 runs a prompt with a suffix as its renderer's fill-in-the-middle
            # prompt (OnlineRenderer.render_completion: render_completion_suffix, DeepSeek
            # V4's) or refuses it: the prompt's own ids are not the engine's, its size is
            view = self._completion_text(body)
            batch: tuple[tuple[int, list[int]], ...] = tuple((n, []) for n, _ in view.batch)
            return replace(view, block_hashes=[], exact=False, batch=batch)
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
        keep = kept_tokens(body, self.context_length, chat=chat)
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

    def forwarded(
        self, ids: Sequence[int], body: Mapping[str, Any], from_responses: bool = False
    ) -> ProcessedPrompt:
        """Routing view of a chat whose prompt is the token ids it forwards in
        ``kv_transfer_params`` (request_fields.forwarded_prompt_ids): vLLM 0.34 hands them
        to the engine as they are (``tokens_input(ids, cache_salt)``: no template, special
        tokens or truncation), under the chat's root."""
        return self._token_ids(ids, body, truncate=False, from_responses=from_responses)

    def _token_ids(
        self,
        ids: Sequence[int] | np.ndarray,
        body: Mapping[str, Any],
        *,
        truncate: bool = True,
        from_responses: bool = False,
    ) -> ProcessedPrompt:
        t0 = time.perf_counter()
        try:
            arr = as_u32_array(ids)
        except ValueError as exc:
            raise BadRequest(f"'prompt' {exc}") from None
        keep = kept_tokens(body, self.context_length) if truncate else None
        if keep is not None:
            arr = truncated(arr, keep, body)
        root, _ = self.root(body, from_responses)
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
