"""Canonical block hashing: pinned vectors, the definition, chaining, and input checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from router.core.hashing import (
    HASH_SEED,
    as_u32_array,
    chain_from_block_ids,
    hash_block_tokens,
    hash_prompt,
    root_hash,
)

# Pinned: changing any of these silently invalidates every published index.
ROOT = 0xA5591868BE528BCD


def test_pinned_vectors() -> None:
    assert root_hash("kimi-k3") == ROOT
    assert root_hash("kimi-k3", "salt") == 0x3ADE4D70734C788C
    assert root_hash("kimi-k3", None, "lora-a") == 0xCAAF5E4C9AF2DB4B
    hp = hash_prompt(list(range(10)), 4, ROOT)
    assert hp.hashes == [0x06B957B288C43807, 0x593E2C9E98D67D8A]
    assert hp.tail_tokens == 2
    assert hp.full_tokens == 8


def test_matches_the_written_definition() -> None:
    tokens = [7, 70000, 2**32 - 1, 0, 5, 6, 7, 8]
    h0 = xxhash.xxh3_64_intdigest(
        struct.pack("<Q", ROOT) + struct.pack("<4I", *tokens[:4]), seed=HASH_SEED
    )
    h1 = xxhash.xxh3_64_intdigest(
        struct.pack("<Q", h0) + struct.pack("<4I", *tokens[4:]), seed=HASH_SEED
    )
    assert hash_prompt(tokens, 4, ROOT).hashes == [h0, h1]
    assert hash_block_tokens(ROOT, tokens[:4]) == h0


def test_roots_separate_namespaces() -> None:
    roots = {root_hash("a"), root_hash("b"), root_hash("a", "s"), root_hash("a", None, "l")}
    assert len(roots) == 4
    toks = list(range(64))
    assert (
        hash_prompt(toks, 16, root_hash("a")).hashes != hash_prompt(toks, 16, root_hash("b")).hashes
    )


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.integers(1, 40),
    st.integers(0, 10),
)
def test_chain_continuation_and_input_forms(tokens: list[int], block: int, cut_blocks: int) -> None:
    full = hash_prompt(tokens, block, ROOT)
    assert len(full.hashes) == len(tokens) // block
    assert full.tail_tokens == len(tokens) % block
    # Same result from a numpy array, from bytes, and from a continued chain.
    arr = np.array(tokens, dtype=np.uint32)
    assert hash_prompt(arr, block, ROOT).hashes == full.hashes
    assert hash_prompt(arr.astype("<u4").tobytes(), block, ROOT).hashes == full.hashes
    cut = min(cut_blocks, len(full.hashes))
    if cut:
        rest = hash_prompt(tokens, block, ROOT, start=cut * block, parent=full.hashes[cut - 1])
        assert full.hashes[:cut] + rest.hashes == full.hashes
    # A prefix of the tokens has a prefix of the hashes (the property the index relies on).
    half = hash_prompt(tokens[: len(tokens) // 2], block, ROOT)
    assert full.hashes[: len(half.hashes)] == half.hashes


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError):
        hash_prompt([1, -1], 1, ROOT)
    with pytest.raises(ValueError):
        hash_prompt([2**32], 1, ROOT)
    with pytest.raises(ValueError):
        hash_prompt([1, 2], 0, ROOT)
    with pytest.raises(ValueError):
        hash_prompt([1, 2, 3], 2, ROOT, start=1)
    with pytest.raises(ValueError):
        as_u32_array(b"\x00\x01\x02")
    with pytest.raises(ValueError):
        as_u32_array(np.array([-3], dtype=np.int64))
    assert hash_prompt([], 4, ROOT).hashes == []


def test_block_id_chains_are_prefix_closed_and_distinct() -> None:
    a = chain_from_block_ids([1, 2, 3], ROOT)
    b = chain_from_block_ids([1, 2, 4], ROOT)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chain_from_block_ids([1, 2, 3], root_hash("other")) != a
