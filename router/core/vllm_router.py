"""vllm-router 0.1.17's routing policies, reproduced for the simulator: the peer the live
head-to-head (``kvrouter bench live``) runs, unmodified, from PyPI.

* :class:`VllmKvAware`, ``--policy kv_aware``: prefill-work cost on the engines' KV events.
* :class:`VllmCacheAware`, ``--policy cache_aware`` (SGLang's router's policy): the router's
  own approximate tree of what it sent where, balanced by in-flight counts.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.core.candidates import Candidate, decide
from router.core.types import Decision, ReplicaKey, RouteRequest


@dataclass(slots=True)
class VllmKvAware:
    """vllm-router 0.1.17 ``kv_aware`` (src/policies/kv_aware.rs): lowest
    ``(new_prefill_tokens + active_prefill_tokens) * (active_requests + 1)`` wins.

    ``new_prefill_tokens`` is the prompt minus its credited prefix: the GPU prefix (at most
    ``(prompt - 1) // block_size`` blocks), plus the continuation held on host at
    ``host_credit`` or on disk / external storage at ``disk_credit``, rounded up;
    ``active_prefill_tokens`` is the new-prefill work this router sent that has not reached
    its first token (each request's ``new_prefill_tokens`` on the replica it went to:
    ``accounted_prefill_tokens``), ``active_requests`` its requests in flight. Equal costs
    go to the first candidate in order, except zero-cost ones, which go to the least loaded.
    ``temperature > 0`` samples ``exp(-(cost - min) / temperature)`` instead. With
    ``session_ttl_s > 0``, a request with a session id goes to the replica its session was
    bound to while that binding is fresh (a hard pin, as vllm-router's
    ``kv_aware_session_affinity_ttl_secs``); the binding lasts ``session_ttl_s`` after the
    session's last routed request (vllm-router counts from its last *completed* one).

    Differences that remain: vllm-router re-hashes the prompt in its own 16-token blocks; here
    the match is in the router's blocks (``block_size`` of the request)."""

    name: str = "vllm_kv_aware"
    temperature: float = 0.0
    host_credit: float = 0.8
    disk_credit: float = 0.3
    session_ttl_s: float = 0.0
    max_sessions: int = 65536
    speculates: bool = False  # vllm-router routes on the engines' events alone
    _sessions: dict[str, tuple[ReplicaKey, float]] = field(default_factory=dict, repr=False)

    def new_prefill_tokens(self, request: RouteRequest, c: Candidate) -> int:
        m = c.match
        prompt = request.prompt_tokens
        device = min(m.gpu_blocks, max(prompt - 1, 0) // request.block_size)
        # one continuation where the device prefix ends: the host segment if there is one,
        # else the disk one (none when the device prefix was cut at the last prompt token)
        cont = 0.0
        if device == m.gpu_blocks:
            if m.host_blocks > device:
                cont = (m.host_blocks - device) * self.host_credit
            else:
                cont = (m.kv_blocks - device) * self.disk_credit
        credited = min((device + cont) * request.block_size, max(prompt - 1, 0))
        return max(math.ceil(prompt - credited), 0)

    def accounted_prefill_tokens(self, request: RouteRequest, decision: Decision) -> int | None:
        """What vllm-router adds to the chosen replica's ``active_prefill_tokens`` when it
        sends ``request`` there (``begin_prefill(new_prefill_tokens)``): its own estimate,
        not the prompt beyond kvrouter's usable prefix (``RoutingEngine.dispatched``).
        None for a decision without this policy's terms (a retry elsewhere, a decode leg:
        their callers clear the terms of the pick they no longer are)."""
        new = decision.terms.get("new_prefill_tokens")
        return None if new is None else int(new)

    def cost(self, request: RouteRequest, c: Candidate) -> tuple[float, int]:
        new = self.new_prefill_tokens(request, c)
        ptoken = new + c.load.queued_prefill_tokens
        return float(ptoken * (c.load.in_flight + 1)), ptoken

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        costs = [self.cost(request, c) for c in candidates]
        order = sorted(range(len(candidates)), key=lambda i: costs[i][0])  # stable: first wins
        pick = order[0]
        session = request.session_id if self.session_ttl_s > 0 else None
        bound = self._sessions.get(session) if session is not None else None
        sticky = False
        if bound is not None and bound[1] > now:
            at = [i for i, c in enumerate(candidates) if c.replica == bound[0]]
            if at:
                pick, sticky = at[0], True
        if not sticky:
            if self.temperature > 0 and len(order) > 1 and costs[pick][0] > 0:
                lo = costs[pick][0]
                weights = [math.exp(-(costs[i][0] - lo) / self.temperature) for i in order]
                pick = order[rng.choices(range(len(order)), weights=weights)[0]]
            elif costs[pick][0] == 0:  # zero work: the least prefill, then the least loaded
                zero = [i for i in order if costs[i][0] == 0]
                pick = min(zero, key=lambda i: (costs[i][1], candidates[i].load.in_flight))
        if session is not None:
            self._sessions.pop(session, None)
            self._sessions[session] = (candidates[pick].replica, now + self.session_ttl_s)
            if len(self._sessions) > self.max_sessions:  # oldest binding first
                del self._sessions[next(iter(self._sessions))]
        order.remove(pick)
        ranked = [candidates[pick]] + [candidates[i] for i in order]
        terms = {"new_prefill_tokens": float(self.new_prefill_tokens(request, candidates[pick]))}
        terms["sticky"] = float(sticky)
        return decide(self.name, request, ranked, costs[pick][0], terms)


@dataclass(slots=True)
class VllmCacheAware:
    """vllm-router 0.1.17 ``cache_aware`` (src/policies/cache_aware.rs, from SGLang's router).

    The router keeps, per replica, an approximate prefix tree of the prompts *it* sent there
    (no engine events: it never learns of evictions, only of its own trims). Per request:

    * if the in-flight counts are imbalanced (``max - min > balance_abs_threshold`` and
      ``max > balance_rel_threshold * min``), the least loaded replica;
    * else, if the best match covers more than ``cache_threshold`` of the prompt, the
      replica with that match (the most recently used of equal ones);
    * else the least loaded replica (the first of equal ones, in candidate order).

    The chosen replica's tree then learns the whole prompt. Every ``eviction_interval_s``
    each tree is cut, least recently used leaves first, to ``max_tree_tokens``
    (vllm-router's ``--max-tree-size`` of 32 Mi characters, at 4 characters a token).

    Differences that remain: vllm-router matches characters of the prompt text, here whole
    blocks of the canonical chain (``block_size`` of the request); its tree is shared by
    its worker threads without ordering, here one decision at a time; the ``X-Session-Id``
    map of later versions is not modelled."""

    name: str = "vllm_cache_aware"
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_tokens: int = 33_554_432 // 4
    uses_prefix_index: bool = False  # its own tree, not the engines' events
    speculates: bool = False
    # replica -> its tree as block hash -> when it was last used (a counter), least
    # recently used first
    _trees: dict[ReplicaKey, OrderedDict[int, int]] = field(default_factory=dict, repr=False)
    _next_eviction: float | None = field(default=None, repr=False)
    _clock: int = field(default=0, repr=False)

    def matched_blocks(self, request: RouteRequest, replica: ReplicaKey) -> int:
        """Leading blocks of ``request`` in ``replica``'s tree."""
        tree = self._trees.get(replica)
        if not tree:
            return 0
        n = 0
        for h in request.block_hashes:
            if h not in tree:
                break
            n += 1
        return n

    def _evict(self, now: float, block_size: int) -> None:
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        if now < self._next_eviction:
            return
        self._next_eviction = now + self.eviction_interval_s
        limit = max(self.max_tree_tokens // max(block_size, 1), 0)
        for tree in self._trees.values():
            while len(tree) > limit:
                tree.popitem(last=False)

    def _learn(self, request: RouteRequest, replica: ReplicaKey) -> None:
        tree = self._trees.setdefault(replica, OrderedDict())
        # deepest block first, so the root end of the chain is the most recently used and
        # eviction takes leaves before the prefixes they hang from (as a radix tree does)
        for h in reversed(request.block_hashes):
            self._clock += 1
            tree[h] = self._clock
            tree.move_to_end(h)

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision:
        self._evict(now, request.block_size)
        loads = [c.load.in_flight for c in candidates]
        hi, lo = max(loads), min(loads)
        least = loads.index(lo)
        imbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        matched = [self.matched_blocks(request, c.replica) for c in candidates]
        best = max(matched)
        rate = min(best * request.block_size, request.prompt_tokens) / max(request.prompt_tokens, 1)
        if imbalanced or rate <= self.cache_threshold or best == 0:
            pick, branch = least, "balanced" if imbalanced else "low_match"
        else:
            # among equal matches, the replica whose tree used the deepest matched block last
            h = request.block_hashes[best - 1]
            tied = [i for i, m in enumerate(matched) if m == best]
            pick = max(tied, key=lambda i: self._trees[candidates[i].replica][h])
            branch = "cache"
        self._learn(request, candidates[pick].replica)
        ranked = [candidates[pick]] + [c for i, c in enumerate(candidates) if i != pick]
        terms = {"match_rate": rate, branch: 1.0}
        return decide(self.name, request, ranked, rate, terms)
