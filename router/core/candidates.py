"""What every routing policy sees and returns: candidates (one at a time or as columns), the
policy protocols, and the helpers that turn a ranking into a :class:`Decision`."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from router.core.load import LoadColumns, LoadView
from router.core.types import Decision, PrefixMatch, ReplicaKey, RouteRequest


class Candidate(NamedTuple):
    """One replica a policy may pick (a NamedTuple: immutable, and cheap to build per
    candidate per request)."""

    replica: ReplicaKey
    match: PrefixMatch
    load: LoadView
    cached_blocks: int = 0  # size of the replica's cache in the index (SGLang's "tree size")
    # what a new block placed there evicts beyond the fleet's calmest cache, as a chance of
    # reuse lost (router/core/turnover.py; 0: nothing more)
    eviction_risk: float = 0.0


class CandidateColumns(NamedTuple):
    """Many candidates at once, as arrays (one element per replica of ``keys``, in order): for
    policies that score a large fleet with array operations (``ColumnarPolicy``) instead of
    one ``Candidate`` per replica. ``eligible`` marks the ones that may be picked (healthy,
    not draining, not busy while others are not); the blocks arrays are their
    ``PrefixMatch`` fields; ``cached_blocks`` gives a replica's cache size (tie-breaks);
    ``eviction_risk`` is each replica's (``Candidate.eviction_risk``; None: all 0)."""

    keys: Sequence[ReplicaKey]
    eligible: np.ndarray
    kv_blocks: np.ndarray
    gpu_blocks: np.ndarray
    host_blocks: np.ndarray
    usable_blocks: np.ndarray
    load: LoadColumns
    cached_blocks: Callable[[ReplicaKey], int]
    eviction_risk: np.ndarray | None = None


class Policy(Protocol):
    name: str

    def choose(
        self, request: RouteRequest, candidates: Sequence[Candidate], now: float, rng: random.Random
    ) -> Decision: ...


class ColumnarPolicy(Policy, Protocol):
    """A policy that can also choose among :class:`CandidateColumns`, with the same result as
    ``choose`` on the same candidates (ranking cut to ``MAX_RANKING``)."""

    def choose_columns(
        self, request: RouteRequest, columns: CandidateColumns, now: float, rng: random.Random
    ) -> Decision: ...


def tokens(request: RouteRequest, blocks: int) -> int:
    return min(blocks * request.block_size, request.prompt_tokens)


def decide(
    name: str,
    request: RouteRequest,
    ranked: Sequence[Candidate],
    score: float,
    terms: Mapping[str, float] | None = None,
) -> Decision:
    """The decision for ``ranked[0]``, the others as its ranking. ``terms`` becomes the
    decision's own (callers pass a dict they built for it). Runs once per request: built
    positionally, the ranking from a list."""
    best = ranked[0]
    match = best.match
    return Decision(
        best.replica,
        name,
        tokens(request, match.usable_blocks),
        tokens(request, match.kv_blocks),
        score,
        terms if terms is not None else {},
        tuple([c.replica for c in ranked[1:]]),
    )


def rank(
    candidates: Sequence[Candidate], key: Callable[[Candidate], float], rng: random.Random
) -> list[Candidate]:
    """Ascending by ``key``; exact ties broken by ``rng`` so no replica is favoured by order."""
    salted = [(key(c), rng.random(), i) for i, c in enumerate(candidates)]
    salted.sort()
    return [candidates[i] for _, _, i in salted]
