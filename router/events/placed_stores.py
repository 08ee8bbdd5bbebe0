"""Stores the re-blocker places by hash rather than by their tokens.

Three kinds of ``BlockStored`` name engine blocks the re-blocker (router/events/reblock.py)
must place by what it already knows of the same hash, since their own ``token_ids`` do not
say where they sit:

* token-less stores (vLLM's KV offloading connector): each engine block takes the canonical
  blocks it was stored with on GPU (and, with a chunk size, its chunk's earlier blocks);
* sparse recurrent-state stores (vLLM 0.34's mamba "align" mode lists the kept checkpoints
  of a token range): each goes at the end of the full-attention block of its hash;
* sliding-window groups (router/events/window.py): each block by its full-attention block.

A store whose full-attention block comes later in the batch waits for the batch's end
(``_pending``, see ``Reblocker.convert``). State-like groups after the first publish a
checkpoint only while every one holds it (``_join``; router/events/state_groups.py).

:class:`PlacedStores` extends :class:`~router.events.tier_coverage.TierCoverage` and is the
base of ``Reblocker``; it reads the re-blocker's attributes declared below.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from router.core.types import IndexEvent, Kind, Tier
from router.events.block_table import END_SHIFT, STATE_BIT, BlockTable, kind_of, word
from router.events.model import EngineBlockStored
from router.events.state_groups import StateGroups
from router.events.tier_coverage import TIER_OF, TierCoverage
from router.events.window import WindowChange, WindowGroup, blocks_needed

log = logging.getLogger(__name__)


class PlacedStores(TierCoverage):
    """Stores placed by hash (see the module docstring). Attributes, set by the
    re-blocker:"""

    on_checkpoint: Callable[[int], None] | None
    _pending: list[EngineBlockStored]
    _state_group: int | None
    _logged_unmapped: bool

    def _stored_by_hash(
        self, ev: EngineBlockStored, tier: Tier, kind: Kind, group: int, bit: int
    ) -> list[IndexEvent]:
        """A store naming engine blocks by hash alone (no ``token_ids``): each takes the
        canonical blocks of the same engine block stored with tokens; a positive
        ``block_size`` is the chunk each hash ends (vLLM 0.18's offloaded block), whose
        earlier engine blocks are stored with it."""
        emitted: dict[Kind, list[int]] = {Kind.KV: [], Kind.STATE: []}
        table = self._table(group)
        words = table.word
        for h in ev.block_hashes:
            w = words.get(h)
            if w is None and kind is Kind.STATE:
                placed = self._state_at(table, h, ev.parent_block_hash, bit)
                if placed is not None:
                    emitted[Kind.STATE].extend(placed[1])
                    self._gain(group, placed[0], bit, placed[1])  # its copy counted
                    continue
            if w is None:
                self.stats.unmapped_offload += 1
                if not self._logged_unmapped:
                    self._logged_unmapped = True
                    log.warning(
                        "token-less %s store of an engine block never stored with tokens: "
                        "not indexed (counted in unmapped_offload)", ev.medium,
                    )  # fmt: skip
                continue
            self.stats.stored_blocks += 1
            if not w & bit:
                w = words[h] = w | bit
                emitted[kind_of(w)].extend(self._gain(group, w, bit, table.covers_of(h)))
            if not w & STATE_BIT and ev.block_size > 0:
                self._store_chunk(group, h, w, ev.block_size, bit, emitted[Kind.KV])
        out: list[IndexEvent] = []
        for k, hashes in emitted.items():
            out.extend(self._emit_stored(hashes, tier, k, group))
        return out

    def _stored_sparse_state(
        self, ev: EngineBlockStored, tier: Tier, group: int, bit: int
    ) -> list[IndexEvent]:
        """A recurrent-state store listing only the checkpoints kept within its token range
        (vLLM 0.34's mamba "align" mode: ``token_ids`` cover every block of the range,
        ``block_hashes`` the kept ones, without their positions): each is placed at the end
        of the full-attention block of the same hash (engines share block hashes across
        groups); one whose attention block is not known yet waits for the end of the batch
        (``convert``), then is counted in ``unmapped_offload``."""
        emitted: list[int] = []
        missing = []
        prev = ev.parent_block_hash
        table = self._table(group)
        words = table.word
        for h in ev.block_hashes:
            w = words.get(h)
            if w is None:
                placed = self._state_at(table, h, prev, bit)
                if placed is None:
                    missing.append(h)
                    continue
                w, covers = placed
                emitted.extend(covers)
                self._gain(group, w, bit, covers)
            elif not w & bit:
                w = words[h] = w | bit
                had = table.covers_of(h)
                emitted.extend(had)
                self._gain(group, w, bit, had)
            prev = h
        if missing:
            self._pending.append(replace(ev, block_hashes=tuple(missing), token_ids=()))
        return self._emit_stored(emitted, tier, Kind.STATE, group)

    def _stored_window(self, ev: EngineBlockStored, last: bool) -> list[IndexEvent]:
        """A sliding-window group's store (router/events/window.py): each block is placed by
        the full-attention block of the same hash, whether the event lists every block of
        its token range or only the kept ones; a block whose attention block is not known
        yet waits for the end of the batch (``last``: it is the end), then is counted in
        ``unmapped_offload``. Only the GPU cache serves a window."""
        window, be = ev.kv_cache_spec_sliding_window, ev.block_size
        group = ev.group_idx or 0
        # a window group the router cannot read still counts: it holds no checkpoint
        joined = self._join(group) if group != self._state_group else []
        if not window or window <= 0 or be <= 0 or TIER_OF.get(ev.medium) is not Tier.GPU:
            self.stats.unknown_window += len(ev.block_hashes)
            return joined
        tracker = self._windows.get(group)
        if tracker is None:
            tracker = self._windows[group] = WindowGroup(blocks_needed(window, be))
        change = WindowChange()
        missing = []
        placed = []
        for h in ev.block_hashes:
            kv_group = self._kv_group.get(h)
            if kv_group is None:
                missing.append(h)
                continue
            kv = self._tables[kv_group]
            end = kv.word[h] >> END_SHIFT
            canonical = kv.chain[h] if end and h not in kv.tail else None
            placed.append((h, kv.parent.get(h), end // be, canonical))
        self.stats.stored_blocks += len(placed)
        tracker.stored(placed, change)
        if missing and last:
            self.stats.unmapped_offload += len(missing)
        elif missing:
            self._pending.append(replace(ev, block_hashes=tuple(missing), token_ids=()))
        if self.on_checkpoint is not None:
            for _, depth in change.stored:
                self.on_checkpoint(depth * be)
        events = self._window_events(change, group)
        return joined + events if joined else events

    def _join(self, group: int) -> list[IndexEvent]:
        """``group`` holds checkpoints (a mamba or sliding-window group) and is not the first
        such group: from the second on, a checkpoint is published only while every one holds
        it (router/events/state_groups.py), so one first seen now withdraws those published
        that it lacks. The first group's checkpoints are published as they come, at no cost."""
        if self._state_group is None:
            self._state_group = group
            return []
        if self._mixed is None:
            first = self._state_group
            self._mixed = StateGroups({first: self._holdings(first)})
        elif group in self._mixed:
            return []
        return self._removal(self._mixed.join(group, self._holdings(group)), Tier.GPU, Kind.STATE)

    def _holdings(self, group: int) -> set[int]:
        """The checkpoints ``group`` has published and not removed, on any tier."""
        window = self._windows.get(group)
        if window is not None:
            return window.checkpoints()
        table = self._tables.get(group)
        if table is None:
            return set()
        return {c for h, w in table.word.items() if w & STATE_BIT for c in table.covers_of(h)}

    def _store_chunk(
        self, group: int, h: int, w: int, size: int, bit: int, emitted: list[int]
    ) -> None:
        """The engine blocks before engine block ``h`` (``w``: its word) within the ``size``
        tokens ending at it are stored on ``bit``'s tier with it (and removed with it: its
        chunk)."""
        table = self._tables[group]
        words = table.word
        start = (w >> END_SHIFT) - size
        had = table.chunk_of(h)
        members = list(had)
        parent = table.parent.get(h)
        while parent is not None:
            anc = words.get(parent)
            if anc is None or anc >> END_SHIFT <= start:
                break
            if parent not in members:
                members.append(parent)
            if not anc & bit:
                anc = words[parent] = anc | bit
                emitted.extend(self._gain(group, anc, bit, table.covers_of(parent)))
            parent = table.parent.get(parent)
        chunk = tuple(members)
        if chunk != had:
            table.set_chunk(h, chunk)

    def _state_at(
        self, table: BlockTable, h: int, parent: int | None, bit: int
    ) -> tuple[int, list[int]] | None:
        """A token-less recurrent-state checkpoint named ``h``, added to ``table``: at the end
        of the full-attention block of that hash (engines share block hashes across groups).
        Its word and covers."""
        kv_group = self._kv_group.get(h)
        if kv_group is None:
            return None
        kv = self._tables[kv_group]
        tail = kv.tail.get(h, b"")
        if tail:
            covers: list[int] = []
            self.stats.unaligned_state += 1
        else:
            covers = [kv.chain[h]]
        end = kv.word[h] >> END_SHIFT
        w = word(end, Kind.STATE, bit)
        table.add(h, parent, w, kv.chain[h], covers, tail, kv.mm.get(h, b""))
        self.stats.stored_blocks += 1
        if self.on_checkpoint is not None:
            self.on_checkpoint(end)
        return w, covers
