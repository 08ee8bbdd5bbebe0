"""Where a hybrid model's engines keep recurrent-state checkpoints, learned from what they
publish rather than configured.

A hybrid engine (KDA / mamba layers) can reuse a cached prefix only up to a block boundary
where it holds a state snapshot (docs/architecture.md, "The hybrid rule"). Engines take snapshots
on a grid (every N tokens: SGLang ``--mamba-track-interval``, vLLM ``mamba_cache_mode``) and
at the end of a prompt. The router needs two facts about a model:

* whether it is hybrid at all: yes as soon as one of its engines publishes a recurrent-state
  group (``kv_cache_spec_kind`` ``mamba``, ...), which the index records
  (``PrefixIndex.publishes_state``);
* the grid, for the checkpoints it *speculates* a replica will hold after serving a request
  (event-lag cover, approximate mode): :class:`CheckpointGrid` estimates it from the positions
  of published checkpoints;
* the alignment: the engine block every checkpoint lands on (vLLM keeps a prompt's last
  checkpoint at ``(N - 1) // a * a`` tokens, ``a`` its hit alignment, often 1,024 tokens for a
  hybrid model against a router block of 64), so that the prompt-end checkpoint the router
  speculates is one the engine will hold (router/core/engine_hits.py).
  :class:`CheckpointGrid` learns it too (the largest block count dividing every published
  position); ``[models.NAME] engine_block_size`` sets it.

Configured values (``[models.NAME] hybrid`` / ``state_interval_blocks`` /
``engine_block_size``) override what is
learned; :func:`layout_mismatches` says where the two disagree (the service logs and exports
it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Sources of a layout fact, as exported (``kvrouter_model_hybrid{source=...}``).
SOURCE_CONFIG = "config"
SOURCE_ENGINE = "engine"  # the engines' events (state groups, checkpoint positions)
SOURCE_REGISTRY = "registry"  # what publishers registered (Redis mode)
SOURCE_MODEL_CONFIG = "model_config"  # the model's config.json (hybrid layer types)
SOURCE_NONE = "none"

# A model whose replicas hold this many KV blocks and never published a state checkpoint is
# taken to be not hybrid (a hybrid engine publishes a checkpoint with its first prompt).
KV_ONLY_EVIDENCE_BLOCKS = 256


@dataclass(slots=True, frozen=True)
class StateLayout:
    """The checkpoint layout the router routes on. ``interval_blocks``: the grid in router
    blocks; 0 when no regular grid is known (only the prompt end is speculated).
    ``alignment_blocks``: the engine block in router blocks (>= 1): engines cache KV blocks and
    checkpoints only at its multiples, so speculation stops at one of them."""

    hybrid: bool
    interval_blocks: int
    hybrid_source: str = SOURCE_NONE
    interval_source: str = SOURCE_NONE
    alignment_blocks: int = 1
    alignment_source: str = SOURCE_NONE


class CheckpointGrid:
    """Estimates an engine's checkpoint grid from the positions (in router blocks, >= 1) of
    the checkpoints it publishes.

    Grid checkpoints sit at multiples of the interval N; prompt-end checkpoints anywhere. For
    each candidate d the estimator counts positions that are multiples of d and subtracts the
    count chance alone gives (n / d): the excess is about G (1 - 1/d) for every divisor d of N
    (G = grid checkpoints seen), about G / k for d = k N, and noise elsewhere. The grid is the
    d whose excess is the most standard deviations of chance above it (``_estimate``), if that
    is significant; without one (prompt ends only, or a snapshot at every block) the
    interval is 0, and the router speculates prompt-end checkpoints only: an unknown grid
    under-predicts a hybrid hit, a wrong one over-predicts it.

    Each observation costs O(sqrt(position)) (its divisors); counts are halved every
    ``window`` observations so an engine that changes its grid is followed. Known limit:
    prompt lengths that are themselves aligned (every prompt a multiple of 8 blocks) look like
    a grid; configure ``state_interval_blocks`` to override.

    The alignment (``alignment``): the largest d dividing every position (their gcd), the
    engine block every checkpoint lands on (vLLM's hybrid engines: 1,024 tokens or so).
    The grid is sought among its multiples, chance taken relative to it, so checkpoints that
    merely land on engine blocks are no grid. Known limit: an engine snapshotting on a grid
    and nowhere else (no prompt ends) reads as an alignment without a grid: only the last
    grid point of a prompt is speculated (under-prediction).
    """

    MIN_EXCESS = 8.0
    Z = 4.0
    REESTIMATE = 64

    def __init__(
        self,
        block_size: int,
        *,
        min_observations: int = 32,
        window: int = 4096,
        max_interval: int = 1 << 20,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.checkpoints = 0  # every checkpoint seen, on the router's block grid or not
        self.unaligned = 0  # those ending off a router block boundary (never usable)
        self.min_observations = min_observations
        self.window = window
        self.max_interval = max_interval
        self._counts: dict[int, float] = {}
        self._n = 0.0
        self.observed = 0  # total observations (not decayed)
        self._cached: int | None = None
        self._alignment = 1
        self._dirty = False
        self._estimated_at = 0

    def observe_end(self, end: int) -> None:
        """One published checkpoint ending ``end`` tokens into its sequence."""
        self.checkpoints += 1
        if end % self.block_size:
            self.unaligned += 1
        else:
            self.observe(end // self.block_size)

    def observe(self, position: int) -> None:
        """One published checkpoint at ``position`` router blocks (ignored if < 1)."""
        if position < 1:
            return
        counts = self._counts
        limit = self.max_interval
        root = math.isqrt(position)
        for d in range(1, root + 1):
            if position % d == 0:
                if d <= limit:
                    counts[d] = counts.get(d, 0.0) + 1.0
                e = position // d
                if e != d and e <= limit:
                    counts[e] = counts.get(e, 0.0) + 1.0
        self._n += 1.0
        self.observed += 1
        self._dirty = True
        if self._n >= 2 * self.window:
            self._n /= 2
            self._counts = {d: c / 2 for d, c in counts.items() if c >= 1.0}

    def interval(self) -> int | None:
        """The grid in router blocks; 0 when there is none; None until enough checkpoints
        were seen to tell. Re-estimated at most every ``REESTIMATE`` observations once
        ``2 * min_observations`` were seen (an estimate walks every divisor counted)."""
        seen = self.observed
        if seen < self.min_observations:
            return None
        if self._dirty and (
            seen < 2 * self.min_observations or seen - self._estimated_at >= self.REESTIMATE
        ):
            self._alignment = self._estimate_alignment()
            self._cached = self._estimate(self._alignment)
            self._estimated_at = seen
            self._dirty = False
        return self._cached

    def alignment(self) -> int | None:
        """The largest block count dividing every position seen (in the decay window; 1:
        none larger); None until enough checkpoints were seen to tell (as ``interval``)."""
        if self.interval() is None:
            return None
        return self._alignment

    def _estimate_alignment(self) -> int:
        need = self._n * (1.0 - 1e-9)  # every one (counts and n decay alike)
        return max((d for d, c in self._counts.items() if c >= need), default=1)

    def _estimate(self, alignment: int = 1) -> int:
        """The grid (0: none) among positions that are all multiples of ``alignment``: a
        candidate is a multiple ``d = m * alignment`` (m > 1), by chance holding n / m of
        them. Checkpoints on every engine block are no grid (as on every router block)."""
        n = self._n
        # Each candidate d is scored by how far its count of multiples lies above chance,
        # in standard deviations of that count: z(d) = excess / sqrt(n / d (1 - 1/d)). With G
        # grid checkpoints at multiples of N, a divisor d of N has excess ~ G (1 - 1/d), so z
        # grows with d up to N; a multiple k N has excess ~ G / k, so z falls (as 1 / sqrt(k))
        # beyond it: the grid is where z peaks. (Raw excesses are nearly equal for every
        # divisor of N, so comparing them lets noise on a small divisor win while few grid
        # checkpoints have been seen, and such a grid is wrong.) Candidates need half of
        # ``MIN_EXCESS`` (one stray position is no grid), the winner all of it.
        best_d, best_z, best_e = 0, 0.0, 0.0
        floor = self.MIN_EXCESS / 2
        for d, c in self._counts.items():
            if d <= alignment or d % alignment:
                continue
            m = d // alignment
            e = c - n / m
            if e < floor:
                continue
            zd = e / math.sqrt(n / m * (1.0 - 1.0 / m))
            if zd > best_z or (zd == best_z and d > best_d):
                best_d, best_z, best_e = d, zd, e
        # significant: several grid checkpoints beyond chance, far outside its spread
        if best_d == 0 or best_e < self.MIN_EXCESS or best_e < 0.05 * n or best_z < self.Z:
            return 0
        return best_d


def effective_layout(
    configured_hybrid: bool | None,
    configured_interval: int,
    learned_hybrid: str | None,
    learned_interval: tuple[int, str] | None,
    configured_alignment: int = 0,
    learned_alignment: tuple[int, str] | None = None,
) -> StateLayout:
    """The layout to route on: configuration first, then what was learned.

    ``learned_hybrid``: the source that showed the model is hybrid (None: nothing did);
    ``learned_interval``: (grid, source) when one is known; the alignment likewise (0 / None:
    not known; a learned one is read from checkpoints, so it holds for hybrid models only)."""
    if configured_hybrid is not None:
        hybrid, hybrid_source = configured_hybrid, SOURCE_CONFIG
    elif learned_hybrid is not None:
        hybrid, hybrid_source = True, learned_hybrid
    else:
        hybrid, hybrid_source = False, SOURCE_NONE
    if configured_interval > 0:
        interval, interval_source = configured_interval, SOURCE_CONFIG
    elif learned_interval is not None:
        interval, interval_source = learned_interval
    else:
        interval, interval_source = 0, SOURCE_NONE
    if configured_alignment > 0:
        alignment, alignment_source = configured_alignment, SOURCE_CONFIG
    elif learned_alignment is not None and hybrid:
        alignment, alignment_source = learned_alignment
    else:
        alignment, alignment_source = 1, SOURCE_NONE
    if not hybrid:
        interval, interval_source = 0, SOURCE_NONE
    return StateLayout(
        hybrid, interval, hybrid_source, interval_source, max(1, alignment), alignment_source
    )


def layout_mismatches(
    configured_hybrid: bool | None,
    configured_interval: int,
    publishes_state: bool,
    kv_only_blocks: int,
    learned_interval: int | None,
    configured_alignment: int = 0,
    learned_alignment: int | None = None,
) -> dict[str, str]:
    """Where the configuration contradicts what the engines publish: field -> explanation.

    ``publishes_state``: some engine of the model published a state checkpoint;
    ``kv_only_blocks``: KV blocks its replicas hold while none ever did (evidence that it is
    not hybrid once it reaches ``KV_ONLY_EVIDENCE_BLOCKS``); ``learned_interval``: the grid
    estimated from the engines' checkpoints (None or 0: none known); the alignments (router
    blocks; 0 / None: not configured / not known)."""
    out: dict[str, str] = {}
    if configured_hybrid is False and publishes_state:
        out["hybrid"] = (
            "configured hybrid = false, but the engines publish recurrent-state checkpoints: "
            "the router predicts KV hits the engines cannot reuse"
        )
    elif (
        configured_hybrid is True
        and not publishes_state
        and kv_only_blocks >= KV_ONLY_EVIDENCE_BLOCKS
    ):
        out["hybrid"] = (
            f"configured hybrid = true, but the engines published {kv_only_blocks} KV blocks "
            "and no recurrent-state checkpoint: the router predicts no usable hit"
        )
    if configured_interval > 0 and learned_interval and learned_interval != configured_interval:
        out["state_interval_blocks"] = (
            f"configured state_interval_blocks = {configured_interval}, but the engines "
            f"checkpoint every {learned_interval} blocks: speculative checkpoints land where "
            "the engines have none"
        )
    if configured_alignment > 1 and learned_alignment and learned_alignment % configured_alignment:
        out["engine_block_size"] = (
            f"configured engine_block_size spans {configured_alignment} router blocks, but the "
            f"engines' checkpoints land on multiples of {learned_alignment}: speculative "
            "checkpoints land where the engines have none"
        )
    return out
