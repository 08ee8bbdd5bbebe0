"""KV block cache bookkeeping of the replica model (``sim.engine.EngineModel``).

:class:`BlockCache` holds the methods that name, pin, release, evict and offload blocks and
recurrent-state checkpoints. It is a mixin of ``EngineModel`` rather than a separate object
because this code runs once per block on the simulator's hot path: the methods read the
engine's own attributes (declared below, set by ``EngineModel.__init__``) without an extra
indirection. The cache rules are described in sim/engine.py's module docstring.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import compress, islice, repeat
from operator import eq
from typing import TYPE_CHECKING, Any

from router.core.engine_hits import prompt_end_checkpoint
from router.core.types import BlocksRemoved, BlocksStored, IndexEvent, Kind, Tier
from router.events.window import WindowChange, WindowGroup

if TYPE_CHECKING:
    from sim.engine_requests import _Seq
    from sim.profiles import EngineProfile

STATE_TAG = 1 << 64  # cache key of the state checkpoint after block h is ``h | STATE_TAG``
WINDOW_TAG = 1 << 65  # cache key of block h's sliding-window KV is ``h | WINDOW_TAG``

# Bulk helpers: the cache bookkeeping runs per block, so the common cases are done with
# C-level map/compress/update calls instead of Python loops (same results, in the same order).
_SINK: deque[object] = deque(maxlen=0)
_consume = _SINK.extend  # exhaust an iterator
_plus1 = (1).__add__
_minus1 = (-1).__add__
_is1 = (1).__eq__
_negative = (0).__gt__


class BlockCache:
    """Cache bookkeeping (see the module docstring). Attributes, set by the engine:"""

    profile: EngineProfile
    block_size: int
    _align: int
    capacity: int
    cpu_capacity: int
    hybrid: bool
    _state_cost: float
    _grid: int
    _events: list[IndexEvent]
    _gpu: dict[int, int]
    _state_at: dict[int, int]
    _lru: deque[list[Any]]
    _lru_len: int
    _stamp: int
    _free_cost: float
    _states: int
    _reserved: int
    _cpu: OrderedDict[int, None]
    window: int
    publish_window_blocks: bool
    _window_cost: float
    _win: dict[int, int]
    _windows: int
    _window_group: WindowGroup | None

    # ------------------------------------------------------------------ cache bookkeeping
    #
    # ``_gpu[h]`` is the refcount (> 0) of a named GPU block, or ``~stamp`` (< 0) when it is
    # unreferenced and sits in the LRU; ``_state_at[key]`` is ``~stamp`` for every state
    # checkpoint (all of them sit in the LRU). The LRU is a deque of runs
    # ``[stamp, keys, offset, mixed]``, oldest first: releasing a request appends one run. An
    # entry is live iff its key still carries its run's stamp; re-pinning or moving a key to
    # the young end just re-stamps it, leaving a stale entry that eviction skips. This is the
    # same order as a per-block LRU list, at a per-run rather than per-block Python cost.

    def _lru_push(self, keys: list[int], mixed: bool) -> int:
        """Append ``keys`` (oldest first) as one run; return the tag the caller must store
        for each of them (in ``_gpu`` for KV blocks, ``_state_at`` for checkpoints)."""
        self._stamp += 1
        self._lru.append([self._stamp, keys, 0, mixed])
        self._lru_len += len(keys)
        if self._lru_len > 4 * (len(self._gpu) + len(self._state_at)) + 16384:
            self._lru_compact()
        return ~self._stamp

    def _lru_compact(self) -> None:
        """Drop stale entries (amortised O(1) a push: runs only when most entries are)."""
        gpu_get = self._gpu.get
        state_get = self._state_at.get
        win_get = self._win.get
        runs: deque[list[Any]] = deque()
        size = 0
        for run in self._lru:
            stamp, keys, off, mixed = run
            tag = ~stamp
            if mixed:
                keep = [
                    k
                    for k in islice(keys, off, None)
                    if (
                        win_get(k)
                        if k >= WINDOW_TAG
                        else state_get(k)
                        if k >= STATE_TAG
                        else gpu_get(k)
                    )
                    == tag
                ]
            else:
                part = keys[off:]
                keep = list(compress(part, map(eq, map(gpu_get, part), repeat(tag))))
            if keep:
                runs.append([stamp, keep, 0, mixed])
                size += len(keep)
        self._lru = runs
        self._lru_len = size

    def _computed(self, seq: _Seq, old_full: int, new_full: int, *, windows: bool = True) -> None:
        """Blocks [old_full, new_full) of ``seq`` were just computed: name and cache them,
        and take the state checkpoints the grid asks for (and their window KV unless
        ``windows`` is False: the next call takes it)."""
        hashes = seq.hashes
        gpu = self._gpu
        start = max(old_full, seq.held)
        if new_full > seq.held:
            seq.held = new_full
        stored: list[int] = []
        if new_full > start:
            new = hashes[start:new_full]
            if gpu.keys().isdisjoint(new):  # all new: the common case
                gpu.update(zip(new, repeat(1)))
                stored = new if isinstance(new, list) else list(new)
            else:
                get = gpu.get
                for h in new:
                    r = get(h)
                    if r is None:
                        gpu[h] = 1
                        stored.append(h)
                    elif r < 0:
                        gpu[h] = 1
                        self._free_cost -= 1
                    else:
                        gpu[h] = r + 1
            seq.pinned.extend(new)
            seq.unnamed -= len(new)
            self._reserved -= len(new)
        if stored:
            self._events.append(BlocksStored(tuple(stored)))
        if self.hybrid and new_full > old_full:
            self._checkpoints(seq, old_full, new_full)
        if windows and self.window and new_full > seq.wheld:
            self._window_computed(seq, seq.wheld, new_full)

    def _checkpoints(self, seq: _Seq, old_full: int, new_full: int) -> None:
        p = self.profile
        lo = max(old_full, seq.usable_blocks)
        # an engine keeps state in whole engine blocks (``a`` router blocks): a checkpoint
        # ends on an engine block boundary (vLLM's align mode cuts a prefill step there)
        a = self._align
        if seq.remote:  # a transfer carries the state at the prompt end only
            at: list[int] = []
        elif p.checkpoint == "every_block":
            at = list(range((lo // a + 1) * a, new_full + 1, a))
        elif p.checkpoint == "step_end":
            end = new_full // a * a
            at = [end] if end > lo else []
        else:
            g = self._grid
            at = [b for b in range((lo // g + 1) * g, new_full + 1, g) if not b % a]
        if p.checkpoint_prompt_end:
            # vLLM: the prefill stops where the state can serve, before the prompt's last
            # token (an EAGLE engine: one block below its end, its draft head recomputes the
            # last one); an EAGLE block-aligned prompt's last step ends on a block too
            # (router/core/engine_hits.py). vLLM's scheduler ends a chunk there, so the state
            # is kept by whichever step reaches it, not only by the one ending the prompt.
            # On the engine's block grid, as the router speculates it.
            ends = [prompt_end_checkpoint(seq.prompt, self.block_size, self._align, p.eagle)]
            if p.eagle and seq.prompt % (self.block_size * self._align) == 0:
                ends.append(seq.prompt // self.block_size)
            for end in ends:
                if lo < end <= new_full and end not in at:
                    at.append(end)
            at.sort()
        made: list[int] = []
        state_at = self._state_at
        for b in at:
            h = seq.hashes[b - 1]
            key = h | STATE_TAG
            if key in state_at:
                state_at[key] = self._lru_push([key], True)
                seq.pinned.append(key)
                continue
            if made and self._deficit(self._state_cost) > 0:
                # making room may evict a checkpoint just made: announce those first
                self._events.append(BlocksStored(tuple(made), kind=Kind.STATE))
                made = []
            if not self._make_room(self._state_cost):
                continue  # no memory for it: the engine skips the snapshot
            state_at[key] = self._lru_push([key], True)
            self._free_cost += self._state_cost
            self._states += 1
            seq.pinned.append(key)
            made.append(h)
        if made:
            self._events.append(BlocksStored(tuple(made), kind=Kind.STATE))

    def _used(self) -> float:
        """Memory taken: named KV blocks, checkpoints, window KV (referenced or evictable)
        and allocated blocks not named yet."""
        return (
            len(self._gpu)
            + self._states * self._state_cost
            + self._windows * self._window_cost
            + self._reserved
        )

    def _deficit(self, amount: float) -> float:
        """Memory missing for ``amount`` more blocks without evicting (<= 0: it fits)."""
        return self._used() + amount - self.capacity

    def _make_room(self, amount: float) -> bool:
        deficit = self._deficit(amount)
        if deficit <= 0:
            return True
        if deficit > self._free_cost:
            return False
        self._evict(deficit)
        return True

    def _evict(self, amount: float) -> None:
        """Drop least recently released unreferenced entries until ``amount`` blocks of
        memory are free (children go before parents by construction of the LRU order)."""
        runs = self._lru
        gpu = self._gpu
        gpu_get = gpu.get
        state_at = self._state_at
        kv: list[int] = []
        states: list[int] = []
        windows: list[int] = []
        win = self._win
        state_cost = self._state_cost
        window_cost = self._window_cost
        scanned = 0
        while amount > 0 and runs:
            run = runs[0]
            stamp, keys, off, mixed = run
            tag = ~stamp
            n = len(keys)
            start = off
            if mixed:
                while amount > 0 and off < n:
                    key = keys[off]
                    off += 1
                    if key >= WINDOW_TAG:
                        if win.get(key) == tag:
                            del win[key]
                            windows.append(key ^ WINDOW_TAG)
                            self._windows -= 1
                            self._free_cost -= window_cost
                            amount -= window_cost
                    elif key >= STATE_TAG:
                        if state_at.get(key) == tag:
                            del state_at[key]
                            states.append(key ^ STATE_TAG)
                            self._states -= 1
                            self._free_cost -= state_cost
                            amount -= state_cost
                    elif gpu_get(key) == tag:
                        del gpu[key]
                        kv.append(key)
                        self._free_cost -= 1
                        amount -= 1
            else:
                while amount > 0 and off < n:  # the oldest ceil(amount) live entries
                    chunk = keys[off : off + math.ceil(amount)]
                    off += len(chunk)
                    live = list(compress(chunk, map(eq, map(gpu_get, chunk), repeat(tag))))
                    if live:
                        _consume(map(gpu.__delitem__, live))
                        kv.extend(live)
                        self._free_cost -= len(live)
                        amount -= len(live)
            scanned += off - start
            if off >= n:
                runs.popleft()
            else:
                run[2] = off
        self._lru_len -= scanned
        if windows:
            self._window_evicted(windows)
        if states:
            self._events.append(BlocksRemoved(tuple(states), kind=Kind.STATE))
        if kv:
            self._events.append(BlocksRemoved(tuple(kv)))
            if self.cpu_capacity > 0:
                self._offload(kv)

    def _offload(self, blocks: list[int]) -> None:
        cpu = self._cpu
        stored: list[int] = []
        dropped: list[int] = []
        for h in blocks:
            if h in cpu:
                cpu.move_to_end(h)
                continue
            if len(cpu) >= self.cpu_capacity:
                dropped.append(cpu.popitem(last=False)[0])
            cpu[h] = None
            stored.append(h)
        if dropped:
            self._events.append(BlocksRemoved(tuple(dropped), Tier.CPU))
        if stored:
            self._events.append(BlocksStored(tuple(stored), Tier.CPU))

    def _release(self, seq: _Seq, *, named_output: bool) -> None:
        """Unpin ``seq``'s blocks tail first; name the answer's full blocks if known. The
        sliding-window blocks go after (an engine frees one group after the other)."""
        answer = self._release_kv(seq, named_output=named_output)
        if self.window:
            self._window_finished(seq, answer)

    def _release_kv(self, seq: _Seq, *, named_output: bool) -> list[int]:
        """:meth:`_release` for the KV blocks; the answer's full blocks named (oldest first)."""
        gpu = self._gpu
        answer_blocks: list[int] = []
        if named_output and seq.out_hashes and seq.nfull == seq.prompt // self.block_size:
            # the last token's KV is never written (it was sampled, not computed)
            total_full = (seq.prompt + seq.out - 1) // self.block_size
            names = dict.fromkeys(seq.out_hashes[: max(0, total_full - seq.nfull)])
            if self.window:  # their window KV is cached too (_window_finished)
                answer_blocks = list(names)
            stored = [h for h in names if h not in gpu]
            if stored:
                # parents (prompt) are unpinned below; answer blocks are children: evict first
                answer = stored[::-1]
                gpu.update(zip(answer, repeat(self._lru_push(answer, False))))
                self._free_cost += len(stored)
                self._events.append(BlocksStored(tuple(stored)))
            named = len(stored)
            seq.unnamed -= named
            self._reserved -= named
        self._reserved -= seq.unnamed
        seq.unnamed = 0
        pinned = seq.pinned
        seq.pinned = []
        if not pinned:
            return answer_blocks
        if not self.hybrid:  # KV blocks only, each pinned once
            rev = pinned[::-1]
            refs = list(map(gpu.__getitem__, rev))
            ones = refs.count(1)
            if ones == len(rev):
                gpu.update(zip(rev, repeat(self._lru_push(rev, False))))
            else:
                gpu.update(zip(rev, map(_minus1, refs), strict=True))
                if ones:
                    zeros = list(compress(rev, map(_is1, refs)))
                    gpu.update(zip(zeros, repeat(self._lru_push(zeros, False))))
            self._free_cost += ones
            return answer_blocks
        young: list[int] = []  # entries moving to the LRU's young end, oldest first
        mixed = False
        state_at = self._state_at
        for key in reversed(pinned):
            if key >= STATE_TAG:
                if key in state_at:
                    young.append(key)
                    mixed = True
                continue
            r = gpu[key] - 1
            gpu[key] = r
            if r == 0:
                young.append(key)
                self._free_cost += 1
        if not young:
            return answer_blocks
        if mixed:  # a checkpoint pinned twice moves to its last position only
            young = list(dict.fromkeys(reversed(young)))[::-1]
        tag = self._lru_push(young, mixed)
        for key in young:
            if key >= STATE_TAG:
                state_at[key] = tag
            else:
                gpu[key] = tag
        return answer_blocks

    # ------------------------------------------------------------------ sliding windows
    #
    # ``_win[h | WINDOW_TAG]`` is the refcount of block h's sliding-window KV while sequences
    # whose window covers it pin it, else ``~stamp`` in the LRU. A sequence pins the last
    # ``window`` blocks it computed (``seq.window``, oldest first) and releases each block the
    # window slides past at once (vLLM frees them during the prefill), so they are evicted
    # before the blocks a finished request releases. A prefix of L blocks is usable when the
    # ``window`` blocks before L are cached (router/events/window.py). The simulator's index
    # takes the checkpoints that rule makes of them (``_window_group``); the mock replica
    # publishes the blocks themselves, as an engine does (``publish_window_blocks``).

    def _window_computed(self, seq: _Seq, start: int, end: int) -> None:
        """Blocks [start, end) of ``seq`` were computed: cache their window KV, pinned, and
        release what the window slid past."""
        win = self._win
        hashes = seq.hashes
        cost = self._window_cost
        made: list[int] = []
        for b in range(start, end):
            key = hashes[b] | WINDOW_TAG
            r = win.get(key)
            if r is None:
                if made and self._deficit(cost) > 0:  # announce before evicting them
                    self._window_made(hashes, made)
                    made = []
                if not self._make_room(cost):
                    continue  # no memory for it: not cached
                win[key] = 1
                self._windows += 1
                made.append(b)
            elif r < 0:
                win[key] = 1
                self._free_cost -= cost
            else:
                win[key] = r + 1
            seq.window.append(key)
        seq.wheld = end
        if made:
            self._window_made(hashes, made)
        slid = len(seq.window) - self.window
        if slid > 0:
            old = seq.window[:slid]
            del seq.window[:slid]
            self._window_unpin(old)

    def _window_unpin(self, keys: list[int]) -> None:
        """Unpin ``keys``; those no sequence holds go to the LRU's young end in this order."""
        win = self._win
        young: list[int] = []
        for key in keys:
            r = win.get(key)
            if r is None or r <= 0:
                continue
            if r == 1:
                young.append(key)
            else:
                win[key] = r - 1
        if young:
            tag = self._lru_push(young, True)
            for key in young:
                win[key] = tag
            self._free_cost += len(young) * self._window_cost

    def _window_finished(self, seq: _Seq, answer: list[int]) -> None:
        """``seq`` ended: cache the window KV of its named answer blocks (unpinned) and
        release its window tail first."""
        if answer:
            win = self._win
            cost = self._window_cost
            chain = [*seq.hashes[: seq.nfull], *answer]
            made: list[int] = []
            fresh: list[int] = []
            for b in range(seq.nfull, len(chain)):
                key = chain[b] | WINDOW_TAG
                if key in win or not self._make_room(cost):
                    continue
                win[key] = 1
                self._windows += 1
                made.append(b)
                fresh.append(key)
            if made:
                self._window_made(chain, made)
                self._window_unpin(fresh)
        pinned = seq.window
        seq.window = []
        if pinned:
            self._window_unpin(pinned[::-1])

    def _window_made(self, chain: Sequence[int], positions: list[int]) -> None:
        """Window KV cached at ``positions`` of ``chain`` (block indexes): the events."""
        if self.publish_window_blocks:
            self._events.append(BlocksStored(tuple(chain[b] for b in positions), kind=Kind.STATE))
            return
        assert self._window_group is not None
        change = WindowChange()
        self._window_group.stored(
            [(chain[b], chain[b - 1] if b else None, b + 1, chain[b]) for b in positions], change
        )
        self._window_checkpoints(change)

    def _window_evicted(self, hashes: list[int]) -> None:
        if self.publish_window_blocks:
            self._events.append(BlocksRemoved(tuple(hashes), kind=Kind.STATE))
            return
        assert self._window_group is not None
        change = WindowChange()
        self._window_group.removed(hashes, change)
        self._window_checkpoints(change)

    def _window_checkpoints(self, change: WindowChange) -> None:
        if change.stored:
            self._events.append(BlocksStored(tuple(h for h, _ in change.stored), kind=Kind.STATE))
        if change.removed:
            self._events.append(BlocksRemoved(tuple(change.removed), kind=Kind.STATE))

    def _window_hit(self, hashes: Sequence[int], usable: int) -> int:
        """The longest prefix of at most ``usable`` blocks whose window is cached."""
        win = self._win
        need = self.window
        end = usable
        while end > 0:
            j = end - 1
            lo = max(0, end - need)
            while j >= lo and (hashes[j] | WINDOW_TAG) in win:
                j -= 1
            if j < lo:
                return end
            end = j  # a window ending after the missing block holds it
        return 0
