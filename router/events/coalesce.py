"""Canonical index events merged for the store: neighbouring events of the same type, tier
and kind become one (fewer, larger writes; the order of everything else is kept)."""

from __future__ import annotations

from router.core.types import BlocksRemoved, BlocksStored, IndexEvent


def coalesce(events: list[IndexEvent]) -> list[IndexEvent]:
    """Merge neighbouring events of the same type, tier and kind (fewer, larger events)."""
    out: list[IndexEvent] = []
    run: list[BlocksStored | BlocksRemoved] = []  # neighbours to merge into one
    for ev in events:
        prev = run[-1] if run else None
        if (
            isinstance(ev, (BlocksStored, BlocksRemoved))
            and prev is not None
            and type(prev) is type(ev)
            and prev.tier == ev.tier
            and prev.kind == ev.kind
        ):
            run.append(ev)
            continue
        _merge_into(out, run)
        if isinstance(ev, (BlocksStored, BlocksRemoved)):
            run = [ev]
        else:
            run = []
            out.append(ev)
    _merge_into(out, run)
    return out


def _merge_into(out: list[IndexEvent], run: list[BlocksStored | BlocksRemoved]) -> None:
    if len(run) == 1:
        out.append(run[0])
    elif run:
        first = run[0]
        hashes = tuple(h for ev in run for h in ev.hashes)
        out.append(type(first)(hashes, first.tier, first.kind))
