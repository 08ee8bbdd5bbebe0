"""Engine events -> canonical index events (re-blocking).

Engines hash blocks their own way and may use another block size than the router. From the
``token_ids`` in ``BlockStored`` events a ``Reblocker`` recomputes the router's canonical
chained hashes (``router.core.hashing``), remembering for every engine block:

* where it ends (tokens from the start of the sequence), the canonical hash of the last
  complete router block at or before that end, and the tokens after it (the *tail*), so a
  child block can continue the chain without the prefix;
* which canonical blocks it overlaps (``covers``), so removing it removes exactly those:
  a canonical block is cached only while every engine block overlapping it is. Per tier, a
  full-attention canonical block is announced once every engine block overlapping it is held
  there, whichever path (store with tokens, token-less store, ``AllBlocksCleared``) brings
  the last one (where engine blocks do not hold whole router blocks, ``_held`` counts, per
  canonical block, the engine blocks it needs and those each tier holds).

Engine blocks smaller than the router's complete a canonical block every few events; larger
ones complete several at once. ``kv_cache_spec_kind`` chooses the meaning: full-attention
groups yield KV blocks; ``mamba``-like groups yield recurrent-state checkpoints, named by the
canonical hash of the prefix they end at (only at router block boundaries); sliding-window
groups yield a checkpoint wherever the window before a router block boundary is cached
(router/events/window.py); chunked-local and unknown groups are ignored
(``router.events.model``; an unknown kind is logged once). Each group keeps its own map.
An engine serves a prefix only where every state-like (mamba or sliding-window) group can
resume at its end: the first such group seen publishes its checkpoints as they come; from the
second on, a checkpoint is published only while every group seen holds it, and a group seen
late withdraws those it lacks (router/events/state_groups.py).

Hash-changing keys enter the canonical chain as the router derives them from a request
(``router.core.hashing``): a cache salt (SGLang's ``cache_salt`` field, or vLLM's salt in the
first block's ``extra_keys``) and the LoRA adapter select the root (``_root``: the chains a
request for the replica entry's model can reuse take that request's root); vLLM's multimodal keys
``(identifier, offset in the engine block)`` become ``MmItem`` s at their absolute start and
key the canonical block they start in. Prompt-embedding digests (bytes) and shapes this code
does not know cannot be reproduced from a request: such a block and the ones after it in the
event are not indexed (``opaque_blocks``).

Offloaded tiers: a store without ``token_ids`` names engine blocks by hash alone (vLLM's KV
offloading connector by default: the last engine block of each offloaded chunk, with a
``block_size`` of 0 in vLLM 0.25-0.34, the chunk's tokens in 0.18). Such a block takes the canonical
blocks it was stored with on GPU, and with a chunk size, those of the chunk's earlier blocks
too; a recurrent-state checkpoint takes its position from the full-attention block of that
hash. A hash never seen stored with tokens cannot be placed: counted (``unmapped_offload``).
``AllBlocksCleared`` clears what the engine's own cache held and keeps what vLLM's
offloading connector holds (``router.events.model.OFFLOAD_MEDIA``): the canonical events are
then ``AllCleared`` followed by the canonical blocks those hold whole, stored again on their
tiers. A later ``AllBlocksCleared`` in the same batch is an offload pool's own reset (vLLM
0.34: the simple CPU offload's pool under ``reset_prefix_cache(reset_connector=True)``, whose
events the scheduler publishes after the GPU pool's, and the HiSparse host pool, reset right
after the GPU pool): it removes what the offload tiers hold and keeps the GPU blocks stored
since the first (read as a GPU reset, it dropped those and every store continuing them).

The per-tier counting and the removal path are in router/events/tier_coverage.py
(``TierCoverage``), stores placed by hash (token-less, sparse state, sliding windows) in
router/events/placed_stores.py (``PlacedStores``): the bases of ``Reblocker``.

Known limit: if an ancestor engine block is evicted and later re-stored while its
descendants stayed cached, the descendants' canonical blocks are not re-announced (the
index under-reports until they are stored again), which is the safe direction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from router.core.hashing import MmItem, hash_prompt, mm_block_extras, root_hash
from router.core.types import (
    AllCleared,
    BlocksStored,
    IndexEvent,
    Kind,
    Tier,
)
from router.events.block_table import (
    END_SHIFT,
    MEDIA_BITS,
    BlockTable,
    kind_of,
    pack_mm,
    u32_bytes,
    unpack_mm,
    word,
)
from router.events.coalesce import coalesce
from router.events.extra_keys import NO_KEYS, BlockKeys, read_extra_keys
from router.events.model import (
    IGNORED_KINDS,
    KV_KINDS,
    OFFLOAD_MEDIA,
    STATE_KINDS,
    WINDOW_KINDS,
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)
from router.events.placed_stores import PlacedStores
from router.events.state_groups import StateGroups
from router.events.tier_coverage import (
    HELD_STEP,
    TIER_OF,
    TIER_SLOTS,
    held_count,
    held_named,
    tier_bits,
)
from router.events.window import WindowGroup


@dataclass(slots=True)
class ReblockStats:
    stored_blocks: int = 0
    removed_blocks: int = 0
    canonical_stored: int = 0
    canonical_removed: int = 0
    unknown_parent: int = 0
    unknown_removed: int = 0
    bad_event: int = 0
    ignored_group: int = 0
    unaligned_state: int = 0
    opaque_blocks: int = 0
    unmapped_offload: int = 0  # token-less stores of engine blocks never stored with tokens
    kept_on_clear: int = 0  # engine blocks kept through AllBlocksCleared (offloaded)
    # state stores naming every block from the start (vLLM's kv_cache_report_mode "full"
    # re-announcing a hit): only their last checkpoint is taken
    reannounced_state: int = 0
    # sliding-window stores the router cannot use: no window size, or a tier other than GPU
    unknown_window: int = 0
    errors: list[str] = field(default_factory=list)

    def not_indexed(self) -> dict[str, int]:
        """Engine blocks stored but not indexed, by reason (the fields above of that kind)."""
        return {
            "ignored_group": self.ignored_group,
            "unknown_window": self.unknown_window,
            "unknown_parent": self.unknown_parent,
            "unaligned_state": self.unaligned_state,
            "opaque": self.opaque_blocks,
            "unmapped_offload": self.unmapped_offload,
        }

    def error(self, message: str) -> None:
        self.bad_event += 1
        if len(self.errors) < 20:
            self.errors.append(message)


_NO_ITEMS: set[MmItem] = set()  # shared, never added to: events without extra keys
log = logging.getLogger(__name__)
# roots an adapter entry's base-model chains apart from every request's root (``_root``)
BASE_MODEL = "\0base"
_logged_kinds: set[str] = set()
# the kinds engines publish, as they spell them, read once
_KIND_OF: dict[str | None, Kind | None] = {
    None: Kind.KV,
    **{name: Kind.KV for name in KV_KINDS},
    **{name: Kind.STATE for name in STATE_KINDS},
    **{name: None for name in IGNORED_KINDS},
}


def _group_kind(kind: str | None) -> Kind | None:
    if kind in _KIND_OF:
        return _KIND_OF[kind]
    name = (kind or "").strip().lower()
    if name in KV_KINDS:
        return Kind.KV
    if name in STATE_KINDS:
        return Kind.STATE
    if name not in IGNORED_KINDS and name not in _logged_kinds and len(_logged_kinds) < 64:
        _logged_kinds.add(name)
        log.warning("kv_cache_spec_kind %r is not known: its blocks are not indexed", name[:64])
    return None


class Reblocker(PlacedStores):
    """Converts one engine's events (one data-parallel rank) into canonical events."""

    def __init__(
        self,
        block_size: int,
        model: str,
        root_for: Callable[[str | None, str | None], int] | None = None,
        on_checkpoint: Callable[[int], None] | None = None,
        adapter: bool = False,
    ) -> None:
        """``on_checkpoint(end)``: called for every new recurrent-state checkpoint with the
        token position it ends at (a router block boundary or not), for layout learning.
        ``adapter``: ``model`` is known to name a LoRA adapter of the engine (configured:
        ``[models.NAME] lora_base``, ``kvrouter publish --lora-base``), so no block stored
        without it is ever indexed under its requests' roots; else learned from the first
        block stored with it (``_adapter_found``)."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.model = model
        self.root_for = root_for or (lambda lora, salt: root_hash(model, salt, lora))
        self.adapter = adapter  # ``model`` names an adapter of the engine
        self.on_checkpoint = on_checkpoint
        self._tables: dict[int, BlockTable] = {}  # by group_idx: full attention, state
        # engine block hash -> the group whose full-attention block of that hash is in
        # ``_tables`` (the last stored)
        self._kv_group: dict[int, int] = {}
        # tier bits stored through vLLM's offloading connector: AllBlocksCleared keeps them
        self._offload_bits = 0
        self._logged_unmapped = False
        self._pending: list[EngineBlockStored] = []  # see _stored_sparse_state
        self._reset_in_batch = False  # an AllBlocksCleared came earlier in this batch
        self._windows: dict[int, WindowGroup] = {}  # sliding-window groups by group_idx
        # the first state-like (mamba or sliding-window) group seen; from the second on,
        # checkpoints are published where every one holds them (see _join)
        self._state_group: int | None = None
        self._mixed: StateGroups | None = None
        # several engine blocks at one position can hold the same canonical block: engines
        # hashing with lookahead (vLLM's lookahead_token_ids, SGLang's EAGLE pairs) cache the
        # same tokens there once for each next token seen, and an engine block reaching past
        # a router block's end is shared by sequences diverging after that end:
        # group -> copy_key(end, canonical, tier) -> how many hold it, so that evicting one
        # copy does not remove what another still holds, and ``_held`` counts positions
        # (None: not counted: no lookahead, and engine blocks dividing the router's, which
        # two sequences hold whole or not at all; engine blocks a multiple of it are
        # counted: sequences diverging inside one share its router blocks before that point)
        self._copies: dict[int, dict[int, int]] | None = None
        # full-attention canonical blocks by group: their counts (held_count); an entry lives
        # while some engine block's covers name it
        self._held: dict[int, dict[int, int]] = {}
        self._owners: dict[int, int] = {}  # see TierCoverage
        self._res_bits: dict[tuple[str, str | None], int] = {}
        self._res_default: dict[Tier, int] = {}
        self.stats = ReblockStats()

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values()) + sum(
            len(w) for w in self._windows.values()
        )

    def clear(self) -> None:
        for table in self._tables.values():
            table.clear()
        self._kv_group.clear()
        for window in self._windows.values():
            window.clear()
        if self._mixed is not None:
            self._mixed.reset({})
        if self._copies is not None:
            self._copies.clear()
        self._held.clear()
        self._owners.clear()

    def convert(self, events: tuple[EngineEvent, ...] | list[EngineEvent]) -> list[IndexEvent]:
        out: list[IndexEvent] = []
        self._pending = []
        self._reset_in_batch = False
        for ev in events:
            if isinstance(ev, EngineBlockStored):
                out.extend(self._stored(ev))
            elif isinstance(ev, EngineBlockRemoved):
                out.extend(self._removed(ev))
            elif isinstance(ev, EngineAllCleared):
                out.extend(self._all_cleared())
        # sparse state stores whose attention blocks came later in the batch (token-less
        # now: placed by hash, the rest counted as unmapped)
        pending, self._pending = self._pending, []
        for ev in pending:
            if _is_window(ev.kv_cache_spec_kind):
                out.extend(self._stored_window(ev, last=True))
                continue
            kind = _group_kind(ev.kv_cache_spec_kind) or Kind.STATE
            tier = TIER_OF.get(ev.medium) or Tier.GPU
            out.extend(self._stored_by_hash(ev, tier, kind, ev.group_idx or 0, 1 << tier))
        return coalesce(out)

    def _all_cleared(self) -> list[IndexEvent]:
        """The engine reset its prefix cache: drop every block but the offloading
        connector's (``OFFLOAD_MEDIA``), which are stored again after ``AllCleared``. A
        later reset in the same batch is an offload pool's (module docstring): it drops
        what the offload tiers hold and keeps the GPU blocks stored since the first."""
        keep = self._offload_bits
        if self._reset_in_batch and keep:
            self._pending = [
                ev for ev in self._pending if not keep >> (TIER_OF.get(ev.medium) or Tier.GPU) & 1
            ]
            return [ev for t in Tier if keep >> t & 1 for ev in self._tier_cleared(t)]
        self._reset_in_batch = True
        # stores earlier in this batch waiting for their attention blocks (``convert``):
        # those on a tier the reset clears are gone with it
        self._pending = [
            ev for ev in self._pending if keep >> (TIER_OF.get(ev.medium) or Tier.GPU) & 1
        ]
        for window in self._windows.values():
            window.clear()
        if not keep:
            self.clear()
            return [AllCleared()]
        self._forget_owners(~keep & MEDIA_BITS)
        kept: dict[tuple[Tier, Kind], list[int]] = {}
        for group, table in self._tables.items():
            words = table.word
            for h, w in list(words.items()):
                media = w & keep
                if not media:
                    table.remove(h)
                    if self._kv_group.get(h) == group:
                        del self._kv_group[h]
                    continue
                words[h] = w & ~MEDIA_BITS | media
                self.stats.kept_on_clear += 1
                kind = kind_of(w)
                if kind is Kind.STATE or group not in self._held:  # else: counted below
                    for tier in Tier:
                        if media >> tier & 1:
                            kept.setdefault((tier, kind), []).extend(table.covers_of(h))
        if self._copies is not None:  # the kept tiers' copies are those left
            self._copies = {
                g: {k: n for k, n in copies.items() if keep >> (k & 3) & 1}
                for g, copies in self._copies.items()
            }
        kept_tiers = [t for t in Tier if keep >> t & 1]
        for held in self._held.values():
            for c, entry in list(held.items()):
                for t in Tier:
                    if not keep >> t & 1:
                        entry -= held_count(entry, t + 1) * HELD_STEP[t + 1]
                if not held_named(entry):  # no kept block names it
                    del held[c]
                    continue
                held[c] = entry
                for t in kept_tiers:
                    if held_count(entry, t + 1) == held_count(entry, 0):
                        kept.setdefault((t, Kind.KV), []).append(c)
        if self._mixed is not None:  # what every state-like group still holds
            published = self._mixed.reset({g: self._holdings(g) for g in self._mixed.groups()})
            for (_, kind), hashes in kept.items():
                if kind is Kind.STATE:
                    hashes[:] = [h for h in hashes if h in published]
        out: list[IndexEvent] = [AllCleared()]
        for (tier, kind), hashes in kept.items():
            if hashes:
                out.append(BlocksStored(tuple(dict.fromkeys(hashes)), tier, kind))
        return out

    def _root(self, lora: str | None, salt: str | None) -> int:
        """The canonical root of a chain the engine stored with adapter ``lora`` (None: the
        base model): a request for ``model`` hashes from ``root_for(None, salt)``, so that is
        the root of exactly the chains it can reuse: those of the adapter ``model`` names,
        or, while ``model`` is not known to name one, the base model's."""
        if lora is not None and lora == self.model:
            lora = None
        elif lora is None and self.adapter:
            lora = BASE_MODEL
        return self.root_for(lora, salt)

    def _adapter_found(self) -> list[IndexEvent]:
        """A block stored with the adapter ``model`` names: the base model's blocks indexed so
        far are withdrawn (the entry cleared; what continues them is ``unknown_parent``)."""
        self.adapter = True
        log.info("model %r is a LoRA adapter of its engine: its index starts anew", self.model)
        self._pending = []
        for window in self._windows.values():
            window.clear()
        self._offload_bits = 0
        self.clear()
        return [AllCleared()]

    def _stored(self, ev: EngineBlockStored) -> list[IndexEvent]:
        if not self.adapter and ev.lora_name is not None and ev.lora_name == self.model:
            return [*self._adapter_found(), *self._stored(ev)]
        be = ev.block_size
        if self._copies is None and (
            ev.lookahead_token_ids or (ev.token_ids and be > 0 and self.block_size % be)
        ):  # counted: see __init__
            self._copies = {}
        if _is_window(ev.kv_cache_spec_kind):
            return self._stored_window(ev, last=False)
        kind = _group_kind(ev.kv_cache_spec_kind)
        if kind is None:
            self.stats.ignored_group += 1
            return []
        group = ev.group_idx or 0
        joined = self._join(group) if kind is Kind.STATE and group != self._state_group else []
        before = self._residency_before(ev.medium, ev.ownership, group, ev.block_hashes)
        out = self._stored_group(ev, kind, group)
        if before is not None:
            self._residency_after(group, ev.block_hashes, before)
        return joined + out if joined else out

    def _stored_group(self, ev: EngineBlockStored, kind: Kind, group: int) -> list[IndexEvent]:
        """A full-attention or recurrent-state group's store."""
        tier = self._tier(ev.medium)
        if tier is None:
            return []
        if ev.lora_id is not None and not ev.lora_name:
            self.stats.error("LoRA block without lora_name: cannot derive its root")
            return []
        n, be = len(ev.block_hashes), ev.block_size
        if n == 0:
            return []
        bit = 1 << tier
        if tier is not Tier.GPU and ev.medium in OFFLOAD_MEDIA:
            self._offload_bits |= bit
        if not ev.token_ids:
            return self._stored_by_hash(ev, tier, kind, group, bit)
        if len(ev.token_ids) != n * be:
            if (
                kind is Kind.STATE
                and be > 0
                and len(ev.token_ids) % be == 0
                and (len(ev.token_ids) > n * be)
            ):  # vLLM >= 0.34 "align" mode: the kept checkpoints of a longer range
                return self._stored_sparse_state(ev, tier, group, bit)
            self.stats.error(f"{len(ev.token_ids)} token_ids for {n} blocks of {be}")
            return []
        if kind is Kind.STATE and n > 1 and ev.parent_block_hash is None:
            # vLLM (0.33+) publishes the checkpoints a prefill kept and skips the others, so a
            # state store naming every block from the first is a hit re-announced under
            # kv_cache_report_mode "full" (block_pool.emit_cached_block_events): the hashes
            # before its last name blocks whose state the engine never kept.
            self.stats.reannounced_state += 1
            last = replace(ev, block_hashes=ev.block_hashes[-1:])
            return self._stored_sparse_state(last, tier, group, bit)
        keys = None if ev.extra_keys is None else self._block_keys(ev, n)
        if keys is None and ev.extra_keys is not None:
            return []
        self.stats.stored_blocks += n
        # Blocks already known (e.g. the same block now offloaded to CPU): reuse covers.
        first_new = 0
        emitted: list[int] = []
        table = self._table(group)
        words = table.word
        while first_new < n:
            h = ev.block_hashes[first_new]
            known = words.get(h)
            if known is None:
                break
            if not known & bit:
                known = words[h] = known | bit
                emitted.extend(self._gain(group, known, bit, table.covers_of(h)))
            first_new += 1
        # keys no request reproduces: that block and the ones after it are not indexed
        usable = n if keys is None else next((i for i in range(first_new, n) if keys[i].opaque), n)
        if usable < n:
            self.stats.opaque_blocks += n - usable
        if first_new >= usable:
            return self._emit_stored(emitted, tier, kind, group)
        if first_new:
            parent_hash: int | None = ev.block_hashes[first_new - 1]
        else:
            parent_hash = ev.parent_block_hash
        tail0: bytes  # little-endian u32 tokens
        tail_mm0: tuple[MmItem, ...]
        if parent_hash is None:
            salt = ev.cache_salt
            if salt is None and keys is not None:
                salt = keys[0].salt
            end0, chain0, tail0, tail_mm0 = 0, self._root(ev.lora_name, salt), b"", ()
        else:
            parent: BlockTable | None = table if parent_hash in words else None
            if parent is None and kind is Kind.STATE:
                # Sparse state groups (vLLM mamba "align" mode) hold no entry for most
                # blocks; engines use the same block hashes in every group, so the chain
                # position comes from the full-attention map.
                kv_group = self._kv_group.get(parent_hash)
                parent = None if kv_group is None else self._tables[kv_group]
            if parent is None:
                self.stats.unknown_parent += n - first_new
                return self._emit_stored(emitted, tier, kind, group)
            end0 = parent.word[parent_hash] >> END_SHIFT
            chain0 = parent.chain[parent_hash]
            tail0 = parent.tail.get(parent_hash, b"")
            tail_mm0 = unpack_mm(parent.mm.get(parent_hash))
        bs = self.block_size
        run = tail0 + u32_bytes(ev.token_ids[first_new * be : usable * be])
        base = end0 - len(tail0) // 4  # absolute position of run's first token, a boundary
        items: set[MmItem] = set(tail_mm0) if tail_mm0 or keys is not None else _NO_ITEMS
        for i, entry in enumerate(keys[first_new:usable] if keys is not None else ()):
            block_start = end0 + i * be
            for ident, offset in entry.mm:
                if block_start + offset >= base:  # earlier starts are in hashed blocks
                    items.add(MmItem(block_start + offset, ident))
        extras = None
        if items:
            extras = mm_block_extras([MmItem(it.start - base, it.identifier) for it in items], bs)
        hashes: list[int] = []
        if len(run) >= 4 * bs:  # else no router block completes: nothing to hash
            hashes = hash_prompt(run, bs, 0, parent=chain0, extras=extras).hashes
        kv_groups, is_kv = self._kv_group, kind is Kind.KV
        # canonical blocks completed on tiers other than this event's (by blocks it extends)
        elsewhere: dict[int, list[int]] | None = None
        held = self._held.get(group) if is_kv else None
        if is_kv and hashes:
            if held is None and be % bs:  # router blocks span several engine blocks
                held = self._held[group] = {}
            if held is not None:
                # engine blocks each overlaps (the grid of engine block ends is end0's)
                start = base - end0
                for c in hashes:
                    if c not in held:
                        held[c] = -(-(start + bs) // be) - start // be
                    start += bs
            if tail0:
                elsewhere = self._extend_ancestors(group, parent_hash, base, hashes[0])
        # a new block's covers: all held on this tier with it (one engine block each, no
        # copies), or counted in ``held`` inline (no copies), or by ``_gain``
        plain = self._copies is None and held is None
        inline = self._copies is None and held is not None
        t = bit.bit_length()
        step = HELD_STEP[t]
        kind_bits = word(0, kind, bit)
        prev_hash = parent_hash
        for i, h in enumerate(ev.block_hashes[first_new:usable]):
            end = end0 + (i + 1) * be
            done = (end - base) // bs  # complete router blocks of run up to ``end``
            start_blk = (end - be - base) // bs
            chain = hashes[done - 1] if done else chain0
            tail = run[4 * done * bs : 4 * (end - base)]
            if is_kv:  # every canonical block it overlaps that is complete by now
                covers = hashes[start_blk : min(-(-(end - base) // bs), len(hashes))]
            elif not tail and done:
                covers = [chain]
            else:
                covers = []
                self.stats.unaligned_state += 1
            # (the first is not known: the loop over known blocks stopped there)
            w = words.get(h) if i else None
            if w is None:
                w = end << END_SHIFT | kind_bits
                mm = pack_mm(_items_within(items, base + done * bs, end)) if items else b""
                table.add(h, prev_hash, w, chain, covers, tail, mm)
                if is_kv:
                    kv_groups[h] = group
                elif self.on_checkpoint is not None:
                    self.on_checkpoint(end)
                if plain:
                    emitted.extend(covers)
                elif inline:
                    for c in covers:
                        count = held[c] = held[c] + step  # type: ignore[index]
                        if held_count(count, t) == held_count(count, 0):
                            emitted.append(c)
                elif covers:
                    emitted.extend(self._gain(group, w, bit, covers))
            else:
                # stored again (vLLM: a new copy of a block whose ancestor was evicted):
                # the canonical blocks this event completes over it are its too
                had = table.covers_of(h)
                more = [c for c in covers if c not in had] if is_kv else []
                if more:
                    table.set_covers(h, (*had, *more))
                    for b in tier_bits(w & MEDIA_BITS):
                        done_on = self._gain(group, w, b, more)
                        if done_on:
                            if elsewhere is None:
                                elsewhere = {}
                            elsewhere.setdefault(b, []).extend(done_on)
                if not w & bit:
                    w = words[h] = w | bit
                    emitted.extend(self._gain(group, w, bit, table.covers_of(h)))
            prev_hash = h
        if elsewhere:
            emitted.extend(elsewhere.pop(bit, ()))
            out = self._emit_stored(emitted, tier, kind, group)
            for b, more in elsewhere.items():
                out.extend(self._emit_stored(more, Tier(b.bit_length() - 1), kind, group))
            return out
        return self._emit_stored(emitted, tier, kind, group)

    def _block_keys(self, ev: EngineBlockStored, n: int) -> Sequence[BlockKeys] | None:
        """Each block's extra keys read (None, counted as an error, when malformed)."""
        raw = ev.extra_keys
        if raw is None:
            return [NO_KEYS] * n
        if not isinstance(raw, (list, tuple)) or len(raw) != n:
            self.stats.error(f"extra_keys is not one entry per block ({n})")
            return None
        keys = [read_extra_keys(entry, ev.lora_name) for entry in raw]
        for i in range(1, n):
            if keys[i].salt is not None:  # a salt keys only the sequence's first block
                keys[i] = BlockKeys(opaque=True)
        if keys and keys[0].salt is not None and ev.parent_block_hash is not None:
            keys[0] = BlockKeys(opaque=True)
        return keys

    def _extend_ancestors(
        self, group: int, parent: int | None, base: int, canonical: int
    ) -> dict[int, list[int]] | None:
        """``canonical`` (the router block starting at ``base``) also overlaps the ancestors
        whose tokens formed the tail: record it in their covers, held on their tiers. Returns
        the tiers (by bit) where that completes it, if any."""
        done: dict[int, list[int]] | None = None
        one = (canonical,)
        held = self._held.get(group)
        count = None if held is None or self._copies is not None else held.get(canonical)
        counted = self._copies is not None or count is not None
        table = self._tables[group]
        words = table.word
        while parent is not None:
            w = words.get(parent)
            if w is None or w >> END_SHIFT <= base:
                return done
            had = table.covers_of(parent)
            if canonical not in had:
                table.set_covers(parent, (*had, canonical))
                if count is not None:  # _gain inline: no copies to count
                    for t in TIER_SLOTS[w & MEDIA_BITS]:
                        count = held[canonical] = count + HELD_STEP[t]  # type: ignore[index]
                        if held_count(count, t) == held_count(count, 0):
                            done = done or {}
                            done.setdefault(1 << (t - 1), []).append(canonical)
                elif counted:
                    for bit in tier_bits(w & MEDIA_BITS):
                        if self._gain(group, w, bit, one):
                            done = done or {}
                            done.setdefault(bit, []).append(canonical)
            parent = table.parent.get(parent)
        return done


def _is_window(kind: str | None) -> bool:
    return kind is not None and (kind in WINDOW_KINDS or kind.strip().lower() in WINDOW_KINDS)


def _items_within(items: set[MmItem], start: int, end: int) -> tuple[MmItem, ...]:
    if not items:
        return ()
    return tuple(sorted(it for it in items if start <= it.start < end))
