"""Routing policies: ours and the public baselines, behind one interface.

A policy sees a request and its candidates (each with its prefix match, load and cache size)
and returns a Decision. Policies hold no I/O; randomness comes in as ``rng`` and state that
a policy keeps (the round-robin cursor) is its own.

Baselines model what public routers know: KV blocks reported by engine events, without the
hybrid-state rule. ``ours`` routes on the *usable* prefix. For non-hybrid models the two agree.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from router.core.candidates import Candidate, CandidateColumns, ColumnarPolicy, Policy
from router.core.candidates import decide as _decide
from router.core.candidates import rank as _rank
from router.core.candidates import tokens as _tokens
from router.core.load import EXPECTED_OUTPUT_TOKENS, CostModel, require_nonnegative
from router.core.slo import DEFAULT_TIERS, SloTargets, SloTier, tier_for
from router.core.types import MAX_RANKING, Decision, RouteRequest
from router.core.vllm_router import VllmCacheAware, VllmKvAware
from router.core.xp import ARRAY, SCALAR, Ops

__all__ = [
    "POLICIES",
    "POLICY_NAMES",
    "Candidate",
    "CandidateColumns",
    "ColumnarPolicy",
    "Ours",
    "Policy",
    "VllmCacheAware",
    "VllmKvAware",
    "make_policy",
    "uses_prefix_index",
]


# ---------------------------------------------------------------------------- baselines


@dataclass(slots=True)
class RoundRobin:
    name: str = "round_robin"
    cursor: int = 0

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.replica)
        start = self.cursor % len(ordered)
        self.cursor += 1
        ranked = ordered[start:] + ordered[:start]
        return _decide(self.name, request, ranked, float(start))


@dataclass(slots=True)
class RandomChoice:
    name: str = "random"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        ranked = list(candidates)
        rng.shuffle(ranked)
        return _decide(self.name, request, ranked, 0.0)


@dataclass(slots=True)
class LeastLoaded:
    name: str = "least_loaded"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        ranked = _rank(candidates, lambda c: c.load.in_flight, rng)
        return _decide(self.name, request, ranked, ranked[0].load.in_flight)


@dataclass(slots=True)
class LongestPrefix:
    """Pure affinity: the longest KV match wins; ties go to the least loaded."""

    name: str = "longest_prefix"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        ranked = _rank(candidates, lambda c: -c.match.kv_blocks * 1e6 + c.load.in_flight, rng)
        return _decide(self.name, request, ranked, ranked[0].match.kv_blocks)


@dataclass(slots=True)
class Dynamo:
    """NVIDIA Dynamo KV router cost:
    ``prefill_load_scale * max(prefill_blocks - overlap, 0) + decode_blocks``, lowest wins;
    overlap weighs GPU blocks 1.0, host 0.75, disk 0.25; ``decode_blocks`` is the replica's
    in-flight prompt blocks plus this request's. ``temperature > 0`` samples a softmax over
    min-max normalised costs instead of taking the minimum."""

    name: str = "dynamo"
    prefill_load_scale: float = 1.0
    temperature: float = 0.0
    gpu_weight: float = 1.0
    host_weight: float = 0.75
    disk_weight: float = 0.25

    def cost(self, request: RouteRequest, c: Candidate) -> tuple[float, dict[str, float]]:
        m = c.match
        overlap = (
            self.gpu_weight * m.gpu_blocks
            + self.host_weight * (m.host_blocks - m.gpu_blocks)
            + self.disk_weight * (m.kv_blocks - m.host_blocks)
        )
        prefill = max(request.prompt_blocks - overlap, 0.0)
        decode = -(-c.load.in_flight_prompt_tokens // request.block_size) + request.prompt_blocks
        cost = self.prefill_load_scale * prefill + decode
        return cost, {"prefill_blocks": prefill, "decode_blocks": float(decode), "overlap": overlap}

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        costs = {c.replica: self.cost(request, c) for c in candidates}
        ranked = _rank(candidates, lambda c: costs[c.replica][0], rng)
        if self.temperature > 0 and len(ranked) > 1:
            values = [costs[c.replica][0] for c in ranked]
            lo, hi = values[0], values[-1]
            span = (hi - lo) or 1.0
            weights = [math.exp(-((v - lo) / span) / self.temperature) for v in values]
            pick = rng.choices(range(len(ranked)), weights=weights)[0]
            ranked.insert(0, ranked.pop(pick))
        best = costs[ranked[0].replica]
        return _decide(self.name, request, ranked, best[0], best[1])


@dataclass(slots=True)
class SGLangCacheAware:
    """SGLang router ``cache_aware``: balance when load is skewed, else follow the cache
    when the match rate passes a threshold, else the replica with the smallest cache."""

    name: str = "sglang"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.1

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        loads = [c.load.in_flight for c in candidates]
        hi, lo = max(loads), min(loads)
        imbalanced = hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo
        if imbalanced:
            ranked = _rank(candidates, lambda c: c.load.in_flight, rng)
            return _decide(
                self.name, request, ranked, float(ranked[0].load.in_flight), {"balanced": 1.0}
            )
        best = max(c.match.kv_blocks for c in candidates)
        rate = _tokens(request, best) / max(request.prompt_tokens, 1)
        if rate > self.cache_threshold:
            ranked = _rank(candidates, lambda c: -c.match.kv_blocks * 1e6 + c.load.in_flight, rng)
        else:
            ranked = _rank(candidates, lambda c: c.cached_blocks, rng)
        return _decide(self.name, request, ranked, rate, {"match_rate": rate})


@dataclass(slots=True)
class LlmD:
    """llm-d scheduler's weighted scorers: prefix = matched / total blocks, queue =
    (maxQ - q) / (maxQ - minQ), KV = 1 - usage; highest weighted sum wins."""

    name: str = "llmd"
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    report_max_age_s: float = 1.0

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        queues = {c.replica: c.load.waiting(self.report_max_age_s) for c in candidates}
        qmax, qmin = max(queues.values()), min(queues.values())
        total = max(request.prompt_blocks, 1)

        def terms(c: Candidate) -> dict[str, float]:
            queue = 1.0 if qmax == qmin else (qmax - queues[c.replica]) / (qmax - qmin)
            return {
                "prefix": c.match.kv_blocks / total,
                "queue": queue,
                "kv": 1.0 - c.load.kv_usage,
            }

        scored = {c.replica: terms(c) for c in candidates}

        def total_score(c: Candidate) -> float:
            t = scored[c.replica]
            return (
                self.prefix_weight * t["prefix"]
                + self.queue_weight * t["queue"]
                + self.kv_weight * t["kv"]
            )

        ranked = _rank(candidates, lambda c: -total_score(c), rng)
        return _decide(
            self.name, request, ranked, total_score(ranked[0]), scored[ranked[0].replica]
        )


@dataclass(slots=True)
class PrebleE2:
    """Preble E2: exploit the longest-prefix replica when its cached tokens exceed the
    missed tokens, otherwise explore the least loaded one."""

    name: str = "preble"

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        best = max(c.match.kv_blocks for c in candidates)
        cached = _tokens(request, best)
        if cached > request.prompt_tokens - cached:
            ranked = _rank(candidates, lambda c: -c.match.kv_blocks * 1e6 + c.load.in_flight, rng)
            mode = 1.0
        else:
            ranked = _rank(candidates, lambda c: c.load.in_flight, rng)
            mode = 0.0
        return _decide(self.name, request, ranked, float(cached), {"exploit": mode})


def uses_prefix_index(policy: Policy) -> bool:
    """Whether ``policy`` reads the prefix index: round robin, random and least loaded do
    not, so a simulation may skip maintaining it (sim.cluster). Other policies may say so
    with a ``uses_prefix_index`` attribute."""
    if isinstance(policy, (RoundRobin, RandomChoice, LeastLoaded)):
        return False
    return bool(getattr(policy, "uses_prefix_index", True))


# ---------------------------------------------------------------------------- ours


@dataclass(slots=True)
class Ours:
    """Maximise goodput: predicted time to first token, and what the placement does to the
    decode speed of the requests on the replica.

    For each candidate (each term is reported in the Decision):

    * ``prefill``: compute time of the uncached part, after the *usable* cached prefix
      (hybrid-state rule applied); host-tier hits count ``host_hit_value`` of a GPU hit and
      disk hits ``disk_hit_value``.
    * ``queue``: time to prefill the tokens already queued on the replica, plus
      ``foreign_waiting_tokens`` for each request the engine reports waiting beyond what this
      router sent (other routers' traffic), when that report is fresher than
      ``report_max_age_s``.
    * ``decode``: decode work interleaved into the prefill steps of this request and the
      queue ahead of it (continuous batching shares each step).
    * ``kv``: ``kv_pressure_s`` scaled by how far KV usage is above
      ``kv_pressure_threshold`` (eviction and preemption risk), 0 below it.
    * ``interference``: the decode stall this request's prefill imposes on the requests in
      flight on the replica, in TPOT targets: every step that carries a prefill chunk stalls
      every decoding sequence, so ``prefill`` seconds add ``prefill / (n - 1)`` to the TPOT
      of a sequence with ``n`` output tokens. Summed over the replica's requests (their
      ``decode_weight``, ``1 / (n - 1)`` each, counted from dispatch: a request queued ahead
      decodes while this one prefills) and divided by ``tpot_target_s``. Short answers are
      the fragile ones, so a long uncached prefill goes where few of them run.
    * ``eviction``: what the placement's uncached blocks push out of the replica's cache
      beyond what they would push out of the fleet's calmest one: ``prefill`` times the
      candidate's ``eviction_risk`` (router/core/turnover.py: the chance of reuse lost)
      above ``eviction_risk_floor``. 0 wherever caches turn over alike or nothing is
      evicted; where a cache turns over far faster than the others (it took more than its
      share of new prefixes), new prefixes go elsewhere instead of pushing out the
      conversations that will come back. The floor keeps small differences (noise between
      caches that all turn over fast) from deciding among otherwise equal replicas, which
      the cache-size tie-break and the rng spread better.

    * ``batch``: what joining the replica's decode batch costs, in seconds of decoding: each
      of the request's output tokens (``max_output_tokens``, ``EXPECTED_OUTPUT_TOKENS``
      when unknown) waits for a step that also decodes the sequences already there
      (``decode_step_s(decoding, decode_context)``), and each of those sequences' steps
      grows by what the request's own sequences (``n`` for each of its prompts) and their
      context add, for as long as both decode. The part every replica charges alike (the
      request's own sequences) is left out, so an idle replica prices 0. A replica that
      holds a popular prefix would otherwise take every new session until its decode batch
      is several times slower than the rest of the fleet's: TTFT bought with everyone's
      time per output token.
      ``w_batch`` counts in proportion to the share of candidates with no prefill queued:
      spreading decode batches gives up cache hits, which is free while replicas have
      prefill time to spare and costs every queued request once they have none.

    * ``miss``: whether the request's predicted TTFT there (``prefill + queue + decode``)
      misses its own target (its prompt's tier of the model's SLO, ``ttft_tiers``): 0 within
      the target, rising to 1 at ``1 + miss_margin`` times it. ``w_miss`` counts, as
      ``w_batch`` does, in proportion to the share of candidates with no prefill queued: a
      miss avoided by prefilling elsewhere is free while replicas have prefill time to
      spare, and once they have none the compute it takes makes other requests miss.

    Score = ``w_prefill*prefill + w_queue*queue + w_decode*decode + w_kv*kv +
    w_interference*interference + w_eviction*eviction + w_batch*batch + w_miss*miss``;
    lowest wins.

    ``w_prefill`` defaults well above 1: a cache miss does not only delay this request, its
    prefill takes replica time from every request queued behind it, so prefill seconds are
    charged at fleet cost. The weights were tuned for goodput with ``kvrouter sim tune``
    (docs/tuning.md); with ``w_prefill = 1`` and no interference term the policy is a greedy
    TTFT minimiser that gives up cache affinity under load and slows decoding.
    """

    name: str = "ours"
    cost: CostModel = field(default_factory=CostModel)
    w_prefill: float = 12.0
    w_queue: float = 1.0
    w_decode: float = 1.0
    w_kv: float = 1.0
    host_hit_value: float = 0.75
    disk_hit_value: float = 0.25
    kv_pressure_threshold: float = 0.9
    kv_pressure_s: float = 2.0
    foreign_waiting_tokens: int = 4096
    # reports come every second (the scrape / publish default): one stays fresh until the
    # next is due and fetched, so the engine's queue never drops out between two
    report_max_age_s: float = 1.5
    w_interference: float = 7.0
    tpot_target_s: float = 0.1
    w_eviction: float = 24.0
    eviction_risk_floor: float = 0.15
    w_batch: float = 1.0
    # the TTFT targets by prompt tier (the model's SLO: router.core.slo) and what a
    # predicted miss of the request's own target costs, in score seconds
    ttft_tiers: tuple[SloTier, ...] = DEFAULT_TIERS
    w_miss: float = 2.0
    miss_margin: float = 0.2
    uses_session_hints: bool = True

    def __post_init__(self) -> None:
        require_nonnegative(
            ("w_prefill", self.w_prefill),
            ("w_queue", self.w_queue),
            ("w_decode", self.w_decode),
            ("w_kv", self.w_kv),
            ("w_interference", self.w_interference),
            ("w_eviction", self.w_eviction),
            ("w_batch", self.w_batch),
            ("w_miss", self.w_miss),
            ("host_hit_value", self.host_hit_value),
            ("disk_hit_value", self.disk_hit_value),
            ("kv_pressure_s", self.kv_pressure_s),
            ("foreign_waiting_tokens", self.foreign_waiting_tokens),
            ("kv_pressure_threshold", self.kv_pressure_threshold),
        )
        if not math.isfinite(self.eviction_risk_floor):
            raise ValueError(f"eviction_risk_floor must be finite, not {self.eviction_risk_floor}")
        if not self.report_max_age_s >= 0:  # (inf: every report is fresh)
            raise ValueError(f"report_max_age_s must be >= 0, not {self.report_max_age_s!r}")
        if not (self.ttft_tiers and all(isinstance(t, SloTier) for t in self.ttft_tiers)):
            raise ValueError(
                "ttft_tiers: the TTFT targets come from the model's [slo] table "
                "(ttft_tiers there), not from policy_params"
            )
        # the model's [slo] table checks its tiers; one built otherwise is checked alike: a
        # target of 0 divides by zero, an infinite or NaN one makes the miss term NaN on the
        # array path and 0 on the per-candidate path, unordered bounds give one tier to all
        SloTargets(self.ttft_tiers)
        if not (math.isfinite(self.miss_margin) and self.miss_margin > 0):
            raise ValueError(f"miss_margin must be a positive fraction, not {self.miss_margin!r}")
        if not (math.isfinite(self.tpot_target_s) and self.tpot_target_s > 0):
            raise ValueError(f"tpot_target_s must be positive seconds, not {self.tpot_target_s!r}")

    def _terms(
        self,
        xp: Ops,
        request: RouteRequest,
        kv_blocks: Any,
        gpu_blocks: Any,
        host_blocks: Any,
        usable_blocks: Any,
        queued: Any,
        prefilling: Any,
        decoding: Any,
        decode_context: Any,
        waiting: Any,
        fresh: Any,
        kv_usage: Any,
        decode_weight: Any,
        eviction_risk: Any,
    ) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
        """The terms (``TERM_NAMES``; see the class docstring), for one candidate
        (numbers, ``xp=SCALAR``) or for many (arrays, ``xp=ARRAY``): one formula for both.
        ``waiting`` / ``kv_usage`` are the engine's report (0 without one); ``fresh``: it
        is younger than ``report_max_age_s``. ``prefilling``: the requests the router knows
        are queued there (its own and its peers'), not a failing replica's phantom ones
        (``LoadView.phantom``): the engine's ``waiting`` beyond them is other routers'."""
        minimum, maximum = xp.minimum, xp.maximum
        usable = minimum(usable_blocks, kv_blocks)
        gpu = minimum(usable, gpu_blocks)
        host_end = minimum(usable, host_blocks)
        host = host_end - gpu
        cached_blocks = gpu + self.host_hit_value * host + self.disk_hit_value * (usable - host_end)
        prompt = request.prompt_tokens
        cached = minimum(xp.trunc(cached_blocks * request.block_size), max(prompt - 1, 0))
        new = prompt - cached
        extra = waiting - prefilling  # requests the engine has beyond ours: other routers'
        queued = queued + maximum(extra, 0) * self.foreign_waiting_tokens * fresh
        cost = self.cost  # the engine model's own formulas, so sim and policy agree
        prefill = cost.prefill_s(new, cached, xp)
        queue = cost.prefill_s(queued, 0, xp)
        decode = cost.steps_for(queued + new, xp) * cost.decode_step_s(decoding, decode_context)
        excess = maximum(kv_usage - self.kv_pressure_threshold, 0)
        kv = self.kv_pressure_s * excess / max(1.0 - self.kv_pressure_threshold, 1e-6)
        interference = prefill * decode_weight / self.tpot_target_s
        eviction = prefill * maximum(eviction_risk - self.eviction_risk_floor, 0.0)
        out = request.max_output_tokens or EXPECTED_OUTPUT_TOKENS
        # the request's own sequences (``n`` for each of its prompts) attend to its prompts
        own = cost.decode_step_s(request.samples * request.prompts, prompt * request.samples)
        joined = cost.decode_step_s(decoding, decode_context) + decoding * own
        batch = out * joined
        target = tier_for(self.ttft_tiers, prompt).ttft_s
        late = (prefill + queue + decode - target) / (self.miss_margin * target)
        miss = minimum(maximum(late, 0.0), 1.0)
        return prefill, queue, decode, kv, interference, eviction, batch, miss

    def _spare_weights(self, idle: int, candidates: int) -> tuple[float, float]:
        """``w_batch`` and ``w_miss`` as far as the ``candidates`` have no prefill queued
        (``idle`` of them): the one rule for ``choose`` and ``choose_columns``."""
        share = idle / max(candidates, 1)
        return self.w_batch * share, self.w_miss * share

    def term_values(
        self, request: RouteRequest, c: Candidate
    ) -> tuple[float, float, float, float, float, float, float, float]:
        """The terms (``TERM_NAMES``) for one candidate; see the class docstring."""
        _, (kv, gpu, host, usable), load, _, risk = c
        _, prefilling, queued, decoding, context, _, engine, age, _, _, weight, phantom = load
        if engine is None:
            waiting, fresh, usage = 0.0, False, 0.0
        else:
            waiting, fresh = float(engine.waiting), age <= self.report_max_age_s
            usage = engine.kv_usage
        # the counts as floats, as ``term_columns`` reads them (LoadColumns): same operations
        # on the same values, so the paths agree past 2**53 too (an engine's clamped queue)
        return self._terms(
            SCALAR, request, kv, gpu, host, usable, float(queued), float(prefilling) - phantom,
            float(decoding), float(context), waiting, fresh, usage, weight, risk,
        )  # fmt: skip

    def terms(self, request: RouteRequest, c: Candidate) -> dict[str, float]:
        return dict(zip(TERM_NAMES, self.term_values(request, c), strict=True))

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        wp, wq, wd, wk = self.w_prefill, self.w_queue, self.w_decode, self.w_kv
        wi, we = self.w_interference, self.w_eviction
        term_values = self.term_values
        values = [term_values(request, c) for c in candidates]
        wb, wm = self._spare_weights(sum(1 for v in values if v[1] == 0), len(values))
        scores = [
            wp * p + wq * q + wd * d + wk * k + wi * i + we * e + wb * b + wm * m
            for p, q, d, k, i, e, b, m in values
        ]
        order = sorted(range(len(scores)), key=scores.__getitem__)
        pick = order[0]
        best = scores[pick]
        if len(order) > 1 and scores[order[1]] == best:
            # Exact ties (typically idle replicas without a match): the one with the smallest
            # cache takes the new prefix, so it evicts least; the rng breaks remaining ties.
            ties = [i for i in order if scores[i] == best]
            fewest = min(candidates[i].cached_blocks for i in ties)
            ties = [i for i in ties if candidates[i].cached_blocks == fewest]
            pick = ties[rng.randrange(len(ties))] if len(ties) > 1 else ties[0]
            order.remove(pick)
            order.insert(0, pick)
        ranked = [candidates[i] for i in order]
        terms = dict(zip(TERM_NAMES, values[pick], strict=True))
        return _decide(self.name, request, ranked, scores[pick], terms)

    def term_columns(
        self, request: RouteRequest, columns: CandidateColumns, now: float
    ) -> tuple[Any, Any, Any, Any, Any, Any, Any, Any]:
        """The terms (``TERM_NAMES``) as arrays, one element per replica of ``columns``
        (eligible or not); see the class docstring."""
        load = columns.load
        risk = columns.eviction_risk
        if risk is None:
            risk = np.zeros(len(columns.keys))
        return self._terms(
            ARRAY,
            request,
            columns.kv_blocks,
            columns.gpu_blocks,
            columns.host_blocks,
            columns.usable_blocks,
            load.queued_prefill_tokens,
            load.prefilling - load.phantom,
            load.decoding,
            load.decode_context_tokens,
            load.waiting,
            now - load.engine_at <= self.report_max_age_s,
            load.kv_usage,
            load.decode_weight,
            risk,
        )

    def choose_columns(
        self, request: RouteRequest, columns: CandidateColumns, now: float, rng: random.Random
    ) -> Decision:
        """``choose`` on all eligible candidates of ``columns`` at once (same decision)."""
        values = self.term_columns(request, columns, now)
        p, q, d, k, i, e, b, m = values
        el = columns.eligible
        wb, wm = self._spare_weights(
            int(np.count_nonzero((q == 0) & el)), int(np.count_nonzero(el))
        )
        scores = self.w_prefill * p + self.w_queue * q + self.w_decode * d + self.w_kv * k
        scores = scores + self.w_interference * i + self.w_eviction * e + wb * b + wm * m
        # the eligible candidates only, in order (masking the others with +inf would let a
        # replica with an infinite score tie with them)
        idx = np.flatnonzero(columns.eligible)
        scores = scores[idx]
        order = np.argsort(scores, kind="stable")
        first = int(order[0])
        ties = order[scores[order] == scores[first]].tolist()
        pick = first
        if len(ties) > 1:  # the same tie-break as ``choose``, in the same order
            keys = columns.keys
            ties.sort()
            sizes = [columns.cached_blocks(keys[idx[i]]) for i in ties]
            fewest = min(sizes)
            kept = [i for i, size in zip(ties, sizes, strict=True) if size == fewest]
            pick = kept[rng.randrange(len(kept))] if len(kept) > 1 else kept[0]
        head = order[: MAX_RANKING + 1].tolist()
        ranking = tuple(columns.keys[idx[i]] for i in head if i != pick)[:MAX_RANKING]
        at = int(idx[pick])
        return Decision(
            replica=columns.keys[at],
            policy=self.name,
            usable_tokens=_tokens(request, int(columns.usable_blocks[at])),
            kv_tokens=_tokens(request, int(columns.kv_blocks[at])),
            score=float(scores[pick]),
            terms={name: float(v[at]) for name, v in zip(TERM_NAMES, values, strict=True)},
            ranking=ranking,
        )


TERM_NAMES = (
    "prefill", "queue", "decode", "kv", "interference", "eviction", "batch", "miss"
)  # fmt: skip


# ---------------------------------------------------------------------------- registry

POLICIES: dict[str, type[Any]] = {
    "round_robin": RoundRobin,
    "random": RandomChoice,
    "least_loaded": LeastLoaded,
    "longest_prefix": LongestPrefix,
    "dynamo": Dynamo,
    "sglang": SGLangCacheAware,
    "llmd": LlmD,
    "preble": PrebleE2,
    "vllm_kv_aware": VllmKvAware,
    "vllm_cache_aware": VllmCacheAware,
    "ours": Ours,
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build a policy by name with optional parameters (unknown names or keys -> ValueError).

    For ``ours``, keys of ``CostModel`` may be given under ``"cost"`` as a nested mapping.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    params = dict(params or {})
    allowed = {f.name for f in fields(cls) if not f.name.startswith("_")} - {"name", "cursor"}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"policy {name!r} has no parameter(s) {', '.join(sorted(unknown))}")
    if "cost" in params and isinstance(params["cost"], Mapping):
        cost_fields = {f.name for f in fields(CostModel)}
        bad = set(params["cost"]) - cost_fields
        if bad:
            raise ValueError(f"cost model has no parameter(s) {', '.join(sorted(bad))}")
        params["cost"] = CostModel(**params["cost"])
    if cls is not Ours:  # (which checks its own in __post_init__)
        for key, value in params.items():
            # the baselines' weights, thresholds, credits and times: a NaN, a negative or an
            # infinite weight would rank candidates arbitrarily (a time may be inf: never)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if number and (not value >= 0 or (math.isinf(value) and not key.endswith("_s"))):
                raise ValueError(f"policy {name!r}: {key} must be finite and >= 0, got {value}")
    policy: Policy = cls(**params)
    return policy
