"""The replica model: one inference engine with continuous batching, chunked prefill, a KV
block cache with LRU eviction, recurrent-state checkpoints and an optional host tier.

The model is clock-agnostic: it has no event heap and reads no clock. A driver calls
``submit(req, now)`` / ``cancel(id, now)`` when things happen, asks ``next_time()`` when the
engine's state next changes, and calls ``advance(now)`` to run every step that finishes by
``now``. The simulator drives it from its event heap; the mock replica from asyncio with the
wall clock (it may call ``advance`` at any time: tokens of steps already finished inside a
fast-forwarded decode run are returned as they complete).

Scheduling (vLLM v1 style, simplified):

* Requests wait FCFS. One is admitted when fewer than ``max_running`` run and its whole
  prompt fits (vLLM's ``scheduler_reserve_full_isl``): blocks for the prompt minus the cached
  prefix, after evicting unreferenced cached blocks and keeping the blocks the running
  sequences' next step needs. No request is admitted in a step that preempted one. A request
  whose prompt + ``max_output_tokens`` - 1 tokens (+ its pinned sliding window) exceed the
  whole cache is rejected at once.
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
  completion or arrival, so the whole run of decode steps is one *segment* whose duration is
  an arithmetic series (contexts grow by one token a step); an arrival (or a cancel that
  frees KV or the head of the queue) cuts the segment at the end of the step in progress.

Cache:

* Blocks are named by the canonical chained hashes the router uses (``block_hashes``: the
  prompt's full blocks; ``output_block_hashes``: full blocks the answer completes, when the
  driver knows the answer's content). A block is cached once the step computing it ends.
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
  ones (vLLM's ``gpu_cache_usage`` convention).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import repeat
from typing import Any, cast

from router.core.load import EngineReport
from router.core.types import BlocksRemoved, BlocksStored, IndexEvent, ReplicaKey, Tier
from router.events.window import WindowGroup
from sim.block_cache import STATE_TAG, WINDOW_TAG, BlockCache, _negative, _plus1
from sim.profiles import EngineProfile

# ---------------------------------------------------------------------------- values


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One request as an engine sees it. ``block_hashes`` are the canonical hashes (router
    block size) of the prompt's full blocks; ``output_block_hashes`` optionally name the full
    blocks the answer completes (so a follow-up turn can hit them). ``remote_prefilled``: the
    decode leg of a disaggregated request: another replica computed the prompt and its KV
    (and recurrent state at the prompt end) arrive with it, so admission names the prompt's
    blocks as computed (publishing them) and the request decodes after one step with no
    prefill compute. ``reads_cache`` False: the request reuses no cached block (vLLM: prompt
    logprobs asked); the blocks it computes are cached all the same. ``priority``: vLLM's
    request priority (lower first), used by an engine scheduling by priority."""

    request_id: str
    block_hashes: Sequence[int]
    prompt_tokens: int
    max_output_tokens: int
    output_block_hashes: Sequence[int] = ()
    remote_prefilled: bool = False
    reads_cache: bool = True
    priority: int = 0


def sampled(req: EngineRequest, samples: int) -> list[EngineRequest]:
    """The engine requests of a request sampling ``samples`` sequences of one prompt, as
    vLLM v1 fans ``n`` out into child requests: ``req``, then ``samples - 1`` copies named
    ``{request_id}#s{j}`` that name no answer blocks (the answers differ: only the first's
    are the follow-up turn's). Submitted in this order at one time, the first is admitted
    on its own when the engine is idle (``submit`` starts its step) and the others reuse
    the blocks it computed; queued behind a step in progress, all are admitted in the same
    step and prefill the prompt again (the engine model caches a block at the end of the
    step that computes it, vLLM as it allocates it)."""
    return [req] + [
        replace(req, request_id=f"{req.request_id}#s{j}", output_block_hashes=())
        for j in range(1, samples)
    ]


@dataclass(slots=True, frozen=True)
class FirstToken:
    """Prefill done. ``cached_tokens``: the usable hit the engine got (hybrid rule applied);
    ``kv_hit_tokens``: the KV-only hit; ``queued_s``: time from submit to admission."""

    request_id: str
    time: float
    cached_tokens: int
    kv_hit_tokens: int = 0
    queued_s: float = 0.0


@dataclass(slots=True, frozen=True)
class TokensEmitted:
    """``count`` decode tokens of one request; the first at ``time``, then one every
    ``interval`` seconds (the mean step time of a fast-forwarded run)."""

    request_id: str
    time: float
    count: int
    interval: float


@dataclass(slots=True, frozen=True)
class Finished:
    request_id: str
    time: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(slots=True, frozen=True)
class Rejected:
    """The request can never run here (e.g. larger than the whole KV cache)."""

    request_id: str
    time: float
    reason: str


EngineOutput = FirstToken | TokensEmitted | Finished | Rejected


# ---------------------------------------------------------------------------- internals


class _Seq:
    __slots__ = (
        "admitted",
        "blocks",
        "cached",
        "cancelled",
        "computed",
        "hashes",
        "held",
        "kv_hit",
        "load_s",
        "max_out",
        "nfull",
        "out",
        "out_hashes",
        "pinned",
        "priority",
        "prompt",
        "queued_s",
        "reads_cache",
        "remote",
        "rid",
        "submitted",
        "target",
        "unnamed",
        "usable_blocks",
        "wheld",
        "window",
    )

    def __init__(self, req: EngineRequest, now: float, block_size: int) -> None:
        self.rid = req.request_id
        self.prompt = req.prompt_tokens
        hashes = req.block_hashes
        self.nfull = min(len(hashes), req.prompt_tokens // block_size)
        self.hashes = hashes
        if len(set(hashes)) < len(hashes):
            # Canonical chained hashes never repeat within a prompt. If these do, only the
            # blocks before the first repeat are named and cached: a repeated name would
            # break the prefix closure of the cache (and the one-pin-per-block bookkeeping).
            seen: set[int] = set()
            for i, h in enumerate(hashes[: self.nfull]):
                if h in seen:
                    self.nfull = i
                    break
                seen.add(h)
        self.out_hashes = req.output_block_hashes
        self.max_out = max(1, req.max_output_tokens)
        self.submitted = now
        self.priority = req.priority
        self.computed = 0
        self.target = req.prompt_tokens  # tokens to prefill: the prompt, + answer if resumed
        self.blocks = 0  # KV blocks allocated (router blocks of the tokens it can hold)
        self.admitted = 0  # admission order (0: waiting for its first admission)
        self.cached = 0
        self.kv_hit = 0
        self.held = 0  # prompt blocks pinned so far (a prefix of the prompt's full blocks)
        self.usable_blocks = 0
        self.out = 0
        self.pinned: list[int] = []
        self.unnamed = 0
        self.load_s = 0.0
        self.queued_s = 0.0
        self.cancelled = False
        self.remote = req.remote_prefilled
        self.reads_cache = req.reads_cache
        self.window: list[int] = []  # sliding-window keys pinned, oldest first
        self.wheld = 0  # blocks whose window KV was taken (hit or computed)


def _new_blocks(seq: _Seq, steps: int, block: int) -> int:
    """Blocks ``seq`` must add (<= 0: none) to run ``steps`` more decode steps: step j of a
    sequence with ``out`` tokens writes the KV of its first ``prompt + out - 1 + j``."""
    return -(-(seq.prompt + seq.out - 1 + steps) // block) - seq.blocks


class _Segment:
    """``steps`` steps starting at ``start``. A prefill step has ``chunks`` and steps == 1;
    a decode run's step i lasts ``base + ctx_cost * (ctx0 + i * nseq)``."""

    __slots__ = ("base", "chunks", "ctx0", "ctx_cost", "decoders", "end", "nseq", "start", "steps")

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


class EngineModel(BlockCache):
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
        if req.prompt_tokens <= 0 or req.max_output_tokens < 0:
            raise ValueError("prompt_tokens must be > 0 and max_output_tokens >= 0")
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
        if seq in self._waiting:
            head = self._waiting[0] is seq
            self._waiting.remove(seq)
            if head and self._waiting:  # the next may fit where the head did not
                self._wake(now)
            return
        if seq in self._prefilling:
            self._prefilling.remove(seq)
        else:
            self._decoding.remove(seq)
            self._dec_ctx -= seq.prompt + seq.out
        self._release(seq, named_output=False)
        self._wake(now)

    def next_time(self) -> float | None:
        """When the step (or decode run) in progress ends; None when idle."""
        return self._seg.end if self._seg is not None else None

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
            waiting=len(self._waiting),
            kv_usage=self.kv_usage(),
            at=now,
        )

    # ------------------------------------------------------------------ introspection

    def kv_usage(self) -> float:
        """Referenced + allocated blocks over capacity (reusable cached blocks not counted)."""
        return min(1.0, (self._used() - self._free_cost) / self.capacity)

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
        while self._seg is not None and self._seg.end <= now:
            seg = self._seg
            self._seg = None
            self._finish(seg)
            self._start(seg.end)

    def _wake(self, now: float) -> None:
        """Something changed at ``now``: start a step if idle, else cut a decode run short
        at the end of the step in progress so the next step can include the change."""
        seg = self._seg
        if seg is None:
            self._start(now)
            return
        if seg.chunks or seg.steps == 1:
            return
        keep = min(seg.steps, seg.steps_done(now) + 1)
        if keep < seg.steps:
            seg.steps = keep
            seg.end = seg.start + seg.elapsed(keep)

    def _start(self, now: float) -> None:
        if not self._room_for_decoders():
            self._admit(now)
        if not self._prefilling and not self._decoding:
            return
        cost = self.cost
        decoders = list(self._decoding)
        ndec = len(decoders)
        if self._prefilling:
            budget = cost.chunk_tokens - ndec
            chunks: list[tuple[_Seq, int]] = []
            dur = cost.step_overhead_s + cost.decode_step_s(ndec, self._dec_ctx)
            for seq in self._prefilling:
                if budget <= 0:
                    break
                n = min(seq.target - seq.computed, budget)
                budget -= n
                chunks.append((seq, n))
                dur += cost.prefill_s(n, seq.computed)
                if seq.load_s:
                    dur += seq.load_s
                    seq.load_s = 0.0
            self._seg = _Segment(now, 1, dur, 0.0, 0, decoders, chunks)
        else:
            steps = self._steps_that_fit(decoders, min(s.max_out - s.out for s in decoders))
            base = cost.step_overhead_s + cost.decode_s_per_seq * ndec
            self._seg = _Segment(
                now, steps, base, cost.decode_s_per_ctx_token, self._dec_ctx, decoders, []
            )

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
            self._computed(seq, old // block, min(seq.computed // block, seq.nfull))
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
        running sequence always fits (``submit`` rejects larger requests)."""
        preempted = False
        while (
            self._decoding
            and len(self._decoding) + len(self._prefilling) > 1
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

    def _admit(self, now: float) -> None:
        max_running = self.profile.max_running
        while self._waiting and len(self._prefilling) + len(self._decoding) < max_running:
            seq = self._waiting[0]
            if not self._try_admit(seq, now):
                return
            self._waiting.popleft()
            self._prefilling.append(seq)

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
            # vLLM caps a hit at N - 1 and gives back its last block (the draft head's peek)
            cap = max(seq.target - 1, 0) // self.block_size // align * align
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
        if seq.remote:  # the transferred prompt: named (and published) as computed
            old = seq.computed
            seq.computed = seq.prompt
            # its window KV is pinned at the end of its step, as a prefill chunk's, after the
            # decoders' blocks: the room above kept those free, not the window's too
            self._computed(seq, old // self.block_size, seq.nfull, windows=False)
        return True
