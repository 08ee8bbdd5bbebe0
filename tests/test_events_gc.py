"""What the router keeps per engine block stays out of the garbage collector's lists.

A full (generation-2) collection scans every GC-tracked object of the process, holding the
router's event loop meanwhile: per-block records kept tracked made that pause grow with the
engines' caches (router/events/reblock.py; docs/bench-service.md, "Event-loop stalls")."""

from __future__ import annotations

import dataclasses
import gc
import random
import types

import pytest

from router.core.hashing import hash_prompt, root_hash
from router.core.types import BlocksRemoved, BlocksStored, Kind, Tier
from router.events.model import EngineBlockRemoved, EngineBlockStored, EngineEvent
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


def walked_within(root: object) -> int:
    """References a full collection follows from the GC-tracked objects reachable from
    ``root`` (as ``tracked_within``): a tracked dict costs one per key and one per value,
    however few of them are tracked themselves."""
    seen = {id(root)}
    stack = [root]
    count = 0
    while stack:
        refs = gc.get_referents(stack.pop())
        count += len(refs)
        for ref in refs:
            if id(ref) in seen or not gc.is_tracked(ref) or isinstance(ref, _OPAQUE):
                continue
            seen.add(id(ref))
            stack.append(ref)
    return count


def _collect() -> None:
    """Collect twice: a tuple is untracked once the tuples in it are, perhaps a pass later."""
    gc.collect()
    gc.collect()


def _with_lookahead(events: list[EngineEvent]) -> list[EngineEvent]:
    """vLLM's stores with ``lookahead_token_ids`` (one token after each block)."""
    return [
        dataclasses.replace(ev, lookahead_token_ids=tuple((7,) for _ in ev.block_hashes))
        if isinstance(ev, EngineBlockStored) and ev.token_ids
        else ev
        for ev in events
    ]


def _second_state_group(events: list[EngineEvent]) -> list[EngineEvent]:
    """A model with two state-like groups (two mamba groups, or two windows): every event of
    the mock's state group (1) published for group 2 as well."""
    out: list[EngineEvent] = []
    for ev in events:
        out.append(ev)
        if isinstance(ev, EngineBlockStored | EngineBlockRemoved) and ev.group_idx == 1:
            out.append(dataclasses.replace(ev, group_idx=2))
    return out


def _feed(
    reblocker: Reblocker,
    encoder: EngineEventEncoder,
    rng: random.Random,
    n: int,
    lookahead: bool = False,
    two_state_groups: bool = False,
) -> None:
    """``n`` prompts of 8 router blocks stored on GPU with a checkpoint at their end, half of
    them offloaded to CPU, a quarter evicted from GPU afterwards."""
    for i in range(n):
        tokens = rng.choices(range(50_000), k=8 * 64)
        hashes = tuple(hash_prompt(tokens, 64, root_hash(MODEL)).hashes)
        encoder.learn(list(hashes), tokens)
        # a window's checkpoint at the end needs the window before it (two router blocks)
        state = hashes[-2:] if encoder.sliding_window else hashes[-1:]
        events = [BlocksStored(hashes), BlocksStored(state, Tier.GPU, Kind.STATE)]
        if i % 2:
            events.append(BlocksStored(hashes, Tier.CPU))
        engine_events = encoder.convert(events)
        if lookahead:
            engine_events = _with_lookahead(engine_events)
        if two_state_groups:
            engine_events = _second_state_group(engine_events)
        assert reblocker.convert(engine_events)
        if i % 4 == 1:
            removed = encoder.convert([BlocksRemoved(hashes[4:])])
            if two_state_groups:
                removed = _second_state_group(removed)
            assert reblocker.convert(removed)


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


@pytest.mark.parametrize(
    ("engine_block", "lookahead", "window", "two_groups"),
    [
        (16, False, 0, False),
        (64, False, 0, False),
        (256, False, 0, False),
        (16, True, 0, False),
        (16, False, 128, False),
        (16, False, 0, True),
        (16, False, 128, True),
    ],
)
def test_a_full_collection_walks_no_table_of_engine_blocks(
    engine_block: int, lookahead: bool, window: int, two_groups: bool
) -> None:
    """A dict is tracked again as soon as a tracked key or value goes in (a fresh tuple is,
    until a collection): tables keyed by (group, hash) tuples, or holding tuple records,
    made every full collection after fresh stores walk all their entries (~100 ms at
    450,000 engine blocks, growing with the fleet); a sliding-window group's blocks were
    objects of their own; with two state-like groups, the checkpoints each holds were sets
    (always tracked). What a full collection following a few stores walks must not grow
    with the blocks a reblocker holds."""
    rng = random.Random(11)
    reblocker = Reblocker(64, MODEL)
    encoder = EngineEventEncoder(64, engine_block, sliding_window=window)
    _feed(reblocker, encoder, rng, 8, lookahead, two_groups)
    _collect()
    _feed(reblocker, encoder, rng, 2, lookahead, two_groups)  # what a live router did since
    few = walked_within(reblocker)
    blocks = len(reblocker)
    _feed(reblocker, encoder, rng, 200, lookahead, two_groups)
    _collect()
    _feed(reblocker, encoder, rng, 2, lookahead, two_groups)
    assert len(reblocker) > 20 * blocks
    assert walked_within(reblocker) <= few
