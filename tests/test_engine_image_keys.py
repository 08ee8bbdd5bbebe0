"""Several images in one prompt, engine side against router side: vLLM's own per-block
extra-key derivation (``generate_block_hash_extra_keys``, and with lookahead hashes
``generate_lookahead_block_hash_extra_keys``, which also keys a block with an image starting
in the tokens after it), in events of random sizes, re-blocked by the publisher, must give
the canonical hashes the router computes from the images' starts: images back to back, the
same image twice, several in one engine block, one at the prompt's start, for router blocks
finer and coarser than the engine's. Swapping two images, or moving one, changes the hashes
from the block where the first difference starts."""

from __future__ import annotations

import random

import pytest

from router.core.hashing import MmItem
from tests.engines import load_file
from tests.test_engine_keys import BE, _request, reblocked, router_side


def _event_keys(n: int, mm: list[tuple[str, int, int]], salt: str | None, lookahead: int) -> list:
    utils = load_file("vllm_0_33_0_kv_cache_utils.py")
    req = _request(n, mm, salt)
    keys, idx = [], 0
    for start in range(0, n - n % BE, BE):
        if lookahead:
            k, idx = utils.generate_lookahead_block_hash_extra_keys(
                req, start, start + BE, start + BE + lookahead, idx
            )
        else:
            k, idx = utils.generate_block_hash_extra_keys(req, start, start + BE, idx)
        keys.append(k)
    return utils.to_event_extra_keys(keys)


def _prompt(rng: random.Random) -> tuple[list[int], list[tuple[str, int, int]]]:
    """Tokens of a few engine blocks with images (placeholder token 7) at random places."""
    n = rng.randint(2, 10) * BE
    tokens = [rng.randint(1000, 1003) for _ in range(n)]
    mm: list[tuple[str, int, int]] = []
    pos = rng.choice([0, 0, rng.randint(1, 20)])
    while pos < n:
        length = rng.randint(1, 40)
        mm.append((rng.choice(["img-a", "img-b"]), pos, length))
        tokens[pos : pos + length] = [7] * min(length, n - pos)
        pos += length + rng.choice([0, 0, 1, 5, BE])
    return tokens, mm


@pytest.mark.parametrize("lookahead", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_many_images_reblock_to_the_routers_hashes(seed: int, lookahead: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        tokens, mm = _prompt(rng)
        salt = rng.choice([None, "tenant"])
        extra = _event_keys(len(tokens), mm, salt, lookahead)
        chunks: list[int] = []
        left = len(tokens) // BE
        while left:
            chunks.append(rng.randint(1, left))
            left -= chunks[-1]
        items = [MmItem(start, ident) for ident, start, _ in mm]
        for block_size in (8, 16, 32):
            got = reblocked("vllm-0.33.0", tokens, block_size, chunks, extra_keys=extra)
            assert got == router_side(tokens, block_size, salt, items), (seed, mm, chunks)


def test_swapped_or_moved_images_differ_from_the_first_difference() -> None:
    tokens = [1000 + i % 5 for i in range(6 * BE)]
    a, b = ("img-a", 20, 10), ("img-b", 40, 10)
    for _ident, start, length in (a, b):
        tokens[start : start + length] = [7] * length
    base = reblocked(
        "vllm-0.33.0", tokens, 16, [6], extra_keys=_event_keys(len(tokens), [a, b], None, 0)
    )
    swapped = router_side(tokens, 16, None, [MmItem(20, "img-b"), MmItem(40, "img-a")])
    twice = router_side(tokens, 16, None, [MmItem(20, "img-a"), MmItem(40, "img-a")])
    assert base[:1] == swapped[:1] and not set(base[1:]) & set(swapped)
    assert base[:2] == twice[:2] and not set(base[2:]) & set(twice)
