"""The requests of the replica model (``sim.engine.EngineModel``): what a driver submits,
what the engine reports back, and the state the engine keeps for each request it holds.

* :class:`EngineRequest` is one engine request (one sequence); :func:`sampled` fans a request
  sampling ``n`` sequences out into ``n`` of them, as vLLM v1 does.
* :data:`EngineOutput` is what ``EngineModel.advance`` returns: :class:`FirstToken`, then
  :class:`TokensEmitted` (unless the engine emits no tokens), then :class:`Finished`; or
  :class:`Rejected` alone for a request that can never run there.
* ``_Seq`` is the engine's mutable record of one submitted request, shared by the engine's
  stepping (sim/engine.py), its scheduler (sim/engine_scheduler.py) and its cache
  bookkeeping (sim/block_cache.py); nothing outside the engine model uses it.

These names are importable from ``sim.engine`` too, where drivers import them from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One request as an engine sees it. ``block_hashes`` are the canonical hashes (router
    block size) of the prompt's full blocks; ``output_block_hashes`` optionally name the full
    blocks the answer completes (so a follow-up turn can hit them). ``remote_prefilled``: the
    decode leg of a disaggregated request: another replica computed the prompt, whose KV (and
    recurrent state at the prompt end) this one pulls for ``pull_s`` seconds, from the step
    that admits it; then the prompt's blocks are named as computed (publishing them) and the
    request decodes after one step recomputing its last prompt token (sim/engine.py's
    "Decode legs"). ``reads_cache`` False: the request reuses no cached block (vLLM: prompt
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
    pull_s: float = 0.0


def sampled(req: EngineRequest, samples: int) -> list[EngineRequest]:
    """The engine requests of a request sampling ``samples`` sequences of one prompt, as
    vLLM v1 fans ``n`` out into child requests: ``req``, then ``samples - 1`` copies named
    ``{request_id}#s{j}`` that name no answer blocks (the answers differ: only the first's
    are the follow-up turn's). Submitted in this order at one time, the others reuse the
    prompt blocks the first computes: a block is cached as the step computing it is
    scheduled (vLLM's ``allocate_slots``), so a copy scheduled later in that step or after
    it hits them."""
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


class _Seq:
    """The engine's record of one submitted request: its prompt, progress (tokens computed,
    generated), KV blocks allocated and pinned, and the cache hit of its first admission.
    Mutated only by the engine; ``cancelled``: dropped by ``cancel`` (a step in progress
    that includes it skips it when it ends)."""

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
        "pull_s",
        "queued_s",
        "reads_cache",
        "ready",
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
        self.pull_s = req.pull_s if req.remote_prefilled else 0.0
        self.ready = 0.0  # a decode leg pulling its KV: when the KV has arrived
        self.reads_cache = req.reads_cache
        self.window: list[int] = []  # sliding-window keys pinned, oldest first
        self.wheld = 0  # blocks whose window KV was taken (hit or computed)
