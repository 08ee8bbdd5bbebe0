"""The replica model: one inference engine with continuous batching, chunked prefill, a KV
block cache with LRU eviction, recurrent-state checkpoints and an optional host tier.

The model is clock-agnostic: it has no event heap and reads no clock. A driver calls
``submit(req, now)`` / ``cancel(id, now)`` when things happen, asks ``next_time()`` when the
engine's state next changes, and calls ``advance(now)`` to run every step that finishes by
``now``. The simulator drives it from its event heap; the mock replica from asyncio with the
wall clock (it may call ``advance`` at any time: tokens of steps already finished inside a
fast-forwarded decode run are returned as they complete).

This module is the model's driver API and its stepping: a step's duration (the cost model
below) and the fast-forwarded decode runs (``_Segment``). The rest is in three modules:
sim/engine_requests.py (the request and output values, re-exported here, and the per-request
state), sim/engine_scheduler.py (admission and its cache hit, decode block growth,
preemption) and sim/block_cache.py (naming, pinning, evicting and offloading blocks and
checkpoints); the last two are mixins of :class:`EngineModel`. The rules below are the
model's as a whole.

Scheduling (vLLM v1 style, simplified):

* Requests wait FCFS. A step first gives its token budget to the running sequences, then
  admits the head of the queue while budget is left, fewer than ``max_running`` run and its
  whole prompt fits (vLLM's ``scheduler_reserve_full_isl``): blocks for the prompt minus the cached
  prefix, after evicting unreferenced cached blocks and keeping the blocks the running
  sequences' next step needs; it looks its prefix up then and takes a chunk of what is left
  (vLLM 0.34 ``Scheduler.schedule``). No request is admitted in a step that preempted one. A request
  whose prompt + ``max_output_tokens`` - 1 tokens (+ its pinned sliding window) exceed the
  whole cache is rejected at once.
* Decode legs (``remote_prefilled``, P/D): a request whose prompt another replica computed
  is admitted like any other when it reaches the head of the queue (budget left, a running
  slot free, its whole prompt's blocks allocated at once, its local hit pinned), but its
  KV pull (``pull_s``) then starts and it leaves the queue without taking the slot or any
  budget: the requests behind it are admitted in the same step. When the pull has ended
  (its KV arrives at the start of the first step from then on; an idle engine wakes for
  it) its blocks are named and it goes before the waiting queue, taking a running slot and
  one token of budget (its last prompt token, recomputed to sample the first); its first
  token comes at the end of that step; it joins the running order (preemption's) then, as
  vLLM appends it to ``running``. A decode leg with nothing to pull (``pull_s`` 0) joins the
  step admitting it the same way. The blocks pulls hold can make even the last running
  sequence outgrow the cache: it is preempted then (vLLM preempts ``running[-1]``,
  itself). (vLLM 0.34, no ``--max-num-inflight-kv-loads``: ``load_kv_async``,
  ``WAITING_FOR_REMOTE_KVS``, ``kv_holding_waiting``, ``_update_waiting_for_remote_kv``;
  docs/simulator.md.)
* ``scheduling="priority"`` (vLLM's ``--scheduling-policy priority``): requests wait in
  order of (``priority``, arrival) instead of arrival alone, a preempted one included.
* Decoding sequences allocate a block when their context crosses a block boundary. When a
  step's new blocks do not fit, the most recently admitted running sequence is preempted
  (with priority scheduling the running sequence last in (priority, arrival) order; vLLM
  v1's recompute preemption): its blocks are released (the computed ones stay
  cached, as vLLM frees them to the prefix cache) and it goes back to the head of the
  queue; re-admitted, it recomputes its prompt and the tokens it had generated (less what the
  cache still holds, its answer's blocks too when ``output_block_hashes`` name them) and
  resumes decoding without a second first token.
* A step has a token budget ``chunk_tokens``: every decoding sequence takes one token, the
  rest goes to prefilling sequences FCFS (chunked prefill). A sequence emits its first token
  at the end of the step that completes its prompt, then one token a step.
* Step time = ``step_overhead_s`` + prefill cost of each chunk (per token, plus per attended
  context token pair) + ``decode_s_per_seq`` per decoding sequence + ``decode_s_per_ctx_token``
  per context token they attend, + host-tier reload time of a newly admitted request.
* While no sequence is prefilling, the batch composition cannot change before the next
  completion, arrival or end of a pull, so the whole run of decode steps is one *segment*
  whose duration is an arithmetic series (contexts grow by one token a step); an arrival (or
  a cancel that frees KV or the head of the queue, or a pull ending) cuts the segment at the
  end of the step in progress.

Cache:

* Blocks are named by the canonical chained hashes the router uses (``block_hashes``: the
  prompt's full blocks; ``output_block_hashes``: full blocks the answer completes, when the
  driver knows the answer's content). A block is cached as the step computing it is
  scheduled (vLLM's ``allocate_slots``): a request admitted later in that step, or after it,
  hits it; the step's index events are published at its end.
* A hit is whole engine blocks (``engine_block_size``, the router's block by default), at
  most ``(N - 1) // engine_block_size`` of them (vLLM recomputes the last prompt token and
  the block it falls in).
* Referenced blocks are pinned; unreferenced ones sit in an LRU list. A finishing request
  releases its blocks tail first, so children are always evicted before their parents.
* Hybrid models: a recurrent-state checkpoint at block boundary L (keyed by the hash of
  block L-1) is taken on the profile's grid: ``every_block``, ``step_end`` (the last block
  boundary a prefill step reaches) or ``every_n`` tokens, plus the prompt end if
  ``checkpoint_prompt_end``. Each costs ``state_checkpoint_blocks`` of KV memory. A request
  reuses the largest L <= its KV hit with a checkpoint at L; the rest is recomputed.
* Host tier (``cpu_blocks`` > 0): KV blocks evicted from GPU move to a host LRU; a later hit
  there is reloaded (``cpu_load_s_per_token``) into GPU blocks. Checkpoints stay on GPU.
* Every change is recorded as router index events (BlocksStored / BlocksRemoved with tier
  and kind), returned in order by ``take_index_events``.
* ``kv_usage`` in reports counts referenced and allocated blocks, not the reusable cached
  ones (vLLM's ``gpu_cache_usage`` convention); a prefilling sequence's only up to the
  chunk scheduled (vLLM allocates chunk by chunk; the model reserves the whole prompt).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from router.core.load import EngineReport
from router.core.types import IndexEvent, ReplicaKey, Tier
from router.events.window import WindowGroup
from sim.block_cache import STATE_TAG, WINDOW_TAG
from sim.engine_requests import (
    EngineOutput,
    EngineRequest,
    Finished,
    FirstToken,
    Rejected,
    TokensEmitted,
    _Seq,
    sampled,
)
from sim.engine_scheduler import Scheduler
from sim.profiles import EngineProfile

__all__ = [
    "STATE_TAG",
    "EngineModel",
    "EngineOutput",
    "EngineRequest",
    "Finished",
    "FirstToken",
    "Rejected",
    "TokensEmitted",
    "sampled",
]

# ---------------------------------------------------------------------------- step segments


class _Segment:
    """``steps`` steps starting at ``start``. A prefill step has ``chunks`` and steps == 1;
    a decode run's step i lasts ``base + ctx_cost * (ctx0 + i * nseq)``."""

    __slots__ = (
        "base",
        "chunks",
        "ctx0",
        "ctx_cost",
        "decoders",
        "end",
        "events",
        "nseq",
        "start",
        "steps",
    )

    def __init__(
        self,
        start: float,
        steps: int,
        base: float,
        ctx_cost: float,
        ctx0: int,
        decoders: list[_Seq],
        chunks: list[tuple[_Seq, int]],
    ) -> None:
        self.start = start
        self.steps = steps
        self.base = base
        self.ctx_cost = ctx_cost
        self.ctx0 = ctx0
        self.nseq = len(decoders)
        self.decoders = decoders
        self.chunks = chunks
        self.end = start + self.elapsed(steps)
        self.events: list[IndexEvent] = []  # a step's scheduling's, published at its end

    def elapsed(self, j: int) -> float:
        """Duration of the first ``j`` steps."""
        return j * self.base + self.ctx_cost * (j * self.ctx0 + self.nseq * j * (j - 1) / 2)

    def steps_done(self, now: float) -> int:
        """How many whole steps have finished by ``now`` (0..steps)."""
        e = now - self.start
        if e <= 0:
            return 0
        if self.steps == 1:
            return 1 if self.end <= now else 0
        a = self.ctx_cost * self.nseq / 2
        b = self.base + self.ctx_cost * self.ctx0 - a
        j = int(e / b) if a <= 0 else int((-b + math.sqrt(b * b + 4 * a * e)) / (2 * a))
        j = max(0, min(j, self.steps))
        while j < self.steps and self.start + self.elapsed(j + 1) <= now:
            j += 1
        while j > 0 and self.start + self.elapsed(j) > now:
            j -= 1
        return j


# ---------------------------------------------------------------------------- the model


class EngineModel(Scheduler):
    """One replica. Not thread-safe; times passed in must not decrease."""

    def __init__(
        self,
        profile: EngineProfile,
        replica: ReplicaKey,
        block_size: int,
        *,
        kv_blocks: int | None = None,
        cpu_blocks: int | None = None,
        emit_tokens: bool = True,
        publish_window_blocks: bool = False,
        engine_block_size: int | None = None,
        scheduling: str = "fcfs",
    ) -> None:
        """``engine_block_size``: the block (tokens) the engine's cache hits are counted in,
        ``block_size`` by default; it must divide or be a multiple of ``block_size`` (a hit
        is a whole number of engine blocks, at most ``(N - 1) // engine_block_size`` of
        them: vLLM's ``find_longest_cache_hit`` under ``get_max_cache_hit_length``).
        ``publish_window_blocks``: record a sliding-window model's window blocks as state
        events, as an engine publishes them (the mock replica's encoder sends them as a
        ``sliding_window`` group), instead of the checkpoints the router derives from them
        (what the simulator's index takes). ``scheduling``: ``fcfs`` or ``priority`` (the
        module docstring)."""
        if scheduling not in ("fcfs", "priority"):
            raise ValueError(f"scheduling must be fcfs or priority, got {scheduling!r}")
        self.by_priority = scheduling == "priority"
        p = profile.scaled(block_size)
        self.profile = p
        self.replica = replica
        self.block_size = block_size
        ebs = engine_block_size or block_size
        if max(ebs, block_size) % min(ebs, block_size):
            raise ValueError("engine block size must divide or be a multiple of the block size")
        self.engine_block_size = ebs
        self._align = max(1, ebs // block_size)  # an engine block in router blocks
        self.capacity = kv_blocks if kv_blocks is not None else p.kv_blocks
        self.cpu_capacity = cpu_blocks if cpu_blocks is not None else p.cpu_blocks
        self.emit_tokens = emit_tokens
        self.cost = p.cost
        self.hybrid = p.hybrid
        self._state_cost = p.state_checkpoint_blocks if p.hybrid else 0.0
        self._grid = max(1, p.checkpoint_interval_tokens // block_size)
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._decoding: list[_Seq] = []
        self._loading: list[_Seq] = []  # decode legs pulling their KV, in the order admitted
        self._dec_ctx = 0
        self._by_id: dict[str, _Seq] = {}
        self._seg: _Segment | None = None
        self._out: list[EngineOutput] = []
        self._events: list[IndexEvent] = []
        # cache (see "cache bookkeeping"): named GPU blocks, state checkpoints, their LRU
        self._gpu: dict[int, int] = {}
        self._state_at: dict[int, int] = {}
        self._lru: deque[list[Any]] = deque()
        self._lru_len = 0  # entries in the LRU's runs, live or stale
        self._stamp = 0
        self._free_cost = 0.0  # memory of unreferenced blocks and checkpoints (evictable)
        self._states = 0
        self._reserved = 0  # allocated blocks not (yet) named
        self._cpu: OrderedDict[int, None] = OrderedDict()
        # sliding-window attention (block_cache.py "sliding windows")
        self.window = p.window_blocks(block_size)
        self.publish_window_blocks = publish_window_blocks
        self._window_cost = p.window_block_cost if self.window else 0.0
        self._win: dict[int, int] = {}
        self._windows = 0
        self._window_group = WindowGroup(self.window) if self.window else None
        self.busy_s = 0.0  # time spent in steps, for utilisation
        self.steps = 0
        self.preemptions = 0  # running sequences preempted for lack of KV blocks
        self._admissions = 0

    # ------------------------------------------------------------------ driver API

    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue a request at ``now``. Steps finishing by ``now`` are run first (their
        outputs come back from the next ``advance``). Raises ValueError on a duplicate id or
        a negative size."""
        if req.request_id in self._by_id:
            raise ValueError(f"request {req.request_id!r} is already on {self.replica}")
        if req.prompt_tokens <= 0 or req.max_output_tokens < 0 or not req.pull_s >= 0:
            raise ValueError("prompt_tokens must be > 0, max_output_tokens and pull_s >= 0")
        self._run_until(now)
        seq = _Seq(req, now, self.block_size)
        refused = self._refusal(seq)
        if refused is not None:
            self._out.append(Rejected(seq.rid, now, refused))
            return
        self._by_id[seq.rid] = seq
        self._enqueue(seq, front=False)
        if self._waiting[0] is seq:  # others waiting were blocked: only the head may go
            self._wake(now)

    def refusal(self, req: EngineRequest) -> str | None:
        """Why ``req`` can never run here, else None: what :meth:`submit` answers with
        ``Rejected`` (a caller submitting several sequences of one request checks them all
        first, as vLLM refuses such a request before it starts)."""
        return self._refusal(_Seq(req, 0.0, self.block_size))

    def _refusal(self, seq: _Seq) -> str | None:
        # the last token's KV is never written (vLLM: prompt + max_tokens <= max_model_len);
        # a sliding-window engine keeps the window before it pinned all the while
        blocks = -(-(seq.prompt + seq.max_out - 1) // self.block_size)
        footprint = blocks + min(self.window, seq.nfull) * self._window_cost
        if footprint > self.capacity:
            return f"needs {footprint:g} KV blocks, capacity {self.capacity}"
        return None

    def cancel(self, request_id: str, now: float) -> None:
        """Drop a request (client went away); unknown ids are ignored. Its blocks are
        released at once; a step already computing its chunk still takes its time."""
        self._run_until(now)
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        seq.cancelled = True
        self._publish_step_events()  # before anything its release may evict
        if seq in self._waiting:
            head = self._waiting[0] is seq
            self._waiting.remove(seq)
            if head and self._waiting:  # the next may fit where the head did not
                self._wake(now)
            return
        if seq in self._loading:  # its blocks go at once (vLLM: when the pull ends)
            self._loading.remove(seq)
        elif seq in self._prefilling:
            self._prefilling.remove(seq)
        else:
            self._decoding.remove(seq)
            self._dec_ctx -= seq.prompt + seq.out
        self._release(seq, named_output=False)
        self._wake(now)

    def next_time(self) -> float | None:
        """When the step (or decode run) in progress ends, else when a decode leg's pulled
        KV arrives; None when idle."""
        return self._seg.end if self._seg is not None else self._next_arrival()

    def _next_arrival(self) -> float | None:
        """When the first of the pulls in flight ends."""
        return min(s.ready for s in self._loading) if self._loading else None

    def advance(self, now: float) -> list[EngineOutput]:
        """Run every step that finishes at or before ``now``; return outputs in time order."""
        self._run_until(now)
        seg = self._seg
        if self.emit_tokens and seg is not None and not seg.chunks and seg.steps > 1:
            done = seg.steps_done(now)
            if 0 < done < seg.steps:  # stream the finished part of a decode run
                self._seg = None
                head = _Segment(seg.start, done, seg.base, seg.ctx_cost, seg.ctx0, seg.decoders, [])
                self._finish(head)
                rest_start = head.end
                self._seg = _Segment(
                    rest_start,
                    seg.steps - done,
                    seg.base,
                    seg.ctx_cost,
                    self._dec_ctx,
                    seg.decoders,
                    [],
                )
        out, self._out = self._out, []
        return out

    def take_index_events(self) -> list[IndexEvent]:
        """Index events since the last call, in the order they happened."""
        events, self._events = self._events, []
        return events

    def report(self, now: float) -> EngineReport:
        """What the engine would publish: running and waiting sequences, KV usage."""
        return EngineReport(
            running=len(self._prefilling) + len(self._decoding),
            waiting=len(self._waiting) + len(self._loading),  # vLLM's get_request_counts
            kv_usage=self.kv_usage(),
            at=now,
        )

    # ------------------------------------------------------------------ introspection

    def kv_usage(self) -> float:
        """Referenced + allocated blocks over capacity (reusable cached blocks not counted).
        A prefilling sequence counts the blocks of the tokens scheduled so far: vLLM checks
        at admission that its whole prompt fits but allocates each chunk's blocks as it
        schedules it (``allocate_slots``); the model reserves them all at admission."""
        ahead = 0
        if self._prefilling:
            seg = self._seg
            chunk = {id(s): n for s, n in seg.chunks} if seg is not None else {}
            block = self.block_size
            for s in self._prefilling:
                scheduled = min(s.target, s.computed + chunk.get(id(s), 0))
                ahead += max(0, min(s.unnamed, s.blocks - -(-scheduled // block)))
        return min(1.0, (self._used() - self._free_cost - ahead) / self.capacity)

    def cached_blocks(self) -> int:
        """Named KV blocks on GPU (referenced or not)."""
        return len(self._gpu)

    def has_block(self, h: int, tier: Tier = Tier.GPU) -> bool:
        return h in self._gpu if tier is Tier.GPU else h in self._cpu

    def has_state(self, h: int) -> bool:
        return (h | STATE_TAG) in self._state_at

    def has_window(self, h: int) -> bool:
        """Whether block ``h``'s sliding-window KV is cached."""
        return (h | WINDOW_TAG) in self._win

    def pending(self) -> int:
        """Requests submitted and not finished."""
        return len(self._by_id)

    # ------------------------------------------------------------------ stepping

    def _run_until(self, now: float) -> None:
        while True:
            seg = self._seg
            if seg is None:  # idle: a pull ending wakes it
                ready = self._next_arrival()
                if ready is None or ready > now:
                    return
                self._start(ready)  # an idle engine schedules it at once
                if self._seg is None:
                    return
                continue
            if seg.end > now:
                return
            self._publish_step_events()
            self._seg = None
            self._finish(seg)
            self._start(seg.end)

    def _publish_step_events(self) -> None:
        """Release the index events of the step in progress's scheduling (vLLM publishes a
        step's KV events after it, ``Scheduler.update_from_output``)."""
        seg = self._seg
        if seg is not None and seg.events:
            self._events.extend(seg.events)
            seg.events = []

    def _wake(self, now: float) -> None:
        """Something changed at ``now``: start a step if idle, else cut a decode run short
        at the end of the step in progress so the next step can include the change."""
        seg = self._seg
        if seg is None:
            self._start(now)
            return
        if not seg.chunks and seg.steps > 1:
            self._cut(seg, now)

    @staticmethod
    def _cut(seg: _Segment, at: float) -> None:
        """End the decode run ``seg`` with the step in progress at ``at``."""
        keep = min(seg.steps, seg.steps_done(at) + 1)
        if keep < seg.steps:
            seg.steps = keep
            seg.end = seg.start + seg.elapsed(keep)

    def _start(self, now: float) -> None:
        mark = len(self._events)
        admit = not self._room_for_decoders()
        if not admit and not self._prefilling and not self._decoding:
            # the last running sequence preempted (decode legs pulling hold the memory): that
            # step schedules nothing and the next, at once, admits what fits
            admit = True
        cost = self.cost
        decoders = list(self._decoding)
        ndec = len(decoders)
        budget = cost.chunk_tokens - ndec
        chunks: list[tuple[_Seq, int]] = []
        dur = 0.0
        # the decoders' blocks of the step (allocated at its end, _finish) come first: the
        # chunks' checkpoints and window KV take none of them
        hold = self._growth(decoders, 1) if (self.hybrid or self.window) and decoders else 0
        # the running prefills take the budget first, then waiting requests are admitted
        # while budget is left, each looking its prefix up after the chunks before it are
        # cached (vLLM caches a step's blocks as it schedules them)
        for seq in self._prefilling:
            if budget <= 0:
                break
            n = min(seq.target - seq.computed, budget)
            budget -= n
            dur += self._schedule_chunk(seq, n, chunks, hold)
        if admit:
            max_running = self.profile.max_running
            loading = self._loading
            # decode legs whose KV has arrived go first (vLLM: kv_holding_waiting)
            for seq in [s for s in loading if s.ready <= now] if loading else ():
                if budget <= 0 or len(self._prefilling) + ndec >= max_running:
                    break
                loading.remove(seq)
                self._prefilling.append(seq)
                self._admissions += 1  # it joins the running order now (preemption's)
                seq.admitted = self._admissions
                budget -= 1
                dur += self._kv_arrived(seq) + self._schedule_chunk(seq, 0, chunks, hold)
            waiting = self._waiting
            while (
                budget > 0
                and waiting
                and len(self._prefilling) + ndec < max_running
                and self._try_admit(waiting[0], now)
            ):
                seq = waiting.popleft()
                if seq.remote:
                    if seq.pull_s > 0:  # its pull starts: no running slot nor budget taken
                        seq.ready = now + seq.pull_s
                        loading.append(seq)
                        continue
                    budget -= 1  # nothing to pull (vLLM: a full local hit)
                    dur += self._kv_arrived(seq)
                    n = 0
                else:
                    n = min(seq.target - seq.computed, budget)
                    budget -= n
                self._prefilling.append(seq)
                dur += self._schedule_chunk(seq, n, chunks, hold)
        if not self._prefilling and not self._decoding:
            return
        if self._prefilling:
            dur += cost.step_overhead_s + cost.decode_step_s(ndec, self._dec_ctx)
            seg = _Segment(now, 1, dur, 0.0, 0, decoders, chunks)
            seg.events = self._events[mark:]
            del self._events[mark:]
            self._seg = seg
        else:
            steps = self._steps_that_fit(decoders, min(s.max_out - s.out for s in decoders))
            base = cost.step_overhead_s + cost.decode_s_per_seq * ndec
            seg = _Segment(
                now, steps, base, cost.decode_s_per_ctx_token, self._dec_ctx, decoders, []
            )
            ready = self._next_arrival()
            if ready is not None and ready > now:  # the step after a pull ends schedules it
                self._cut(seg, ready)
            self._seg = seg

    def _schedule_chunk(
        self, seq: _Seq, n: int, chunks: list[tuple[_Seq, int]], hold: int
    ) -> float:
        """Schedule ``n`` prompt tokens of ``seq`` this step: the full blocks they complete
        are named (cached) now, as vLLM's ``allocate_slots`` caches them, their checkpoints
        and window KV taken without the ``hold`` blocks the decoders need (kept free, not
        merely evictable: a window block re-pinned is no longer evictable). Its time."""
        chunks.append((seq, n))
        if n:
            block = self.block_size
            done = seq.computed + n
            if hold:
                self._make_room(hold)
                self._reserved += hold
            self._computed(seq, seq.computed // block, min(done // block, seq.nfull))
            self._reserved -= hold
        dur: float = self.cost.prefill_s(n, seq.computed)
        if seq.load_s:
            dur += seq.load_s
            seq.load_s = 0.0
        return dur

    def _finish(self, seg: _Segment) -> None:
        """Apply the effects of a finished segment at its end time."""
        t = seg.end
        self.steps += seg.steps
        self.busy_s += t - seg.start
        block = self.block_size
        steps = seg.steps
        if seg.decoders:  # the blocks the steps wrote into (they fit: _steps_that_fit)
            self._allocate([s for s in seg.decoders if not s.cancelled], steps)
        for seq, n in seg.chunks:
            if seq.cancelled:
                continue
            old = seq.computed
            seq.computed = old + n
            if not n:  # a transferred prompt: its window KV is pinned now (_try_admit)
                self._computed(seq, old // block, min(old // block, seq.nfull))
            if seq.computed >= seq.target:
                self._prefilling.remove(seq)
                seq.out += 1
                if seq.out == 1:
                    self._out.append(FirstToken(seq.rid, t, seq.cached, seq.kv_hit, seq.queued_s))
                elif self.emit_tokens:  # a resumed sequence: its recompute samples the next
                    self._out.append(TokensEmitted(seq.rid, t, 1, 0.0))
                if seq.out >= seq.max_out:
                    self._complete(seq, t)
                else:
                    self._decoding.append(seq)
                    self._dec_ctx += seq.prompt + seq.out
        if not seg.decoders:
            return
        first = seg.start + seg.elapsed(1)
        interval = (t - first) / (steps - 1) if steps > 1 else 0.0
        done: list[_Seq] = []
        emit = self.emit_tokens
        for seq in seg.decoders:
            if seq.cancelled:
                continue
            seq.out += steps
            if emit:
                self._out.append(TokensEmitted(seq.rid, first, steps, interval))
            if seq.out >= seq.max_out:
                done.append(seq)
        self._dec_ctx += steps * (seg.nseq - sum(1 for s in seg.decoders if s.cancelled))
        for seq in done:
            self._decoding.remove(seq)
            self._dec_ctx -= seq.prompt + seq.out
            self._complete(seq, t)
