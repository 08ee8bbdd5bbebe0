"""Per-replica load as one router sees it, and the cost model that turns load into time.

The router counts what it sent (requests, prompt tokens still to prefill, sequences
decoding) and blends in what engines report (running, waiting, KV usage) with the age of
that report, because other routers send traffic too. Everything is driven by explicit
calls with ``now``; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from router.core.keycache import PerTuple
from router.core.types import ReplicaKey
from router.core.xp import SCALAR, Ops


def require_nonnegative(*values: tuple[str, float]) -> None:
    """Raise ValueError naming the first ``(name, value)`` that is not a finite number >= 0:
    a cost parameter every score is made of (NaN compares false with everything, a negative
    one turns a cost into a reward)."""
    for name, value in values:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")


@dataclass(slots=True, frozen=True)
class CostModel:
    """Engine timing model used for TTFT prediction (and by the simulator's engine).

    A step of continuous batching takes ``step_overhead_s`` plus
    ``prefill_s_per_token`` for each new prompt token, plus ``prefill_s_per_token_ctx`` for
    each (new token, attended context token) pair, plus ``decode_s_per_seq`` for each
    sequence decoding one token, plus ``decode_s_per_ctx_token`` per context token those
    sequences attend to. ``chunk_tokens`` is the chunked-prefill token budget per step.
    """

    step_overhead_s: float = 0.004
    prefill_s_per_token: float = 2.5e-5
    prefill_s_per_token_ctx: float = 1.0e-10
    decode_s_per_seq: float = 1.0e-4
    decode_s_per_ctx_token: float = 2.0e-9
    chunk_tokens: int = 8192

    def __post_init__(self) -> None:
        require_nonnegative(
            ("step_overhead_s", self.step_overhead_s),
            ("prefill_s_per_token", self.prefill_s_per_token),
            ("prefill_s_per_token_ctx", self.prefill_s_per_token_ctx),
            ("decode_s_per_seq", self.decode_s_per_seq),
            ("decode_s_per_ctx_token", self.decode_s_per_ctx_token),
        )
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, not {self.chunk_tokens!r}")

    # Each formula is written once and evaluated on numbers or on numpy arrays (one value per
    # replica, for large fleets): ``xp`` supplies the few operations that differ
    # (router/core/xp.py). Same operations in the same order, so both give the same floats.

    def prefill_s(self, new_tokens: Any, cached_tokens: Any = 0, xp: Ops = SCALAR) -> Any:
        """Compute time of prefilling ``new_tokens`` after ``cached_tokens`` of context (0 for
        ``new_tokens <= 0``)."""
        new = xp.maximum(new_tokens, 0)
        attended = new * (cached_tokens + new / 2)
        return new * self.prefill_s_per_token + attended * self.prefill_s_per_token_ctx

    def steps_for(self, prefill_tokens: Any, xp: Ops = SCALAR) -> Any:
        return xp.maximum(1, -(-prefill_tokens // self.chunk_tokens))

    def decode_step_s(self, sequences: Any, context_tokens: Any) -> Any:
        """Time the decode part of one step adds for ``sequences`` decoding sequences."""
        return sequences * self.decode_s_per_seq + context_tokens * self.decode_s_per_ctx_token


@dataclass(slots=True, frozen=True)
class EngineReport:
    """Figures an engine publishes about itself (vLLM /metrics or the publisher)."""

    running: int
    waiting: int
    kv_usage: float
    at: float


_NEVER = float("inf")


class LoadView(NamedTuple):
    """One replica's load at ``now``, as policies see it.

    A NamedTuple rather than a frozen dataclass: immutable all the same, and cheaper to
    build (one per candidate per request)."""

    in_flight: int = 0
    prefilling: int = 0
    queued_prefill_tokens: int = 0
    decoding: int = 0
    decode_context_tokens: int = 0
    in_flight_prompt_tokens: int = 0
    engine: EngineReport | None = None
    engine_age_s: float = float("inf")
    healthy: bool = True
    draining: bool = False
    decode_weight: float = 0.0
    # phantom requests (LoadTracker.set_penalty) among ``prefilling``: no engine queues them
    phantom: int = 0

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage if self.engine is not None else 0.0

    def waiting(self, max_age_s: float) -> int:
        """Queue length: the engine's own count when fresh, else requests awaiting first token."""
        if self.engine is not None and self.engine_age_s <= max_age_s:
            return max(self.engine.waiting, 0)
        return self.prefilling


class PeerLoad(NamedTuple):
    """Requests other routers (the service's other worker processes) have in flight on one
    replica: what they report of their own accounting (:meth:`LoadTracker.own`)."""

    prefilling: int = 0
    queued_prefill_tokens: int = 0
    decoding: int = 0
    decode_context_tokens: int = 0
    in_flight_prompt_tokens: int = 0
    decode_weight: float = 0.0


NO_PEER_LOAD = PeerLoad()


def summed_load(loads: Iterable[PeerLoad]) -> PeerLoad:
    """The field-wise sum of ``loads`` (several routers' reports on one replica)."""
    return PeerLoad(*(sum(column) for column in zip(*loads, strict=True)))


MAX_COUNT = 1 << 53
"""The largest request count an engine report is taken to have (:meth:`LoadTracker.engine_report`):
beyond any engine's, and exact as a float (the mirror table's type)."""


EXPECTED_OUTPUT_TOKENS = 256
"""Output length assumed for a request that does not say how long its answer may be."""


def decode_weight(max_output_tokens: int | None) -> float:
    """How much one sequence's TPOT grows per second of stall while it decodes:
    ``1 / (output tokens - 1)`` (its TPOT is spread over that many intervals)."""
    out = EXPECTED_OUTPUT_TOKENS if max_output_tokens is None else max_output_tokens
    return 1.0 / max(out - 1, 1)


@dataclass(slots=True)
class _Flight:
    replica: ReplicaKey
    prompt_tokens: int
    prefill_tokens: int
    weight: float
    decoding: bool = False
    sequences: int = 1  # sequences it decodes (its prompts x ``n``)
    context_tokens: int = 0  # what they attend to: ``prompt_tokens`` x ``n``


@dataclass(slots=True)
class _Replica:
    prefilling: int = 0
    queued_prefill_tokens: int = 0
    decoding: int = 0
    decode_context_tokens: int = 0
    in_flight_prompt_tokens: int = 0
    decode_weight: float = 0.0
    engine: EngineReport | None = None
    healthy: bool = True
    draining: bool = False
    row: int = -1  # column of the mirror table (LoadColumns), -1: not mirrored
    peer: PeerLoad = NO_PEER_LOAD  # included in the counts above (set_peer_load)
    penalty: tuple[int, int] = (0, 0)  # phantom requests and their tokens (set_penalty)


def _real_requests(rep: _Replica) -> int:
    """Requests in flight on ``rep`` (its own and its peers'), phantoms left out: the ones
    that carry decode weight."""
    return rep.prefilling - rep.penalty[0] + rep.decoding


def _settled(rep: _Replica, weight: float) -> float:
    """``rep``'s decode weight after an update to ``weight``: a float sum, from which
    removing what was added may leave a rounding residue, so it is 0 while no request is in
    flight there (a residue would make the replica lose every exact tie with idle ones,
    which the cache-size tie-break and the rng are for) and never negative."""
    return max(weight, 0.0) if _real_requests(rep) > 0 else 0.0


class LoadColumns(NamedTuple):
    """The load of several replicas as arrays (one element per replica, in the order asked
    for): what ``LoadView`` holds, for scoring a large fleet with array operations.

    ``engine_at`` is ``-inf`` where there is no engine report (then ``waiting`` and
    ``kv_usage`` are 0); ``healthy`` and ``draining`` are 0/1."""

    queued_prefill_tokens: np.ndarray
    prefilling: np.ndarray
    decoding: np.ndarray
    decode_context_tokens: np.ndarray
    in_flight_prompt_tokens: np.ndarray
    waiting: np.ndarray
    kv_usage: np.ndarray
    engine_at: np.ndarray
    healthy: np.ndarray
    draining: np.ndarray
    decode_weight: np.ndarray
    phantom: np.ndarray

    @property
    def in_flight(self) -> np.ndarray:
        total: np.ndarray = self.prefilling + self.decoding
        return total


# the mirror table (LoadTracker.columns) holds one row per LoadColumns field, in that order,
# and one column per mirrored replica
_ROWS = len(LoadColumns._fields)


class LoadTracker:
    """In-flight accounting per replica. Unknown request ids are ignored (idempotent).

    Replicas named by :meth:`columns` are also mirrored into a table of numbers (one column
    each), kept current on every change, so a large fleet's load can be read as arrays in a
    few operations instead of one ``view`` per replica.

    Several routers in front of one fleet (the service's worker processes) each see only the
    requests they sent; :meth:`set_peer_load` adds what the others report (:meth:`own`)."""

    def __init__(self) -> None:
        self._replicas: dict[ReplicaKey, _Replica] = {}
        self._flights: dict[str, _Flight] = {}
        # requests still out on a replica that left (its accounting went with it): their ids
        # stay taken until they end (:meth:`tracks`), as those of the requests in flight do
        self._left: set[str] = set()
        self._table = np.zeros((_ROWS, 0))
        self._free_rows: list[int] = []
        self._row_of: dict[ReplicaKey, int] = {}  # the mirrored replicas' rows
        self._rows_cache: PerTuple[np.ndarray] = PerTuple()
        self._row_generation = 0  # bumped when a mirrored replica leaves (rows are reused)
        # bumped by every change of this tracker's own requests (dispatch, first token,
        # completion): lets an exchange tell cheaply whether :meth:`own` may have changed
        self.own_changes = 0

    def _get(self, key: ReplicaKey) -> _Replica:
        rep = self._replicas.get(key)
        if rep is None:
            rep = self._replicas[key] = _Replica()
        return rep

    def add_replica(self, key: ReplicaKey) -> None:
        self._get(key)

    def remove_replica(self, key: ReplicaKey) -> None:
        """``key`` left: its counts and its requests' accounting go (a replica registered
        again under its name starts at zero); the ids of its requests still out stay taken
        until they complete (:meth:`tracks`)."""
        rep = self._replicas.pop(key, None)
        self.own_changes += 1
        if rep is not None and rep.row >= 0:
            self._table[:, rep.row] = 0.0
            self._free_rows.append(rep.row)
            del self._row_of[key]
            self._row_generation += 1
        for rid in [r for r, f in self._flights.items() if f.replica == key]:
            del self._flights[rid]
            self._left.add(rid)

    def dispatch(
        self,
        request_id: str,
        key: ReplicaKey,
        prompt_tokens: int,
        cached_tokens: int,
        max_output_tokens: int | None = None,
        class_weight: float = 1.0,
        samples: int = 1,
        prompts: int = 1,
    ) -> None:
        """A request was sent to ``key``; ``cached_tokens`` of its prompt are predicted hits;
        ``max_output_tokens`` (None: unknown) weighs it while it decodes (:func:`decode_weight`),
        times ``class_weight`` (its service class's, router/core/admission.py). It decodes
        ``samples`` (its ``n``) sequences for each of its ``prompts`` (a batch of completion
        prompts, ``prompt_tokens`` their sum), each weighed and counted in the replica's
        decode batch; its prompt is prefilled once."""
        if request_id in self._flights:
            self.complete(request_id)
        self._left.discard(request_id)
        prefill = max(prompt_tokens - cached_tokens, 1)
        sequences = max(samples, 1) * max(prompts, 1)
        weight = decode_weight(max_output_tokens) * class_weight * sequences
        context = prompt_tokens * max(samples, 1)
        self._flights[request_id] = _Flight(
            key, prompt_tokens, prefill, weight, sequences=sequences, context_tokens=context
        )
        rep = self._get(key)
        rep.prefilling += 1
        rep.queued_prefill_tokens += prefill
        rep.in_flight_prompt_tokens += prompt_tokens
        rep.decode_weight += weight
        self.own_changes += 1
        if rep.row >= 0:
            self._mirror(rep)

    def first_token(self, request_id: str) -> None:
        """Prefill done: the request's tokens leave the prefill queue and it starts decoding."""
        flight = self._flights.get(request_id)
        if flight is None or flight.decoding:
            return
        rep = self._replicas.get(flight.replica)
        flight.decoding = True
        self.own_changes += 1
        if rep is None:
            return
        rep.prefilling -= 1
        rep.queued_prefill_tokens -= flight.prefill_tokens
        rep.decoding += flight.sequences
        rep.decode_context_tokens += flight.context_tokens
        if rep.row >= 0:
            self._mirror(rep)

    def complete(self, request_id: str) -> None:
        """The request finished, failed or was cancelled."""
        self._left.discard(request_id)
        flight = self._flights.pop(request_id, None)
        if flight is None:
            return
        self.own_changes += 1
        rep = self._replicas.get(flight.replica)
        if rep is None:
            return
        rep.in_flight_prompt_tokens -= flight.prompt_tokens
        if flight.decoding:
            rep.decoding -= flight.sequences
            rep.decode_context_tokens -= flight.context_tokens
        else:
            rep.prefilling -= 1
            rep.queued_prefill_tokens -= flight.prefill_tokens
        rep.decode_weight = _settled(rep, rep.decode_weight - flight.weight)
        if rep.row >= 0:
            self._mirror(rep)

    def own(self, key: ReplicaKey) -> PeerLoad:
        """This tracker's own requests on ``key`` (its counts without the peer load): what
        it reports to its peers."""
        rep = self._replicas.get(key)
        if rep is None:
            return NO_PEER_LOAD
        p = rep.peer
        phantom, phantom_tokens = rep.penalty
        prefilling = rep.prefilling - p.prefilling - phantom
        decoding = rep.decoding - p.decoding
        # the difference of two float sums: a rounding residue where it has none in flight
        weight = max(rep.decode_weight - p.decode_weight, 0.0) if prefilling + decoding else 0.0
        return PeerLoad(
            prefilling,
            rep.queued_prefill_tokens - p.queued_prefill_tokens - phantom_tokens,
            decoding,
            rep.decode_context_tokens - p.decode_context_tokens,
            rep.in_flight_prompt_tokens - p.in_flight_prompt_tokens,
            weight,
        )

    def set_peer_load(self, key: ReplicaKey, load: PeerLoad) -> None:
        """Replace what other routers have in flight on ``key`` (their latest report,
        summed; ignored for a replica this tracker does not know, which a peer may still
        report for a moment after it left). It is added into the counts ``view`` and
        ``columns`` give, so a policy weighs the whole fleet's requests, not only its own,
        at no cost per request; the engine-report formula (``waiting`` beyond
        ``prefilling``) then counts only requests no peer reported either."""
        rep = self._replicas.get(key)
        if rep is None:  # not (or no longer) ours to route to: a peer may lag behind
            return
        # reports come from other processes: never let one go negative, and a report of no
        # request in flight carries no decode weight (``own`` sends none then; counted, it
        # would be settled away here and taken off again by the peer's next report)
        if min(load) < 0 or (load.decode_weight and load.prefilling + load.decoding <= 0):
            prefilling, decoding = max(load.prefilling, 0), max(load.decoding, 0)
            load = PeerLoad(
                prefilling,
                max(load.queued_prefill_tokens, 0),
                decoding,
                max(load.decode_context_tokens, 0),
                max(load.in_flight_prompt_tokens, 0),
                max(load.decode_weight, 0.0) if prefilling + decoding else 0.0,
            )
        old = rep.peer
        if load == old:
            return
        rep.prefilling += load.prefilling - old.prefilling
        rep.queued_prefill_tokens += load.queued_prefill_tokens - old.queued_prefill_tokens
        rep.decoding += load.decoding - old.decoding
        rep.decode_context_tokens += load.decode_context_tokens - old.decode_context_tokens
        rep.in_flight_prompt_tokens += load.in_flight_prompt_tokens - old.in_flight_prompt_tokens
        rep.decode_weight = _settled(
            rep, rep.decode_weight + load.decode_weight - old.decode_weight
        )
        rep.peer = load
        if rep.row >= 0:
            self._mirror(rep)

    def set_penalty(self, key: ReplicaKey, requests: int, tokens: int) -> None:
        """Count ``requests`` phantom requests (``tokens`` prompt tokens in all) as
        prefilling on ``key``, replacing its previous penalty: what a replica that failed
        recently costs beyond its real load (router/core/outliers.py), so that one failing
        fast never looks idle. Not part of :meth:`own` (peers are not told)."""
        rep = self._replicas.get(key)
        if rep is None:
            return
        new = (max(requests, 0), max(tokens, 0))
        old = rep.penalty
        if new == old:
            return
        rep.prefilling += new[0] - old[0]
        rep.queued_prefill_tokens += new[1] - old[1]
        rep.penalty = new
        if rep.row >= 0:
            self._mirror(rep)

    def replica_of(self, request_id: str) -> ReplicaKey | None:
        flight = self._flights.get(request_id)
        return flight.replica if flight is not None else None

    def tracks(self, request_id: str) -> bool:
        """Whether ``request_id`` is a request not completed yet: in flight, or out on a
        replica that left since (:meth:`remove_replica` dropped its accounting, not the
        request). A new request must not take its id: its end would complete the other."""
        return request_id in self._flights or request_id in self._left

    def engine_report(self, key: ReplicaKey, report: EngineReport) -> None:
        """Take an engine's own figures. A KV usage outside [0, 1] is clamped, and NaN is
        taken as 0: reports come from other processes, and one bad gauge must not poison
        every score (NaN compares false with everything: no replica would ever win). So
        are the counts, to [0, ``MAX_COUNT``]: a negative one is no count, and one past
        float range made every score's float arithmetic raise OverflowError."""
        usage = report.kv_usage
        running, waiting = report.running, report.waiting
        if not (0.0 <= usage <= 1.0 and 0 <= running <= MAX_COUNT and 0 <= waiting <= MAX_COUNT):
            if not 0.0 <= usage <= 1.0:
                usage = 0.0 if usage != usage else min(max(usage, 0.0), 1.0)
            running = min(max(running, 0), MAX_COUNT)
            waiting = min(max(waiting, 0), MAX_COUNT)
            report = EngineReport(running, waiting, usage, report.at)
        rep = self._get(key)
        rep.engine = report
        if rep.row >= 0:
            self._mirror(rep)

    def forget_stale_reports(self, now: float, max_age_s: float) -> list[ReplicaKey]:
        """Drop engine reports older than ``max_age_s``: a replica whose reports stopped (its
        metrics page unreachable or renamed, its publisher gone) is judged on the router's
        own counts, as one that never reported, not by its last figures for good (a KV
        usage of 0.97 would keep it over ``max_kv_usage``, out of routing, forever).
        Returns the replicas whose report was dropped."""
        dropped = []
        for key, rep in self._replicas.items():
            if rep.engine is not None and now - rep.engine.at > max_age_s:
                rep.engine = None
                dropped.append(key)
                if rep.row >= 0:
                    self._mirror(rep)
        return dropped

    def set_health(self, key: ReplicaKey, healthy: bool) -> None:
        rep = self._get(key)
        rep.healthy = healthy
        if rep.row >= 0:
            self._mirror(rep)

    def set_draining(self, key: ReplicaKey, draining: bool) -> None:
        rep = self._get(key)
        rep.draining = draining
        if rep.row >= 0:
            self._mirror(rep)

    # ------------------------------------------------------------------ columns

    def _mirror(self, rep: _Replica) -> None:
        engine = rep.engine
        self._table[:, rep.row] = (
            rep.queued_prefill_tokens,
            rep.prefilling,
            rep.decoding,
            rep.decode_context_tokens,
            rep.in_flight_prompt_tokens,
            engine.waiting if engine is not None else 0,
            engine.kv_usage if engine is not None else 0.0,
            engine.at if engine is not None else -_NEVER,
            rep.healthy,
            rep.draining,
            rep.decode_weight,
            rep.penalty[0],
        )

    def _rows(self, keys: Sequence[ReplicaKey]) -> np.ndarray:
        """Mirror-table columns of ``keys`` (mirroring replicas not mirrored yet). A tuple's
        answer is remembered while no mirrored replica leaves (router/core/keycache.py)."""
        cached = self._rows_cache.get(keys, self._row_generation)
        if cached is not None:
            return cached
        row_of = self._row_of
        rows = np.fromiter((row_of.get(k, -1) for k in keys), dtype=np.intp, count=len(keys))
        for i in np.flatnonzero(rows < 0).tolist():  # not mirrored yet
            key = keys[i]
            row = row_of.get(key)
            if row is not None:  # the same key earlier in ``keys``
                rows[i] = row
                continue
            rep = self._get(key)
            if not self._free_rows:
                used = self._table.shape[1]
                grown = np.zeros((_ROWS, max(64, 2 * used)))
                grown[:, :used] = self._table
                self._table = grown
                self._free_rows.extend(range(grown.shape[1] - 1, used - 1, -1))
            rep.row = row_of[key] = self._free_rows.pop()
            self._mirror(rep)
            rows[i] = rep.row
        self._rows_cache.put(keys, self._row_generation, rows)
        return rows

    def columns(self, keys: Sequence[ReplicaKey]) -> LoadColumns:
        """The load of ``keys`` as arrays, in order (see :class:`LoadColumns`); the same
        numbers ``view`` gives each of them. Pass the same immutable sequence each time for a
        cached lookup of where they are mirrored."""
        rows = self._rows(keys)  # first: it may grow (replace) the table
        return LoadColumns(*self._table[:, rows])

    def view(self, key: ReplicaKey, now: float) -> LoadView:
        rep = self._replicas.get(key)
        if rep is None:
            return LoadView()
        engine = rep.engine
        # positional: keyword arguments cost twice as much, and this runs per candidate
        return LoadView(
            rep.prefilling + rep.decoding,  # in_flight
            rep.prefilling,
            rep.queued_prefill_tokens,
            rep.decoding,
            rep.decode_context_tokens,
            rep.in_flight_prompt_tokens,
            engine,
            now - engine.at if engine is not None else _NEVER,  # engine_age_s
            rep.healthy,
            rep.draining,
            rep.decode_weight,
            rep.penalty[0],  # phantom
        )

    def replicas(self) -> list[ReplicaKey]:
        return list(self._replicas)

    def in_flight(self) -> int:
        return len(self._flights)
