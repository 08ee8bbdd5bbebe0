"""What the router keeps per engine block stays out of the garbage collector's lists.

A full (generation-2) collection scans every GC-tracked object of the process, holding the
router's event loop meanwhile: per-block records kept tracked made that pause grow with the
engines' caches (router/events/reblock.py; docs/bench-service.md, "Event-loop stalls")."""

from __future__ import annotations

import gc
import random
import types

from router.core.hashing import hash_prompt, root_hash
from router.core.types import BlocksRemoved, BlocksStored, Kind, Tier
from router.events.reblock import Reblocker
from router.mock.kv_events import EngineEventEncoder

MODEL = "m"
_OPAQUE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def tracked_within(root: object) -> int:
    """GC-tracked objects reachable from ``root`` through containers and instances (not
    through classes, functions or modules: those lead to the rest of the process)."""
    seen = {id(root)}
    stack = [root]
    count = 0
    while stack:
        for ref in gc.get_referents(stack.pop()):
            if id(ref) in seen or not gc.is_tracked(ref) or isinstance(ref, _OPAQUE):
                continue
            seen.add(id(ref))
            count += 1
            stack.append(ref)
    return count


def _collect() -> None:
    """Collect twice: a tuple is untracked once the tuples in it are, perhaps a pass later."""
    gc.collect()
    gc.collect()


def _feed(reblocker: Reblocker, encoder: EngineEventEncoder, rng: random.Random, n: int) -> None:
    """``n`` prompts of 8 router blocks stored on GPU with a checkpoint at their end, half of
    them offloaded to CPU, a quarter evicted from GPU afterwards."""
    for i in range(n):
        tokens = [rng.randrange(50_000) for _ in range(8 * 64)]
        hashes = tuple(hash_prompt(tokens, 64, root_hash(MODEL)).hashes)
        encoder.learn(list(hashes), tokens)
        events = [BlocksStored(hashes), BlocksStored(hashes[-1:], Tier.GPU, Kind.STATE)]
        if i % 2:
            events.append(BlocksStored(hashes, Tier.CPU))
        assert reblocker.convert(encoder.convert(events))
        if i % 4 == 1:
            assert reblocker.convert(encoder.convert([BlocksRemoved(hashes[4:])]))


def test_engine_block_records_are_not_tracked_by_the_garbage_collector() -> None:
    """Each engine block stored cost the router two or three tracked objects (its record,
    the list of canonical blocks it covers, a list of counts per canonical block), which
    every full collection scanned: a 10,000-batch feed froze the event loop for 0.1-0.3 s
    at a time. After a collection, what a reblocker holds no longer grows with its blocks."""
    rng = random.Random(7)
    reblocker = Reblocker(64, MODEL)
    encoder = EngineEventEncoder(64, 16)  # engine blocks of 16: four per router block
    _feed(reblocker, encoder, rng, 8)
    _collect()
    few = tracked_within(reblocker)
    blocks = len(reblocker)
    _feed(reblocker, encoder, rng, 200)
    _collect()
    assert len(reblocker) > 20 * blocks
    assert tracked_within(reblocker) == few
