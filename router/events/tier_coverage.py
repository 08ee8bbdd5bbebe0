"""Which canonical blocks each tier holds, and what engine blocks leaving a tier remove.

The half of the re-blocker (router/events/reblock.py) that counts, per tier, the engine
blocks holding each canonical block and turns their arrivals and departures into canonical
``BlocksStored`` / ``BlocksRemoved`` events:

* a full-attention canonical block is held on a tier once every engine block overlapping it
  is held there (``_held``: where engine blocks do not hold whole router blocks, the engine
  blocks it needs and those each tier holds, packed in one int per block);
* where several engine blocks at one position hold the same canonical block (lookahead
  hashes, engine blocks reaching past a router block's end), ``_copies`` counts them, so
  evicting one copy does not remove what another still holds;
* a recurrent-state checkpoint goes only when no tier holds it; with several state-like
  groups it is published while every group holds it (router/events/state_groups.py);
* ``BlockRemoved`` events (``_removed``) drop engine blocks, and with them what they covered.

:class:`TierCoverage` is a base of ``Reblocker`` (through
``router.events.placed_stores.PlacedStores``), as ``sim.block_cache.BlockCache`` is of the
engine model: its methods run once per engine block on the ingest path and read the
re-blocker's attributes, declared below, directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from router.core.types import BlocksRemoved, BlocksStored, IndexEvent, Kind, Tier
from router.events.block_table import END_SHIFT, MEDIA_BITS, STATE_BIT, BlockTable
from router.events.model import EngineBlockRemoved
from router.events.window import WindowChange, WindowGroup

if TYPE_CHECKING:
    from router.events.reblock import ReblockStats
    from router.events.state_groups import StateGroups

# A full-attention canonical block's counts (``Reblocker._held``): the engine blocks that
# overlap it (slot 0), then per tier (slot tier + 1) how many of those positions hold it
# there, packed in one int (an int-valued table is never GC-tracked: router/events/
# block_table.py), each count a signed field of _W bits: ``held_count``, ``HELD_STEP``
_W: Final = 20
_HALF: Final = 1 << (_W - 1)
_FIELD: Final = (1 << _W) - 1
_BIAS: Final = sum(_HALF << (_W * t) for t in range(4))
HELD_STEP: Final = tuple(1 << (_W * t) for t in range(4))  # one more in slot t


def held_count(entry: int, t: int) -> int:
    """Slot ``t`` of a ``_held`` entry."""
    return ((entry + _BIAS) >> (_W * t) & _FIELD) - _HALF


def held_named(entry: int) -> bool:
    """Some tier's count in a ``_held`` entry is not zero (an engine block names it)."""
    return held_count(entry, 1) + held_count(entry, 2) + held_count(entry, 3) != 0


def copy_key(end: int, c: int, tier: int) -> int:
    """``Reblocker._copies``' key of canonical block ``c`` (in [0, 2**64), as every hash
    ``hash_prompt`` makes) at the position ending at ``end`` on ``tier``."""
    return (end << 64 | c) << 2 | tier


def owner_key(h: int, group: int, tier: int) -> int:
    """``TierCoverage._owners``' key of engine block ``h`` of ``group`` on ``tier`` (an int:
    the dict is never GC-tracked, router/events/block_table.py)."""
    return h << 24 | (group & 0x3FFFFF) << 2 | tier


# a tier bit mask -> the slots of its tiers in a ``_held`` entry (tier + 1)
TIER_SLOTS = tuple(tuple(t + 1 for t in Tier if m >> t & 1) for m in range(1 << len(Tier)))


def tier_bits(media: int) -> list[int]:
    """The tier bits set in ``media``."""
    return [1 << t for t in Tier if media >> t & 1]


# the media engines publish, as they spell them
TIER_OF: dict[str | None, Tier] = {None: Tier.GPU, **{t.name: t for t in Tier}}


class TierCoverage:
    """Tier coverage and removals (see the module docstring). Attributes, set by the
    re-blocker:"""

    stats: ReblockStats
    _tables: dict[int, BlockTable]
    _kv_group: dict[int, int]
    _windows: dict[int, WindowGroup]
    _mixed: StateGroups | None
    _copies: dict[int, dict[int, int]] | None
    _held: dict[int, dict[int, int]]
    # Residencies (``residency_key``: vLLM 0.34's (medium, ownership), several of which can
    # be one router tier): the first one to store on a tier is its default; ``_owners``
    # maps ``owner_key(h, group, tier)`` to the residency bits holding that block there,
    # only where that is not the default alone
    _owners: dict[int, int]
    _res_bits: dict[tuple[str, str | None], int]
    _res_default: dict[Tier, int]

    def _tier(self, medium: str | None) -> Tier | None:
        """The tier an event's ``medium`` names (None, counted as a bad event, if none)."""
        tier = TIER_OF.get(medium)
        if tier is None:
            try:
                tier = Tier.parse(medium)
            except ValueError as exc:
                self.stats.error(str(exc))
        return tier

    def _table(self, group: int) -> BlockTable:
        table = self._tables.get(group)
        if table is None:
            table = self._tables[group] = BlockTable()
        return table

    def _gain(self, group: int, w: int, bit: int, covers: Sequence[int]) -> Sequence[int]:
        """The engine block of word ``w`` now holds ``covers`` on ``bit``'s tier (one more
        copy of each at its position where copies are counted): those of them now held
        there, a checkpoint always, a full-attention block once every engine block it
        overlaps is (counted in ``_held`` where it spans several: its entry was made where it
        was hashed)."""
        copies = self._copies
        if copies is not None:
            mine = copies.get(group)
            if mine is None:
                mine = copies[group] = {}
            end, tier = w >> END_SHIFT, bit.bit_length() - 1
            fresh = []
            for c in covers:
                key = copy_key(end, c, tier)
                n = mine.get(key, 0)
                mine[key] = n + 1
                if not n:  # no other copy held this position there
                    fresh.append(c)
            if not w & STATE_BIT:
                covers = fresh
        held = self._held.get(group)
        if held is None or w & STATE_BIT:
            return covers
        t = bit.bit_length()  # the tier's slot in an entry
        step = HELD_STEP[t]
        whole = []
        for c in covers:
            entry = held.get(c)
            if entry is None:  # hashed before counting began: one engine block, as then
                whole.append(c)
                continue
            entry = held[c] = entry + step
            if held_count(entry, t) == held_count(entry, 0):
                whole.append(c)
        return whole

    def _lose(
        self, group: int, w: int, covers: Sequence[int], bit: int, held: dict[int, int] | None
    ) -> Sequence[int]:
        """The engine block of word ``w`` overlapping ``covers`` leaves ``bit``'s tier: those
        of them that no copy at its position holds there any more (gone from that tier,
        whatever other engine blocks or groups hold); ``held``: its group's counts
        (``_held``), or None."""
        copies = self._copies
        if copies is None and held is None:
            return covers
        if copies is not None:
            mine = copies.get(group, {})
            end, tier = w >> END_SHIFT, bit.bit_length() - 1
            gone = []
            for c in covers:
                key = copy_key(end, c, tier)
                left = mine.get(key, 1) - 1
                if left > 0:
                    mine[key] = left
                    continue
                mine.pop(key, None)
                gone.append(c)
            covers = gone
        if held is not None and not w & STATE_BIT:
            t = bit.bit_length()
            step = HELD_STEP[t]
            for c in covers:
                entry = held.get(c)
                if entry is not None:
                    entry = held[c] = entry - step
                    if not held_count(entry, t) and not held_named(entry):
                        del held[c]  # no engine block names it any more
        return covers

    def _held_nowhere(self, group: int, end: int, media: int, covers: Sequence[int]) -> list[int]:
        """Of ``covers``, which the block ending at ``end`` just lost on one tier (``media``:
        the tiers it is left on), those no tier holds now."""
        copies = self._copies
        if copies is None:
            return [] if media else list(covers)
        mine = copies.get(group, {})
        return [c for c in covers if not any(copy_key(end, c, t) in mine for t in Tier)]

    def _emit_stored(
        self, hashes: list[int], tier: Tier, kind: Kind, group: int
    ) -> list[IndexEvent]:
        """``group`` stored these canonical blocks (with several state-like groups, a
        checkpoint is published only once every one holds it)."""
        if hashes and kind is Kind.STATE and self._mixed is not None:
            hashes = self._mixed.stored(group, hashes)
        if not hashes:
            return []
        self.stats.canonical_stored += len(hashes)
        return [BlocksStored(tuple(dict.fromkeys(hashes)), tier, kind)]

    def _emit_removed(
        self, hashes: list[int], tier: Tier, kind: Kind, group: int
    ) -> list[IndexEvent]:
        """``group`` lost these canonical blocks (with several state-like groups, a
        checkpoint goes once one of them loses it)."""
        if hashes and kind is Kind.STATE and self._mixed is not None:
            hashes = self._mixed.removed(group, hashes)
        return self._removal(hashes, tier, kind)

    def _removal(self, hashes: list[int], tier: Tier, kind: Kind) -> list[IndexEvent]:
        if not hashes:
            return []
        self.stats.canonical_removed += len(hashes)
        return [BlocksRemoved(tuple(dict.fromkeys(hashes)), tier, kind)]

    def _drop(
        self,
        group: int,
        table: BlockTable,
        h: int,
        w: int,
        bit: int,
        out: dict[Kind, list[int]],
        held: dict[int, int] | None,
    ) -> None:
        """Engine block ``h`` (``w``: its word in ``table``, ``group``'s) leaves ``bit``'s
        tier; ``held``: its group's (``_held``), or None."""
        media = w & MEDIA_BITS & ~bit
        c = table.covers.get(h)
        covers = () if c is None else (c,) if type(c) is int else table.covers_of(h)
        counted = held is not None or self._copies is not None
        lost = self._lose(group, w, covers, bit, held) if counted else covers
        kind = Kind.STATE if w & STATE_BIT else Kind.KV
        if kind is Kind.STATE and lost:
            # the index keeps one state set per replica, of every tier: a checkpoint goes
            # only when no tier holds it (the engine loads one offloaded to CPU)
            lost = self._held_nowhere(group, w >> END_SHIFT, media, lost)
        out[kind].extend(lost)
        if media:
            table.word[h] = w & ~bit
        else:
            table.remove(h)
            if not w & STATE_BIT and self._kv_group.get(h) == group:
                del self._kv_group[h]

    def _window_events(self, change: WindowChange, group: int) -> list[IndexEvent]:
        out: list[IndexEvent] = []
        if change.stored:
            hashes = [h for h, _ in change.stored]
            out.extend(self._emit_stored(hashes, Tier.GPU, Kind.STATE, group))
        if change.removed:
            out.extend(self._emit_removed(change.removed, Tier.GPU, Kind.STATE, group))
        return out

    def _removed_window(
        self, window: WindowGroup, ev: EngineBlockRemoved, tier: Tier, group: int
    ) -> list[IndexEvent]:
        if tier is not Tier.GPU:
            self.stats.unknown_removed += len(ev.block_hashes)
            return []
        change = WindowChange()
        gone = window.removed(ev.block_hashes, change)
        self.stats.removed_blocks += gone
        self.stats.unknown_removed += len(ev.block_hashes) - gone
        return self._window_events(change, group)

    def _removed(self, ev: EngineBlockRemoved) -> list[IndexEvent]:
        tier = self._tier(ev.medium)
        if tier is None:
            return []
        group = ev.group_idx or 0
        window = self._windows.get(group)
        if window is not None:
            return self._removed_window(window, ev, tier, group)
        bit = 1 << tier
        out: dict[Kind, list[int]] = {Kind.KV: [], Kind.STATE: []}
        held = self._held.get(group)
        table = self._tables.get(group)
        if table is None:  # nothing stored in this group
            self.stats.unknown_removed += len(ev.block_hashes)
            return []
        words, chunks = table.word, table.chunk
        for h in self._leaving(ev, group, tier):
            w = words.get(h)
            if w is None or not w & bit:
                self.stats.unknown_removed += 1
                continue
            self.stats.removed_blocks += 1
            chunk = table.chunk_of(h) if chunks and h in chunks else ()
            self._drop(group, table, h, w, bit, out, held)
            for member in chunk:  # the rest of its offloaded chunk
                mw = words.get(member)
                if mw is not None and mw & bit:
                    self._drop(group, table, member, mw, bit, out, held)
        events: list[IndexEvent] = []
        for kind, hashes in out.items():
            events.extend(self._emit_removed(hashes, tier, kind, group))
        return events

    def _residency(self, medium: str | None, ownership: str | None) -> int:
        """The bit of residency (``medium``, ``ownership``); past 62 residencies, the last
        bit is shared (those residencies are one, as the medium alone was)."""
        key = (medium or "GPU", ownership)
        r = self._res_bits.get(key)
        if r is None:
            r = self._res_bits[key] = 1 << min(len(self._res_bits), 62)
        return r

    def _residency_before(
        self, medium: str | None, ownership: str | None, group: int, hashes: Sequence[int]
    ) -> tuple[Tier, int, list[bool]] | None:
        """Before a store of ``hashes`` by a residency: its tier, its bit and which of them
        that tier held (None: nothing to note, the tier's default residency storing while no
        block has another)."""
        try:
            tier = Tier.parse(medium)
        except ValueError:
            return None  # refused by the store itself
        r = self._residency(medium, ownership)
        default = self._res_default.setdefault(tier, r)
        if r == default and not self._owners:
            return None
        table = self._tables.get(group)
        words = {} if table is None else table.word
        bit = 1 << tier
        return tier, r, [bool(words.get(h, 0) & bit) for h in hashes]

    def _residency_after(
        self, group: int, hashes: Sequence[int], before: tuple[Tier, int, list[bool]]
    ) -> None:
        """After that store: the blocks it put on the tier are held by its residency too
        (alone, where the tier did not hold them before)."""
        tier, r, was = before
        table = self._tables.get(group)
        if table is None:
            return
        words, bit, default = table.word, 1 << tier, self._res_default[tier]
        for h, held in zip(hashes, was, strict=True):
            if not words.get(h, 0) & bit:
                continue  # not placed (unmapped, opaque, ...)
            k = owner_key(h, group, tier)
            holders = self._owners.get(k, default) | r if held else r
            if holders == default:
                self._owners.pop(k, None)
            else:
                self._owners[k] = holders

    def _leaving(self, ev: EngineBlockRemoved, group: int, tier: Tier) -> Sequence[int]:
        """Of the blocks ``ev`` removes, those no other residency of ``tier`` holds (they
        leave the tier); a block its residency does not hold stays (``unknown_removed``)."""
        default = self._res_default.get(tier)
        r = self._residency(ev.medium, ev.ownership)
        if default is None or (r == default and not self._owners):
            return ev.block_hashes
        leaving = []
        for h in ev.block_hashes:
            k = owner_key(h, group, tier)
            holders = self._owners.get(k, default)
            if not holders & r:
                self.stats.unknown_removed += 1
                continue
            left = holders & ~r
            if not left:
                self._owners.pop(k, None)
                leaving.append(h)
            elif left == default:
                del self._owners[k]
            else:
                self._owners[k] = left
        return leaving

    def _forget_owners(self, tiers: int) -> None:
        """The blocks of the tiers in bit mask ``tiers`` are gone: so are their holders."""
        if self._owners:
            self._owners = {k: v for k, v in self._owners.items() if not tiers >> (k & 3) & 1}

    def _tier_cleared(self, tier: Tier) -> list[IndexEvent]:
        """Every engine block leaves ``tier`` (an offload pool's reset), as if removed one by
        one: what no other tier holds goes from the index."""
        bit = 1 << tier
        self._forget_owners(bit)
        events: list[IndexEvent] = []
        for group, table in self._tables.items():
            out: dict[Kind, list[int]] = {Kind.KV: [], Kind.STATE: []}
            held = self._held.get(group)
            for h, w in [(h, w) for h, w in table.word.items() if w & bit]:
                self.stats.removed_blocks += 1
                self._drop(group, table, h, w, bit, out, held)
            for kind, hashes in out.items():
                events.extend(self._emit_removed(hashes, tier, kind, group))
        return events
