"""Canonical index events (what the engine model records) -> vLLM-format engine events.

The engine model names blocks by canonical hashes (router block size ``B``). A real engine
would publish its *own* hashes, block size and ``token_ids``; to exercise the publisher's
re-blocking the mock does the same: it remembers, for every canonical block of the prompts it
served, its parent and its tokens, and publishes engine blocks of ``engine_block_size``
tokens (``B / k`` or ``B * k``) under engine hashes derived from the canonical ones.

* KV blocks go to group 0 (full attention); a ``B * k`` engine block is published once all
  ``k`` canonical blocks it spans are stored, and removed when any of them is.
* Recurrent-state checkpoints go to group 1 (``kv_cache_spec_kind="mamba"``) as vLLM 0.34's
  mamba "align" mode publishes them: the hash of the engine block ending exactly at the
  checkpoint only (engine hashes are shared between groups), with the tokens of the range
  the step cached (``STATE_SPAN`` canonical blocks; a checkpoint on a ``B * k`` engine grid
  is one engine block).
* A sliding-window model (``sliding_window`` tokens): its engine model records each block's
  window KV as a state event; those go to group 1 as ``kv_cache_spec_kind="sliding_window"``
  with ``kv_cache_spec_sliding_window``, every engine block of the canonical block, as vLLM
  publishes a window group (engine blocks no larger than the router's).
* Tier ``CPU`` becomes ``medium="CPU"``.
* A request's cache salt keys the first block of its chain, as the engines publish it:
  vLLM in that block's ``extra_keys`` (``salt_field="extra_keys"``), SGLang in the event's
  ``cache_salt`` (``salt_field="cache_salt"``).
* A prompt's images key every engine block their placeholder tokens overlap, in that block's
  ``extra_keys`` as vLLM 0.34 publishes them: ``(identifier, offset of the image's start from
  the block's)`` pairs before the salt (``generate_block_hash_extra_keys`` then
  ``to_event_extra_keys``; router/mock/images.py ``block_keys``): in KV events and in a
  checkpoint's kept block, not in sliding-window events (placed by hash).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import xxhash

from router.core.types import AllCleared, BlocksRemoved, BlocksStored, IndexEvent, Kind, Tier
from router.events.model import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEvent,
)
from router.mock.images import ImageItem, block_keys

_MASK = 2**64 - 1
# canonical blocks a published checkpoint's range spans (vLLM lists the tokens of every block
# a step cached and the hash of the kept checkpoint only)
STATE_SPAN = 4


@dataclass(slots=True)
class _Known:
    parent: int | None
    tokens: tuple[int, ...]
    depth: int  # index of the block in its chain (0 = first block)
    salt: str | None = None  # the chain's cache salt (it keys the first block)
    images: tuple[ImageItem, ...] = ()  # the prompt's images overlapping the block

    def start(self, block_size: int) -> int:
        return self.depth * block_size


_MmKeys = tuple[tuple[str, int], ...]
_NO_MM: _MmKeys = ()


class EngineEventEncoder:
    """Keeps the canonical-block map and turns canonical events into engine events."""

    def __init__(
        self,
        block_size: int,
        engine_block_size: int,
        salt: int = 0x5EED,
        salt_field: Literal["extra_keys", "cache_salt"] = "extra_keys",
        sliding_window: int = 0,
    ) -> None:
        small, large = sorted((block_size, engine_block_size))
        if large % small:
            raise ValueError("engine block size must divide or be a multiple of the block size")
        if sliding_window and engine_block_size > block_size:
            raise ValueError("a sliding-window model's engine blocks must divide the block size")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.engine_block_size = engine_block_size
        self.salt = salt
        self.salt_field = salt_field
        self._known: dict[int, _Known] = {}
        self._media: dict[int, int] = {}  # canonical hash -> tier bits stored (KV)
        self._ends: dict[int, int] = {}  # B*k engine blocks: canonical -> last canonical of it
        self.unknown = 0

    def __len__(self) -> int:
        return len(self._known)

    # ------------------------------------------------------------------ learning

    def learn(
        self,
        hashes: list[int],
        tokens: list[int],
        cache_salt: str | None = None,
        images: tuple[ImageItem, ...] = (),
    ) -> None:
        """Remember parent and tokens of every full block of a prompt (``hashes`` computed
        with ``cache_salt`` and ``images``, which its events carry)."""
        b, be = self.block_size, self.engine_block_size
        parent: int | None = None
        for i, h in enumerate(hashes):
            if h not in self._known:
                start, end = i * b, (i + 1) * b
                mine = tuple(im for im in images if im.start < end and im.start + im.length > start)
                self._known[h] = _Known(parent, tuple(tokens[start:end]), i, cache_salt, mine)
            parent = h
        if be > b:
            k = be // b
            for i in range(0, len(hashes) - k + 1, k):
                for h in hashes[i : i + k]:
                    self._ends[h] = hashes[i + k - 1]

    # ------------------------------------------------------------------ naming

    def _engine_hash(self, canonical: int, part: int) -> int:
        data = (canonical & _MASK).to_bytes(8, "little") + part.to_bytes(4, "little")
        return xxhash.xxh3_64_intdigest(data, seed=self.salt)

    def _sub_blocks(self, h: int) -> list[tuple[int, int | None, tuple[int, ...], _MmKeys]]:
        """(engine hash, engine parent, tokens, multimodal keys) of the engine blocks ending
        inside canonical block ``h`` (``B / k`` engine blocks: k of them; ``B * k``: one, or
        none)."""
        known = self._known[h]
        be, b = self.engine_block_size, self.block_size
        if be <= b:
            k = b // be
            prev = self._last_engine_hash(known.parent)
            out = []
            base = known.start(b)
            for j in range(k):
                eh = self._engine_hash(h, j)
                mm = _NO_MM
                if known.images:
                    start = base + j * be
                    mm = tuple(block_keys(known.images, start, start + be))
                out.append((eh, prev, known.tokens[j * be : (j + 1) * be], mm))
                prev = eh
            return out
        k = be // b
        if (known.depth + 1) % k:
            return []
        chain = [h]
        cur = known
        for _ in range(k - 1):
            if cur.parent is None or cur.parent not in self._known:
                return []
            chain.append(cur.parent)
            cur = self._known[cur.parent]
        chain.reverse()
        tokens = tuple(t for c in chain for t in self._known[c].tokens)
        images = dict.fromkeys(im for c in chain for im in self._known[c].images)
        end = known.start(b) + b
        mm = tuple(block_keys(list(images), end - be, end)) if images else _NO_MM
        return [(self._engine_hash(h, 0), self._last_engine_hash(cur.parent), tokens, mm)]

    def _last_engine_hash(self, h: int | None) -> int | None:
        """Engine hash of the engine block ending where canonical block ``h`` ends."""
        if h is None:
            return None
        be, b = self.engine_block_size, self.block_size
        if be <= b:
            return self._engine_hash(h, b // be - 1)
        return self._engine_hash(h, 0)

    # ------------------------------------------------------------------ conversion

    def convert(self, events: list[IndexEvent]) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        for ev in events:
            if isinstance(ev, AllCleared):
                self._media.clear()
                out.append(EngineAllCleared())
            elif isinstance(ev, BlocksStored):
                out.extend(self._stored(ev))
            elif isinstance(ev, BlocksRemoved):
                out.extend(self._removed(ev))
        return out

    def _medium(self, tier: Tier) -> str:
        return tier.name

    def _stored(self, ev: BlocksStored) -> list[EngineEvent]:
        out: list[EngineEvent] = []
        run_parent: int | None = None  # the KV chain being gathered into one event
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_mm: list[_MmKeys] = []
        run_salt: str | None = None
        # a sliding-window model's state events are its window blocks: chains, as KV's
        window = ev.kind is Kind.STATE and self.sliding_window > 0
        for h in ev.hashes:
            if h not in self._known:
                self.unknown += 1
                continue
            if ev.kind is Kind.STATE and not window:
                state = self._state_block(h)
                if state is not None:
                    eh, parent, tokens = self._state_range(h, state[:3])
                    # the salt keys the chain's first block: only the kept block's keys go out
                    first = parent is None and len(tokens) == self.engine_block_size
                    salt_of = self._known[h].salt if first else None
                    keys, salt = self._salted(salt_of, 1, [state[3]])
                    out.append(
                        EngineBlockStored(
                            (eh,),
                            parent,
                            tokens,
                            self.engine_block_size,
                            medium=self._medium(ev.tier),
                            group_idx=1,
                            kv_cache_spec_kind="mamba",
                            extra_keys=keys,
                            cache_salt=salt,
                        )
                    )
                continue
            if not window:
                self._media[h] = self._media.get(h, 0) | (1 << ev.tier)
            for eh, parent, tokens, mm in self._sub_blocks(h):
                if run_hashes and parent == run_hashes[-1]:
                    run_hashes.append(eh)
                    run_tokens.extend(tokens)
                    run_mm.append(mm)
                    continue
                self._flush_run(
                    out, run_parent, run_hashes, run_tokens, ev.tier, run_salt, window, run_mm
                )
                run_parent, run_hashes, run_tokens, run_mm = parent, [eh], list(tokens), [mm]
                run_salt = self._known[h].salt if parent is None and not window else None
        self._flush_run(out, run_parent, run_hashes, run_tokens, ev.tier, run_salt, window, run_mm)
        return out

    def _salted(
        self, salt: str | None, blocks: int, mm: list[_MmKeys] | None = None
    ) -> tuple[object, str | None]:
        """``(extra_keys, cache_salt)`` of an event of ``blocks`` blocks that starts a chain
        salted with ``salt`` (the fields that carry the salt, by engine), its blocks keyed
        with ``mm`` (one entry a block: vLLM's order, the images' keys before the salt)."""
        if not (mm and any(mm)):
            if salt is None:
                return None, None
            if self.salt_field == "cache_salt":
                return None, salt
            return ((salt,), *((None,) * (blocks - 1))), None
        keys: list[object] = [entry or None for entry in mm]
        cache_salt = None
        if salt is not None:
            if self.salt_field == "cache_salt":
                cache_salt = salt
            else:
                keys[0] = (*mm[0], salt)
        return tuple(keys), cache_salt

    def _flush_run(
        self,
        out: list[EngineEvent],
        parent: int | None,
        hashes: list[int],
        tokens: list[int],
        tier: Tier,
        salt: str | None = None,
        window: bool = False,
        mm: list[_MmKeys] | None = None,
    ) -> None:
        """One event per chain of consecutive blocks, as vLLM's block pool records one
        ``BlockStored`` per request, step and group (``cache_full_blocks``): KV in group 0,
        or (``window``) sliding-window blocks in group 1, without extra keys (a router places
        them by the hash they share with the full-attention blocks)."""
        if not hashes:
            return
        keys, cache_salt = self._salted(salt, len(hashes), None if window else mm)
        out.append(
            EngineBlockStored(
                tuple(hashes),
                parent,
                tuple(tokens),
                self.engine_block_size,
                medium=self._medium(tier),
                group_idx=1 if window else 0,
                kv_cache_spec_kind="sliding_window" if window else "full_attention",
                extra_keys=keys,
                cache_salt=cache_salt,
                kv_cache_spec_sliding_window=self.sliding_window if window else None,
            )
        )

    def _state_range(
        self, h: int, state: tuple[int, int | None, tuple[int, ...]]
    ) -> tuple[int, int | None, tuple[int, ...]]:
        """A checkpoint as vLLM (mamba "align" mode) publishes it: the tokens of the range
        the step cached (here up to ``STATE_SPAN`` canonical blocks ending at it, from the
        chain's start at the earliest), the hash of the kept block at its end only."""
        eh = state[0]
        if self.engine_block_size > self.block_size:
            return state  # (state only on the engine grid: one engine block)
        span: list[tuple[int, ...]] = []
        cur: int | None = h
        start_parent: int | None = None
        for _ in range(STATE_SPAN):
            known = self._known.get(cur) if cur is not None else None
            if known is None:
                break
            span.append(known.tokens)
            start_parent = known.parent
            cur = known.parent
            if cur is None:
                break
        if len(span) <= 1:
            return state
        tokens = tuple(t for block in reversed(span) for t in block)
        return eh, self._last_engine_hash(start_parent), tokens

    def _state_block(self, h: int) -> tuple[int, int | None, tuple[int, ...], _MmKeys] | None:
        """The engine block ending exactly at the end of canonical block ``h``."""
        be, b = self.engine_block_size, self.block_size
        if be <= b:
            subs = self._sub_blocks(h)
            return subs[-1] if subs else None
        subs = self._sub_blocks(h)
        return subs[0] if subs else None  # only on the engine grid

    def _removed(self, ev: BlocksRemoved) -> list[EngineEvent]:
        hashes: list[int] = []
        be, b = self.engine_block_size, self.block_size
        for h in ev.hashes:
            known = self._known.get(h)
            if known is None:
                continue
            if ev.kind is Kind.STATE and self.sliding_window:
                hashes.extend(self._engine_hash(h, j) for j in range(b // be - 1, -1, -1))
                continue
            if ev.kind is Kind.STATE:
                state = self._state_block(h)
                if state is not None:
                    hashes.append(state[0])
                continue
            media = self._media.get(h, 0) & ~(1 << ev.tier)
            if media:
                self._media[h] = media
            else:
                self._media.pop(h, None)
            if be <= b:
                hashes.extend(self._engine_hash(h, j) for j in range(b // be - 1, -1, -1))
            elif h in self._ends:
                hashes.append(self._engine_hash(self._ends[h], 0))
        if not hashes:
            return []
        group = 1 if ev.kind is Kind.STATE else 0
        return [EngineBlockRemoved(tuple(dict.fromkeys(hashes)), self._medium(ev.tier), group)]
