"""The routing step both the service and the simulator run: filter candidates, look up the
prefix index once, ask the policy, record the dispatch (load and speculative entries).

Two shapes of candidates, one decision: a list of :class:`Candidate` (one per replica) for
small fleets and for every policy, or :class:`CandidateColumns` (arrays, one element per
replica) for policies that can score a whole fleet in array operations (``ours``) once the
model has ``columnar_min`` replicas or more: per-replica Python grows linearly with the
fleet, the array path's cost hardly does (``kvrouter bench route``; docs/benchmarks.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.core.engine_hits import engine_holds, granted_blocks
from router.core.errors import NoReplicaAvailable
from router.core.index import PrefixIndex
from router.core.load import LoadColumns, LoadTracker, LoadView
from router.core.policies import Candidate, CandidateColumns, ColumnarPolicy, Policy
from router.core.prefix_match import PrefixMatches
from router.core.session import SessionHint, SessionTable
from router.core.state_layout import (
    SOURCE_ENGINE,
    SOURCE_MODEL_CONFIG,
    StateLayout,
    effective_layout,
)
from router.core.turnover import REUSE_WINDOW_S, CacheTurnover
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
class BusyThresholds:
    """A replica above any threshold is skipped while some replica is below all of them.

    ``None`` disables a threshold. When every healthy replica is busy, ``reject_when_all_busy``
    decides between refusing the request (the edge answers 429/503) and routing among all.
    """

    max_in_flight: int | None = None
    max_queued_prefill_tokens: int | None = None
    max_kv_usage: float | None = None
    reject_when_all_busy: bool = False

    @property
    def enabled(self) -> bool:
        """Whether any threshold is set."""
        return (
            self.max_in_flight is not None
            or self.max_queued_prefill_tokens is not None
            or self.max_kv_usage is not None
        )

    def busy(self, load: Any) -> Any:
        """Whether a replica is over a threshold: a bool for a ``LoadView``, a bool array for
        ``LoadColumns`` (the same comparisons)."""
        over: Any = False
        if self.max_in_flight is not None:
            over = over | (load.in_flight >= self.max_in_flight)
        if self.max_queued_prefill_tokens is not None:
            over = over | (load.queued_prefill_tokens >= self.max_queued_prefill_tokens)
        if self.max_kv_usage is not None:
            over = over | (load.kv_usage >= self.max_kv_usage)
        return over


DEFAULT_SPECULATIVE_TTL_S = 30.0
"""How long a dispatched prompt's blocks count as held by its replica until the engine's
events report them (the events end each guess early: router.core.index), so that a request
sharing a prefix with one still queued or prefilling follows it. Long enough for a prefill
that waits in a saturated engine's queue; a bound only for prompts no engine stores.

Requests of a session are not speculated by default (``speculate_sessions``) when the policy
reads session hints: the hint already carries the session's next turn to its replica, and
guesses of other sessions' shared prefixes crowd decode batches (docs/configuration.md)."""


@dataclass(slots=True, frozen=True)
class RoutingSettings:
    """Per-model routing settings. ``hybrid``: whether the model keeps recurrent state, so a
    prefix is usable only up to a state checkpoint (None: learned from the engines, see
    router.core.state_layout; a bool overrides). ``state_interval_blocks``: the engines'
    checkpoint grid in router blocks, for the checkpoints the router speculates (0: learned;
    until it is known only the prompt end is speculated). ``speculative_ttl_s``: how long
    a dispatched prompt's blocks count as held by its replica before the engine's events say
    so (0: not at all; events replace the guess as they arrive: router.core.index); with
    a policy that reads session hints, a request of a session is speculated only with
    ``speculate_sessions`` (see ``DEFAULT_SPECULATIVE_TTL_S``). ``session_ttl_s``: how long
    a session's last replica is remembered as a hint (router/core/session.py; 0: off); only
    policies with ``uses_session_hints`` read it. ``reuse_window_s``: the time scale of a
    cached block's next use, by which the turnover meter prices eviction
    (router/core/turnover.py). ``engine_block_size``: the engines' cache-hit alignment in
    tokens (vLLM: the scheduler block, or ``--prefix-match-unit``), a multiple or a divisor of
    ``block_size`` (0: learned from a hybrid model's checkpoints, else the router block).
    ``eagle``: the engines run EAGLE / MTP speculative decoding and give back a block of
    every hit (vLLM's EAGLE block drop): every hit gives back its last engine block and a
    hybrid prompt's last checkpoint sits one engine block lower (router/core/engine_hits.py).
    Engines whose events show lookahead hashes (``RoutingEngine.learn``) drop nothing, so
    ``eagle`` is then not applied."""

    block_size: int = 64
    hybrid: bool | None = None
    state_interval_blocks: int = 0
    speculative_ttl_s: float | None = None  # None: DEFAULT_SPECULATIVE_TTL_S
    speculate_sessions: bool = False
    busy: BusyThresholds = BusyThresholds()
    session_ttl_s: float = 600.0
    max_sessions: int = 100_000
    reuse_window_s: float = REUSE_WINDOW_S
    engine_block_size: int = 0
    eagle: bool = False

    @property
    def alignment_blocks(self) -> int:
        """``engine_block_size`` in router blocks (0: not configured; 1: no coarser than the
        router's block)."""
        if self.engine_block_size <= 0:
            return 0
        return max(1, self.engine_block_size // self.block_size)

    @property
    def fine_engine_blocks(self) -> bool:
        """Whether the engines' blocks are taken as finer than the router's: a prompt cached
        whole is then granted all but its last engine block, less than a router block short,
        and is predicted whole. True for ``engine_block_size`` under ``block_size`` and when
        it is not configured (vLLM's default block of 16 tokens and SGLang's page of 1 are
        finer than a router block); a configured block of the router's size or coarser
        predicts such a hit one router block short, as the engine grants it."""
        return self.engine_block_size < self.block_size

    def speculative_ttl(self) -> float:
        """``speculative_ttl_s``, or ``DEFAULT_SPECULATIVE_TTL_S`` when not set."""
        ttl = self.speculative_ttl_s
        return DEFAULT_SPECULATIVE_TTL_S if ttl is None else ttl


def none_up(replicas: int, drained: int) -> NoReplicaAvailable:
    """The error when none of ``replicas`` is healthy and not draining, ``drained`` of them
    healthy but draining: it names what keeps them out (a drain is not a failure)."""
    if not drained:
        return NoReplicaAvailable("no healthy replica is available")
    failing = replicas - drained
    rest = f", the other {failing} unhealthy" if failing else ""
    return NoReplicaAvailable(
        f"no replica is available: {drained} of {replicas} draining (no new requests){rest}"
    )


def filter_candidates(
    replicas: Sequence[ReplicaKey], load: LoadTracker, busy: BusyThresholds, now: float
) -> list[tuple[ReplicaKey, LoadView]]:
    """Healthy, non-draining replicas, the busy ones dropped while others remain."""
    up: list[tuple[ReplicaKey, LoadView]] = []
    drained = 0
    for r in replicas:
        v = load.view(r, now)
        if v.healthy and not v.draining:
            up.append((r, v))
        elif v.healthy:
            drained += 1
    if not up:
        raise none_up(len(replicas), drained)
    if not busy.enabled:
        return up
    free = [(r, v) for r, v in up if not busy.busy(v)]
    if free:
        return free
    if busy.reject_when_all_busy:
        raise NoReplicaAvailable("every replica is over its busy threshold", busy=True)
    return up


def eligible_columns(load: LoadColumns, busy: BusyThresholds) -> np.ndarray:
    """``filter_candidates`` on columns: a bool mask of the healthy, non-draining replicas,
    the busy ones dropped while others remain (the same errors when none is left)."""
    healthy = load.healthy > 0
    up: np.ndarray = healthy & (load.draining == 0)
    if not up.any():
        raise none_up(len(up), int(np.count_nonzero(healthy)))
    if busy.enabled:
        free = up & ~busy.busy(load)
        if free.any():
            return free  # type: ignore[no-any-return]
        if busy.reject_when_all_busy:
            raise NoReplicaAvailable("every replica is over its busy threshold", busy=True)
    return up


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


class RoutingEngine:
    """Index + load + policy for one model. Pure: the caller passes ``now`` and ``rng``.

    ``columnar_min``: candidate lists at least this long are handed to the policy as
    :class:`CandidateColumns` when it is a :class:`ColumnarPolicy` (same decision, cost
    nearly independent of the fleet size). Pass ``replicas`` as the same tuple each time
    (kept until the fleet changes): where each replica sits in the index and the load table
    is then looked up once, not per request (other sequences are looked up each time).

    The state layout (``layout``): the settings' ``hybrid`` / ``state_interval_blocks`` when
    set, else what was learned: the model is hybrid once one of the replicas it routes to has
    stored a state checkpoint in the index (checked when the index's ``state_generation``
    moves, so not per request), or once the edge says so (``learn``: publishers' registrations,
    the model's config); the grid comes from the edge (``learn``, fed by
    ``state_layout.CheckpointGrid``)."""

    def __init__(
        self,
        index: PrefixIndex,
        load: LoadTracker,
        policy: Policy,
        settings: RoutingSettings,
        *,
        columnar_min: int = COLUMNAR_MIN,
    ) -> None:
        self.index = index
        self.load = load
        self.policy = policy
        self.columnar_min = columnar_min
        self._columnar = callable(getattr(policy, "choose_columns", None))
        # a policy reproducing a peer that routes on engine events alone says so
        self._speculates = bool(getattr(policy, "speculates", True))
        self._learned_hybrid: str | None = None  # the source that showed it is hybrid
        self._learned_interval: tuple[int, str] | None = None
        self._learned_alignment: tuple[int, str] | None = None
        self._learned_lookahead: tuple[int, str] | None = None
        self._state_generation = -1
        self.settings = settings  # fixed for the engine's life (``layout`` derives from it)
        self.layout = self._effective()
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

    def _effective(self) -> StateLayout:
        s = self.settings
        return effective_layout(
            s.hybrid,
            s.state_interval_blocks,
            self._learned_hybrid,
            self._learned_interval,
            s.alignment_blocks,
            self._learned_alignment,
        )

    @property
    def learned_hybrid(self) -> str | None:
        """The source that showed the model is hybrid (None: none did)."""
        return self._learned_hybrid

    @property
    def learned_interval(self) -> tuple[int, str] | None:
        """The engines' checkpoint grid and its source, when learned."""
        return self._learned_interval

    @property
    def learned_alignment(self) -> tuple[int, str] | None:
        """The block count the engines' checkpoints land on and its source, when learned."""
        return self._learned_alignment

    @property
    def learned_lookahead(self) -> tuple[int, str] | None:
        """The tokens after each block the engines' hashes cover, and its source, when
        learned."""
        return self._learned_lookahead

    @property
    def lookahead_tokens(self) -> int:
        """The tokens after each block the engines' hashes cover (0: none known)."""
        return self._learned_lookahead[0] if self._learned_lookahead is not None else 0

    @property
    def drops_eagle_block(self) -> bool:
        """Whether the engines give back the last engine block of every hit: configured
        ``eagle``, unless their events show lookahead hashes (vLLM >= 0.33 hashes each
        block with the tokens its drafter reads after it instead of dropping the block;
        ``--speculative-config`` ``disable_lookahead_block_hashes`` or a KV connector without
        lookahead support keep the drop)."""
        return self.settings.eagle and self._learned_lookahead is None

    def learn(
        self,
        *,
        hybrid: str | None = None,
        interval: tuple[int, str] | None = None,
        alignment: tuple[int, str] | None = None,
        lookahead: tuple[int, str] | None = None,
    ) -> bool:
        """Facts about the model's engines learned outside the index: ``hybrid`` names the
        source that showed the model is hybrid (learning it is final); ``interval`` is the
        engines' grid with its source (0: they have none); ``alignment`` the block count
        their checkpoints land on; ``lookahead`` the tokens after each block their hashes
        cover (> 0; learning it is final, the largest kept). Returns whether the layout or
        the lookahead changed."""
        if hybrid is not None and self._learned_hybrid is None:
            self._learned_hybrid = hybrid
        if interval is not None:
            self._learned_interval = interval
        if alignment is not None:
            self._learned_alignment = alignment
        changed = False
        if lookahead is not None and lookahead[0] > self.lookahead_tokens:
            self._learned_lookahead = lookahead
            changed = True
        old = self.layout
        self.layout = self._effective()
        return changed or self.layout != old

    def hybrid_for(self, replicas: Sequence[ReplicaKey]) -> bool:
        """Whether to apply the hybrid-state rule (see the class docstring)."""
        if self._learned_hybrid is None and self._state_generation != self.index.state_generation:
            self._state_generation = self.index.state_generation
            self.detect(replicas)
        return self.layout.hybrid

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

    def forget_guessed_hybrid(self) -> bool:
        """Drop a hybrid layout only the model's ``config.json`` suggested (the caller saw
        its engines publish KV and no checkpoint: SGLang publishes no recurrent-state
        events, so the hybrid rule would find no usable prefix anywhere). Returns whether it
        was dropped; a checkpoint published later makes the model hybrid again
        (:meth:`detect`)."""
        if self._learned_hybrid != SOURCE_MODEL_CONFIG:
            return False
        self._learned_hybrid = None
        self._state_generation = -1
        self.layout = self._effective()
        return True

    def detect(self, replicas: Sequence[ReplicaKey]) -> bool:
        """Learn that the model is hybrid if one of ``replicas`` stored a state checkpoint
        (whatever the index's generation: for a periodic check over all the model's
        replicas). Returns whether the model is known to be hybrid."""
        if self._learned_hybrid is None and any(map(self.index.publishes_state, replicas)):
            self.learn(hybrid=SOURCE_ENGINE)
        return self._learned_hybrid is not None

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
        """Record that ``request`` was sent per ``decision`` (load, speculative entries for
        ``speculative_ttl_s``, by default the settings'); ``class_weight`` scales its decode
        weight (LoadTracker.dispatch). ``exact``: the prompt was hashed as the engines hash
        it (approximate prompts live on speculative entries alone, sessions included).
        Returns what was guessed, for :meth:`withdraw`."""
        self.load.dispatch(
            request.request_id,
            decision.replica,
            request.prompt_tokens,
            decision.usable_tokens,
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
            if exact and reused:  # (first: it gives an unknown replica its slot, its epoch)
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
        its speculative entries (those no later dispatch named again) and its session's
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
