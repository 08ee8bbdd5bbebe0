"""The routing step both the service and the simulator run: filter candidates, look up the
prefix index once, ask the policy, record the dispatch (load and speculative entries).

Two shapes of candidates, one decision: a list of :class:`Candidate` (one per replica) for
small fleets and for every policy, or :class:`CandidateColumns` (arrays, one element per
replica) for policies that can score a whole fleet in array operations (``ours``) once the
model has ``columnar_min`` replicas or more: per-replica Python grows linearly with the
fleet, the array path's cost hardly does (``kvrouter bench route``; docs/benchmarks.md).

The settings it runs with are router/core/routing_settings.py's, which replicas may take a
request router/core/eligibility.py's, what it learns of the engines
router/core/learned_layout.py's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.core.eligibility import eligible_columns, filter_candidates
from router.core.engine_hits import engine_holds, granted_blocks
from router.core.index import PrefixIndex
from router.core.learned_layout import LearnedLayout
from router.core.load import LoadTracker
from router.core.policies import Candidate, CandidateColumns, ColumnarPolicy, Policy
from router.core.prefix_match import PrefixMatches
from router.core.routing_settings import RoutingSettings
from router.core.session import SessionHint, SessionTable
from router.core.turnover import CacheTurnover
from router.core.types import (
    NO_MATCH,
    Decision,
    Kind,
    PrefixMatch,
    ReplicaKey,
    RouteRequest,
)

# Candidate lists at least this long are scored as arrays (policies that can): below it,
# per-replica Python is cheaper than the array path's fixed cost (the crossover
# `kvrouter bench route` shows).
COLUMNAR_MIN = 20


@dataclass(slots=True, frozen=True)
class Dispatch:
    """What :meth:`RoutingEngine.dispatched` guessed of one request on ``replica``, to take
    back (:meth:`RoutingEngine.withdraw`) if the request never reaches its engine's cache:
    the index's speculative entries (``spec_id`` 0: none) and the session's hint
    (``hint``, and the session's hint it replaced: ``previous``; ``awaited``: the request
    made the index await the hint's last block, ``PrefixIndex.await_store``). ``shared``:
    the id ``on_dispatch`` gave it (0: none), which ``on_withdraw`` names. A dispatch of
    another router pod (:meth:`RoutingEngine.adopt`) has the session's ``digest`` instead
    of its id, and a learned binding as its hint."""

    replica: ReplicaKey
    spec_id: int = 0
    kv: Sequence[int] = ()
    states: Sequence[int] = ()
    session_id: str | None = None
    hint: SessionHint | None = None
    previous: SessionHint | None = None
    awaited: bool = False
    shared: int = 0
    digest: int = 0


class RoutingEngine(LearnedLayout):
    """Index + load + policy for one model. Pure: the caller passes ``now`` and ``rng``.

    ``columnar_min``: candidate lists at least this long are handed to the policy as
    :class:`CandidateColumns` when it is a :class:`ColumnarPolicy` (same decision, cost
    nearly independent of the fleet size). Pass ``replicas`` as the same tuple each time
    (kept until the fleet changes): where each replica sits in the index and the load table
    is then looked up once, not per request (other sequences are looked up each time).
    What it knows of the model's engines (``layout``, ``learn``) is :class:`LearnedLayout`'s
    (router/core/learned_layout.py)."""

    def __init__(
        self,
        index: PrefixIndex,
        load: LoadTracker,
        policy: Policy,
        settings: RoutingSettings,
        *,
        columnar_min: int = COLUMNAR_MIN,
    ) -> None:
        super().__init__(index, settings)
        self.load = load
        self.policy = policy
        self.columnar_min = columnar_min
        self._columnar = callable(getattr(policy, "choose_columns", None))
        # a policy reproducing a peer that routes on engine events alone says so
        self._speculates = bool(getattr(policy, "speculates", True))
        # one reproducing a peer that counts a request's prefill work by its own estimate
        # (``vllm_kv_aware``) gives it: what its cost reads back as the replica's queue
        self._accounted: Callable[[RouteRequest, Decision], int | None] | None = getattr(
            policy, "accounted_prefill_tokens", None
        )
        self.sessions: SessionTable | None = None
        if settings.session_ttl_s > 0 and getattr(policy, "uses_session_hints", False):
            self.sessions = SessionTable(settings.session_ttl_s, settings.max_sessions)
        # called by dispatched() with (request, replica, state hashes, now, speculative TTL,
        # the blocks its session's hint covers), returning an id for the dispatch (0: none),
        # and by withdraw() with that id: router pods share what they speculate and bind,
        # and what they take back (router/service/pod_share.py)
        self.on_dispatch: Callable[[RouteRequest, ReplicaKey, list[int], float, float, int], int]
        self.on_dispatch = _ignore
        self.on_withdraw: Callable[[int], None] = _ignore_withdraw
        self.turnover = CacheTurnover(reuse_window_s=settings.reuse_window_s)

    def _turnover(self, replicas: Sequence[ReplicaKey], now: float) -> CacheTurnover:
        """The cache turnover meter, sampled from the index when due (candidates carry each
        replica's eviction risk)."""
        turnover = self.turnover
        if turnover.due(now):
            index = self.index
            held = index.replica_size
            turnover.sample(now, replicas, index.evicted_blocks, lambda k: held(k)[0])
        return turnover

    def matches(
        self, request: RouteRequest, replicas: Sequence[ReplicaKey], now: float
    ) -> PrefixMatches:
        """The cached prefix of ``request`` on every replica, the hybrid-state rule applied
        when it holds for ``replicas`` (a checkpoint usable only before the prompt's last
        token)."""
        if not request.reads_cache:
            return PrefixMatches.empty()
        hybrid = self.hybrid_for(replicas)
        layout = self.layout
        hashes = request.block_hashes
        ahead = self.lookahead_tokens
        if ahead > 1:  # a block is hashed, so found, once the ``ahead`` tokens after it exist
            reach = max(request.prompt_tokens - ahead, 0) // request.block_size
            if reach < len(hashes):
                hashes = hashes[:reach]
        return self.index.match(
            hashes,
            hybrid=hybrid,
            now=now,
            prompt_tokens=request.prompt_tokens,
            block_size=request.block_size,
            align_blocks=layout.alignment_blocks,
            peek_blocks=layout.alignment_blocks if self.drops_eagle_block else 0,
            fine_blocks=self.settings.fine_engine_blocks,
        )

    @property
    def _hint_kind(self) -> Kind:
        """What an engine reports of a hint's last block: a hybrid model's hint ends on a
        recurrent-state checkpoint (``EngineHolds.next_hit_blocks``), a KV-only one on KV."""
        return Kind.STATE if self.layout.hybrid else Kind.KV

    def _await_hint(self, replica: ReplicaKey, last_hash: int) -> bool:
        """Await the engine's report of a hint's last block; whether this call made it
        awaited (it was not already), so that taking the hint back stops awaiting it."""
        index, kind = self.index, self._hint_kind
        fresh = not index.awaits(replica, last_hash, kind)
        return index.await_store(replica, last_hash, kind) and fresh

    def adopt(
        self,
        replica: ReplicaKey,
        kv: Sequence[int],
        states: Sequence[int],
        now: float,
        ttl: float,
        digest: int,
        blocks: int,
        last_hash: int,
        expires_at: float,
    ) -> Dispatch:
        """Another router pod sent a request to ``replica`` (router/service/pod_share.py):
        its blocks ``kv`` / ``states`` are speculated for ``ttl`` (none when ``ttl`` <= 0),
        and its session (``digest``, 0: none) is remembered as this pod's own hints are
        (``SessionTable.learn``, lapsing at ``expires_at``), settling when the engine's
        events name its last block (the row does not say whether the prompt was hashed
        exactly: an approximate one's, which no event names, stays awaited until
        ``MAX_AWAITED`` later awaits push it out). Returns what was taken, for
        :meth:`withdraw` when that pod withdraws the request."""
        spec_id = self.index.speculate(replica, kv, states, now, ttl) if kv and ttl > 0 else 0
        hint = previous = None
        awaited = False
        if digest and self.sessions is not None and expires_at > now:
            awaited = bool(blocks) and self._await_hint(replica, last_hash)
            epoch = self.index.cache_epoch(replica)
            hint, previous = self.sessions.learn(
                digest, replica, blocks, last_hash, now, expires_at, epoch, True
            )
        return Dispatch(
            replica,
            spec_id,
            kv if spec_id else (),
            states if spec_id else (),
            hint=hint,
            previous=previous,
            awaited=awaited,
            digest=digest,
        )

    def _hint(self, request: RouteRequest, now: float) -> tuple[SessionHint | None, int]:
        """The request's session hint and how many of its blocks the engine grants it there
        (0: none, also when the replica's cache was forgotten since: cleared, or removed and
        back)."""
        if self.sessions is None or not request.session_id or not request.reads_cache:
            return None, 0
        hint = self.sessions.get(request.session_id, now)
        if hint is None or hint.epoch != self.index.cache_epoch(hint.replica):
            return None, 0
        if hint.settles and not self.index.awaits(hint.replica, hint.last_hash, self._hint_kind):
            return hint, 0  # the engine's events came: the index tells what is still held
        covered = hint.covers(request.block_hashes)
        if not covered:
            return hint, 0
        fine = self.settings.fine_engine_blocks
        return hint, granted_blocks(covered, request, self.layout, self.drops_eagle_block, fine)

    def candidates(
        self, request: RouteRequest, replicas: Sequence[ReplicaKey], now: float
    ) -> list[Candidate] | CandidateColumns:
        if self._columnar and len(replicas) >= self.columnar_min:
            return self._columns(request, replicas, now)
        eligible = filter_candidates(replicas, self.load, self.settings.busy, now)
        matches = self.matches(request, replicas, now)
        get = matches.get
        size = self.index.replica_size
        risk = self._turnover(replicas, now).risk
        out = [Candidate(r, get(r, NO_MATCH), view, size(r)[0], risk(r)) for r, view in eligible]
        hint, covered = self._hint(request, now)
        if covered:
            for i, c in enumerate(out):
                if c.replica == hint.replica and c.match.usable_blocks < covered:  # type: ignore[union-attr]
                    m = c.match
                    out[i] = c._replace(
                        match=PrefixMatch(
                            max(m.kv_blocks, covered),
                            max(m.gpu_blocks, covered),
                            max(m.host_blocks, covered),
                            covered,
                        )
                    )
        return out

    def _columns(
        self, request: RouteRequest, replicas: Sequence[ReplicaKey], now: float
    ) -> CandidateColumns:
        """``candidates`` as arrays: the same eligibility rules as ``filter_candidates``."""
        load = self.load.columns(replicas)
        up = eligible_columns(load, self.settings.busy)
        matches = self.matches(request, replicas, now)
        slots = self.index.slots(replicas)
        kv, gpu, host, usable = matches.columns(slots)
        hint, covered = self._hint(request, now)
        if covered:
            slot = int(self.index.slots([hint.replica])[0])  # type: ignore[union-attr]
            at = np.flatnonzero(slots == slot) if slot >= 0 else np.empty(0, np.intp)
            if len(at) and usable[at[0]] < covered:
                kv, gpu, host, usable = (np.array(a) for a in (kv, gpu, host, usable))
                for arr in (kv, gpu, host):
                    arr[at] = np.maximum(arr[at], covered)
                usable[at] = covered
        index = self.index
        risks = self._turnover(replicas, now).risks(replicas)
        return CandidateColumns(
            replicas, up, kv, gpu, host, usable, load, lambda k: index.replica_size(k)[0], risks
        )

    def choose(
        self,
        request: RouteRequest,
        candidates: list[Candidate] | CandidateColumns,
        now: float,
        rng: random.Random,
    ) -> Decision:
        """The policy's decision among ``candidates`` (either shape ``candidates`` gives)."""
        if isinstance(candidates, CandidateColumns):
            policy: ColumnarPolicy = self.policy  # type: ignore[assignment]
            return policy.choose_columns(request, candidates, now, rng)
        return self.policy.choose(request, candidates, now, rng)

    @staticmethod
    def best_usable_tokens(
        request: RouteRequest, candidates: list[Candidate] | CandidateColumns
    ) -> int:
        """The longest usable cached prefix among the eligible candidates, in tokens (what a
        pure-affinity choice would have reused; compare with the decision's)."""
        if isinstance(candidates, CandidateColumns):
            usable = candidates.usable_blocks[candidates.eligible]
            blocks = int(usable.max()) if usable.size else 0
        else:
            blocks = max((c.match.usable_blocks for c in candidates), default=0)
        return min(blocks * request.block_size, request.prompt_tokens)

    def route(
        self,
        request: RouteRequest,
        replicas: Sequence[ReplicaKey],
        now: float,
        rng: random.Random,
    ) -> Decision:
        """Pick a replica; raises NoReplicaAvailable when none can take the request."""
        return self.choose(request, self.candidates(request, replicas, now), now, rng)

    def dispatched(
        self,
        request: RouteRequest,
        decision: Decision,
        now: float,
        speculative_ttl_s: float | None = None,
        class_weight: float = 1.0,
        exact: bool = True,
    ) -> Dispatch:
        """Record that ``request`` was sent per ``decision`` (load: its prompt beyond the
        decision's usable prefix queued for prefill, or what the policy's
        ``accounted_prefill_tokens`` says of its own decision; speculative entries for
        ``speculative_ttl_s``, by default the settings'); ``class_weight`` scales its decode
        weight (LoadTracker.dispatch). ``exact``: the prompt was hashed as the engines hash
        it (approximate prompts live on speculative entries alone, sessions included).
        Returns what was guessed, for :meth:`withdraw`."""
        cached = decision.usable_tokens
        accounted = self._accounted(request, decision) if self._accounted is not None else None
        if accounted is not None:
            cached = request.prompt_tokens - accounted
        self.load.dispatch(
            request.request_id,
            decision.replica,
            request.prompt_tokens,
            cached,
            request.max_output_tokens,
            class_weight,
            request.samples,
            request.prompts,
        )
        new_tokens = request.prompt_tokens - decision.usable_tokens
        self.turnover.dispatched(decision.replica, new_tokens / request.block_size)
        ttl = self.settings.speculative_ttl() if speculative_ttl_s is None else speculative_ttl_s
        # a session's hint carries its next turn (see DEFAULT_SPECULATIVE_TTL_S)
        hinted = exact and request.session_id and self.sessions is not None
        if not self._speculates or (hinted and not self.settings.speculate_sessions):
            ttl = 0.0
        held = engine_holds(request, self.layout, self.drops_eagle_block, self.lookahead_tokens)
        states: list[int] = []
        kv: tuple[int, ...] = ()
        spec_id = 0
        if ttl > 0 and held.kv_blocks:
            states = list(held.state_hashes)
            kv = tuple(request.block_hashes[: held.kv_blocks])
            spec_id = self.index.speculate(decision.replica, kv, states, now, ttl)
        hint = previous = None
        awaited = False
        if self.sessions is not None and request.session_id:
            reused = request.block_hashes[: held.next_hit_blocks]
            # first: the replica gets its slot and epoch if the index did not know it (a
            # hint of epoch 0 would match any key the index does not know, and the array
            # path finds the hinted replica by its slot)
            self.index.add_replica(decision.replica)
            if exact and reused:
                awaited = self._await_hint(decision.replica, reused[-1])
            epoch = self.index.cache_epoch(decision.replica)
            hint, previous = self.sessions.record(
                request.session_id, decision.replica, reused, now, epoch, settles=exact
            )
        shared = self.on_dispatch(request, decision.replica, states, now, ttl, held.next_hit_blocks)
        return Dispatch(
            decision.replica,
            spec_id,
            kv,
            states,
            request.session_id,
            hint,
            previous,
            awaited,
            shared,
        )

    def withdraw(self, dispatch: Dispatch) -> None:
        """The request of ``dispatch`` never reached its replica's cache (the replica
        refused the connection, dropped it unanswered, or answered an error): take back
        its speculative entries (those no other live dispatch names) and its session's
        hint (the session's earlier hint comes back, unless a later request replaced it),
        so no request is sent there for a prefix it does not hold; nor is the hint's last
        block awaited any more when the request was the one to await it (a hint that comes
        back ending on that block, settled before, would credit it again: the engine
        reports nothing of a prompt it never took). Load is the caller's
        (``LoadTracker.complete``, or a retry's ``dispatch``). The other router pods are
        told (``on_withdraw``); a dispatch of theirs (:meth:`adopt`) is taken back alike,
        its learned binding by ``SessionTable.unlearn``. Idempotent here (the other pods
        may hear of it twice)."""
        if dispatch.shared:
            self.on_withdraw(dispatch.shared)
        if dispatch.spec_id:
            self.index.withdraw(dispatch.replica, dispatch.spec_id, dispatch.kv, dispatch.states)
        if dispatch.awaited and dispatch.hint is not None:
            self.index.unawait(dispatch.replica, dispatch.hint.last_hash, self._hint_kind)
        sessions, hint = self.sessions, dispatch.hint
        if hint is not None and sessions is not None:
            if dispatch.digest:
                sessions.unlearn(dispatch.digest, hint, dispatch.previous)
            elif dispatch.session_id:
                sessions.undo(dispatch.session_id, hint, dispatch.previous)


def _ignore(
    request: RouteRequest,
    replica: ReplicaKey,
    states: list[int],
    now: float,
    ttl: float,
    hint_blocks: int,
) -> int:
    """The default ``on_dispatch``: nobody listens."""
    return 0


def _ignore_withdraw(shared: int) -> None:
    """The default ``on_withdraw``: nobody listens."""
