"""Per-model routing settings (:class:`RoutingSettings`) with their busy thresholds
(:class:`BusyThresholds`) and the default speculative TTL: what the service's configuration
and the simulator give :class:`~router.core.routing.RoutingEngine`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.core.turnover import REUSE_WINDOW_S


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
