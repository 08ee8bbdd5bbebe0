"""The scheduler of the replica model (``sim.engine.EngineModel``): which sequences run the
next step, and what each must hold to run it.

:class:`Scheduler` decides, between steps, the three things the engine's stepping
(sim/engine.py) asks of it:

* admission (``_enqueue``, ``_try_admit``): the queue's order (FCFS, or by (priority,
  arrival)); whether the head of the queue fits (the engine's step admits heads while token
  budget, a running slot and memory are left); for each, its cache hit (none if it reads no
  cache; a resumed one's written answer blocks count): the longest cached prefix of its
  blocks on GPU, extended over the host tier, cut to whole engine blocks, then (eagle) less
  the draft head's block, (hybrid) back to the last recurrent-state checkpoint, (sliding
  window) back to where the window before it is cached;
* decode block growth (``_steps_that_fit``, ``_allocate``): how many decode steps the running
  sequences' new blocks allow, and the blocks the finished steps wrote into;
* preemption (``_room_for_decoders``, ``_preempt``): the running sequences sent back to the
  queue when the next step's blocks do not fit; and the end of a sequence (``_complete``).

The rules are in sim/engine.py's module docstring. Like :class:`BlockCache`, it is a mixin
of ``EngineModel`` (the hot path reads the engine's attributes, declared below, directly);
``EngineModel.__init__`` sets them. Every method runs at one instant and reads no clock.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import cast

from router.core.engine_hits import eagle_limit
from router.core.types import BlocksRemoved, BlocksStored, Tier
from sim.block_cache import STATE_TAG, WINDOW_TAG, BlockCache, _negative, _plus1
from sim.engine_requests import EngineOutput, Finished, _Seq


def _new_blocks(seq: _Seq, steps: int, block: int) -> int:
    """Blocks ``seq`` must add (<= 0: none) to run ``steps`` more decode steps: step j of a
    sequence with ``out`` tokens writes the KV of its first ``prompt + out - 1 + j``."""
    return -(-(seq.prompt + seq.out - 1 + steps) // block) - seq.blocks


class Scheduler(BlockCache):
    """Admission, decode block growth and preemption (see the module docstring).
    Attributes, set by the engine (besides the cache's):"""

    by_priority: bool
    engine_block_size: int
    _waiting: deque[_Seq]
    _prefilling: list[_Seq]
    _decoding: list[_Seq]
    _loading: list[_Seq]
    _dec_ctx: int
    _by_id: dict[str, _Seq]
    _out: list[EngineOutput]
    preemptions: int
    _admissions: int

    # ------------------------------------------------------------------ decode blocks

    def _free_blocks(self) -> float:
        """Memory free now or held only by evictable cached entries."""
        return self._free_cost - self._deficit(0)

    def _growth(self, decoders: list[_Seq], steps: int) -> int:
        """New blocks ``decoders`` need to run ``steps`` more decode steps."""
        block = self.block_size
        return sum(max(0, _new_blocks(s, steps, block)) for s in decoders)

    def _steps_that_fit(self, decoders: list[_Seq], steps: int) -> int:
        """The most of ``steps`` decode steps whose new blocks fit (at least 1: the caller
        made room for one, :meth:`_room_for_decoders`)."""
        free = self._free_blocks()
        # each decoder needs at most ceil(steps / block) new blocks: most runs fit on that
        if len(decoders) * -(-steps // self.block_size) <= free:
            return steps
        if self._growth(decoders, steps) <= free:
            return steps
        lo, hi = 1, steps - 1  # lo fits, hi + 1 does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._growth(decoders, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _allocate(self, decoders: list[_Seq], steps: int) -> None:
        """Give ``decoders`` the blocks their ``steps`` finished steps wrote into."""
        block = self.block_size
        total = 0
        for s in decoders:
            n = _new_blocks(s, steps, block)
            if n > 0:
                s.blocks += n
                s.unnamed += n
                total += n
        if total:
            self._make_room(total)
            self._reserved += total

    def _room_for_decoders(self) -> bool:
        """Preempt running sequences, most recently admitted first, until the decoders' next
        step fits; True if any was preempted (vLLM then admits nothing this step). The last
        running sequence always fits (``submit`` rejects larger requests) unless decode legs
        pulling their KV hold blocks: then it is preempted too, as vLLM preempts
        ``running[-1]``, the request failing to allocate itself."""
        preempted = False
        while (
            self._decoding
            and (len(self._decoding) + len(self._prefilling) > 1 or self._loading)
            and len(self._decoding) > self._free_blocks()  # a step needs <= 1 block each
            and self._growth(self._decoding, 1) > self._free_blocks()
        ):
            victim = max((*self._prefilling, *self._decoding), key=self._victim_order)
            self._preempt(victim)
            preempted = True
        return preempted

    def _victim_order(self, seq: _Seq) -> tuple[int, float]:
        """The running sequence preempted first is the greatest: vLLM preempts the last
        admitted (FCFS), or the last in (priority, arrival) order."""
        return (seq.priority, seq.submitted) if self.by_priority else (0, seq.admitted)

    def _enqueue(self, seq: _Seq, *, front: bool) -> None:
        """Queue ``seq``: FCFS at the back (``front``: a preempted one, at the head); by
        priority in (priority, arrival) order, a preempted one included."""
        waiting = self._waiting
        if not self.by_priority:
            if front:
                waiting.appendleft(seq)
            else:
                waiting.append(seq)
            return
        key = (seq.priority, seq.submitted)
        i = len(waiting)
        while i and (waiting[i - 1].priority, waiting[i - 1].submitted) > key:
            i -= 1
        waiting.insert(i, seq)

    def _preempt(self, seq: _Seq) -> None:
        decoding = seq in self._decoding
        if decoding:
            self._decoding.remove(seq)
            self._dec_ctx -= seq.prompt + seq.out
        else:
            self._prefilling.remove(seq)
        # the blocks it computed stay cached; its answer's blocks too once decoded
        self._release(seq, named_output=decoding)
        # vLLM recomputes every token it holds; the last one's logits give the next token
        seq.target = seq.prompt + seq.out
        # a decode leg's transferred KV arrived at its admission (and it has its first token
        # by the next step, before any preemption): what the cache lost is recomputed here
        seq.remote = False
        seq.computed = seq.held = seq.blocks = seq.usable_blocks = seq.wheld = 0
        self._enqueue(seq, front=True)
        self.preemptions += 1

    def _complete(self, seq: _Seq, t: float) -> None:
        del self._by_id[seq.rid]
        self._release(seq, named_output=True)
        self._out.append(Finished(seq.rid, t, seq.prompt, seq.cached, seq.out))

    # ------------------------------------------------------------------ admission

    def _resumed_chain(self, seq: _Seq) -> list[int]:
        """A resumed sequence's full blocks: its prompt's, then its answer's whose KV it wrote
        (up to the first name that repeats, as for a prompt)."""
        chain = list(seq.hashes[: seq.nfull])
        seen = set(chain)
        written = (seq.prompt + seq.out - 1) // self.block_size - seq.nfull
        for h in seq.out_hashes[: max(0, written)]:
            if h in seen:
                break
            seen.add(h)
            chain.append(h)
        return chain

    def _try_admit(self, seq: _Seq, now: float) -> bool:
        hashes = seq.hashes
        nfull = seq.nfull
        gpu = self._gpu
        if seq.out and seq.out_hashes and nfull == seq.prompt // self.block_size:
            # resumed: vLLM hashes the answer's blocks too, so the ones it wrote (named as it
            # was preempted, _release_kv) are part of the prefix it can hit
            hashes = self._resumed_chain(seq)
            nfull = len(hashes)
        # The cache is prefix-closed (blocks are named parents first and evicted children
        # first), so the hit length is found by bisection (then cut at a missing block, below).
        if nfull and seq.reads_cache and hashes[nfull - 1] in gpu:
            kv = nfull
        elif not nfull or not seq.reads_cache or hashes[0] not in gpu:
            kv = 0
        else:
            lo, hi = 1, nfull - 1  # block lo-1 cached, block hi not
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] in gpu:
                    lo = mid + 1
                else:
                    hi = mid
            kv = lo
        hit = hashes[:kv]
        found = list(map(gpu.get, hit))
        if None in found:  # not closed: answer blocks named apart by requests sharing them
            kv = found.index(None)
            hit = hit[:kv]
            del found[kv:]
        refs = cast("list[int]", found)
        in_free = sum(map(_negative, refs))  # unreferenced: in the LRU
        reach = kv  # KV hit including host-tier blocks
        cpu = self._cpu
        if cpu and seq.reads_cache:
            while reach < nfull and hashes[reach] in cpu:
                reach += 1
        align = self._align
        usable = reach // align * align  # whole engine blocks
        state_at = self._state_at
        if self.profile.eagle:
            # vLLM caps a hit at N - 1 and gives back its last block (the draft head's
            # peek); a hybrid model's draft group first looks one block past the cap within
            # the prompt's whole blocks (router.core.engine_hits.eagle_limit)
            cap = eagle_limit(seq.target, self.block_size, True, self.hybrid) // align * align
            usable = max(min(usable, cap) - align, 0)
        if self.hybrid:
            # a checkpoint at the prompt's very end serves no one (vLLM caps a hit at N - 1,
            # in whole engine blocks)
            usable = min(usable, max(seq.target - 1, 0) // self.block_size // align * align)
            while usable > 0 and (hashes[usable - 1] | STATE_TAG) not in state_at:
                usable -= 1
        window: list[int] = []
        window_free = 0.0  # memory of the window blocks the hit takes out of the LRU
        if self.window:
            # vLLM caps a hit at N - 1; the window before the hit's end must be cached
            usable = min(usable, max(seq.target - 1, 0) // self.block_size)
            usable = self._window_hit(hashes, usable)
            window = [h | WINDOW_TAG for h in hashes[max(0, usable - self.window) : usable]]
            win = self._win
            window_free = sum(1 for key in window if win[key] < 0) * self._window_cost
        loads = max(0, usable - kv)  # host blocks reloaded into GPU
        total = -(-seq.target // self.block_size)
        need = total - kv
        used = self._used()
        room = self.capacity - used + self._free_cost - in_free - window_free
        # the running go first: their next step's blocks (at most one each) stay free
        if need > room - len(self._decoding) and need > room - self._growth(self._decoding, 1):
            return False
        # pin the GPU hit, take the host blocks back, evict for the rest
        pinned = seq.pinned
        if in_free == kv:
            gpu.update(zip(hit, repeat(1)))
        else:
            gpu.update(zip(hit, map(_plus1, map(max, refs, repeat(0))), strict=True))
        pinned.extend(hit)
        self._free_cost -= in_free
        if self.hybrid and usable:
            key = hashes[usable - 1] | STATE_TAG
            state_at[key] = self._lru_push([key], True)  # move to the LRU's young end
        if window:  # the hit's window is pinned (vLLM: the group's blocks before it are null)
            win = self._win
            for key in window:
                r = win[key]
                win[key] = r + 1 if r > 0 else 1
            self._free_cost -= window_free
            seq.window = window
            seq.wheld = usable
        deficit = used + need - self.capacity
        if loads:
            # Take the host blocks before evicting: evicted blocks move to the host tier and
            # could push the very blocks being reloaded out of it.
            moved = hashes[kv:usable]
            for h in moved:
                del cpu[h]
                gpu[h] = 1
                pinned.append(h)
            self._events.append(BlocksRemoved(tuple(moved), Tier.CPU))
            self._events.append(BlocksStored(tuple(moved), Tier.GPU))
            seq.load_s = loads * self.block_size * self.profile.cpu_load_s_per_token
        if deficit > 0:
            self._evict(deficit)
        seq.unnamed = need - loads
        seq.held = max(kv, usable)
        self._reserved += seq.unnamed
        seq.blocks = total
        seq.usable_blocks = usable
        # vLLM's hit: whole engine blocks, the last token's block recomputed
        ebs = self.engine_block_size
        seq.computed = min(usable * self.block_size, max(seq.target - 1, 0) // ebs * ebs)
        if not seq.admitted:  # what a response reports: the first admission's
            seq.kv_hit = min(reach * self.block_size, seq.prompt)
            seq.cached = seq.computed
            seq.queued_s = now - seq.submitted
        self._admissions += 1
        seq.admitted = self._admissions
        return True

    def _kv_arrived(self, seq: _Seq) -> float:
        """A decode leg admitted (:meth:`_try_admit`) whose pulled KV has arrived joins the
        step being scheduled: its prompt is named (and published) as computed, and the step
        recomputes its last prompt token, which samples the first one (vLLM 0.34
        ``_update_waiting_for_remote_kv``: ``num_computed_tokens = num_tokens - 1``). It
        takes one token of the step's budget (the caller's); returns that token's compute
        time. The caller schedules it as a chunk of 0 tokens: nothing is left to name."""
        old = seq.computed
        seq.computed = seq.prompt
        # its window KV is pinned at the end of its step, after the decoders' blocks: the
        # room _try_admit found kept those free, not the window's too
        self._computed(seq, old // self.block_size, seq.nfull, windows=False)
        return float(self.profile.cost.prefill_s(1, seq.prompt - 1))
