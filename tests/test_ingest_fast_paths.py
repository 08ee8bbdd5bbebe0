"""The shortcuts of the event ingest give what the general code gives: events without
``extra_keys`` (no keys read) against the same events with an empty entry per block (read
one by one), and ``hash_prompt`` on a few blocks (byte slices) against its definition."""

from __future__ import annotations

import random

import pytest

from router.core.hashing import (
    SMALL_BLOCKS,
    MmItem,
    hash_block_tokens,
    hash_prompt,
    mm_block_extras,
)
from router.events.model import EngineBlockRemoved, EngineBlockStored
from router.events.reblock import Reblocker


def _events(rng: random.Random, be: int, with_keys: bool) -> list[object]:
    """Random chains stored in random-sized events, some re-stored on CPU, some removed."""
    events: list[object] = []
    hashes: list[int] = []
    for chain in range(3):
        n = rng.randrange(1, 40)
        tokens = [rng.randrange(100_000) for _ in range(n * be)]
        own = [rng.getrandbits(64) for _ in range(n)]
        parent = rng.choice(hashes) if hashes and chain else None
        s = 0
        while s < n:
            k = rng.randrange(1, 6)
            chunk = tuple(own[s : s + k])
            events.append(
                EngineBlockStored(
                    chunk,
                    parent if s == 0 else own[s - 1],
                    tuple(tokens[s * be : (s + len(chunk)) * be]),
                    be,
                    medium=rng.choice(["GPU", "GPU", "CPU"]),
                    extra_keys=[None] * len(chunk) if with_keys else None,
                )
            )
            s += k
        hashes += own
    for h in rng.sample(hashes, len(hashes) // 3):
        events.append(EngineBlockRemoved((h,), medium=rng.choice(["GPU", "CPU"])))
    return events


@pytest.mark.parametrize("be", [16, 64, 48, 256])
def test_events_without_extra_keys_reblock_as_with_empty_keys(be: int) -> None:
    for seed in range(8):
        plain = _events(random.Random(seed), be, with_keys=False)
        keyed = _events(random.Random(seed), be, with_keys=True)
        a, b = Reblocker(64, "m"), Reblocker(64, "m")
        assert a.convert(plain) == b.convert(keyed)  # type: ignore[arg-type]
        assert a.stats == b.stats and len(a) == len(b)


def test_hash_prompt_on_few_and_many_blocks_follows_the_definition() -> None:
    rng = random.Random(3)
    for n in range(1, 2 * SMALL_BLOCKS + 2):
        tokens = [rng.randrange(2**32) for _ in range(n * 16 + rng.randrange(16))]
        chain, h = [], 12345
        for i in range(n):
            h = hash_block_tokens(h, tokens[i * 16 : (i + 1) * 16])
            chain.append(h)
        assert hash_prompt(tokens, 16, 0, parent=12345).hashes == chain
        items = [MmItem(rng.randrange(n * 16), f"img{j}") for j in range(3)]
        extras = mm_block_extras(items, 16)
        few = hash_prompt(tokens, 16, 0, parent=7, extras=extras).hashes
        # the same blocks continued block by block (always the few-blocks path)
        one, parent = [], 7
        for i in range(n):
            block = {0: extras[i]} if i in extras else None
            parent = hash_prompt(
                tokens[i * 16 : (i + 1) * 16], 16, 0, parent=parent, extras=block
            ).hashes[0]
            one.append(parent)
        assert few == one
