"""The state layout and hash lookahead of a model's engines as
:class:`~router.core.routing.RoutingEngine` knows them (:class:`LearnedLayout`): from the
model's settings where they say, else learned from the index and the edge."""

from __future__ import annotations

from collections.abc import Sequence

from router.core.index import PrefixIndex
from router.core.routing_settings import RoutingSettings
from router.core.state_layout import (
    SOURCE_ENGINE,
    SOURCE_MODEL_CONFIG,
    StateLayout,
    effective_layout,
)
from router.core.types import ReplicaKey


class LearnedLayout:
    """The base of :class:`~router.core.routing.RoutingEngine` holding what it knows of the
    model's engines.

    The state layout (``layout``): the settings' ``hybrid`` / ``state_interval_blocks`` when
    set, else what was learned: the model is hybrid once one of the replicas it routes to has
    stored a state checkpoint in the index (checked when the index's ``state_generation``
    moves, so not per request), or once the edge says so (``learn``: publishers' registrations,
    the model's config); the grid comes from the edge (``learn``, fed by
    ``state_layout.CheckpointGrid``)."""

    def __init__(self, index: PrefixIndex, settings: RoutingSettings) -> None:
        self.index = index
        self._learned_hybrid: str | None = None  # the source that showed it is hybrid
        self._learned_interval: tuple[int, str] | None = None
        self._learned_alignment: tuple[int, str] | None = None
        self._learned_lookahead: tuple[int, str] | None = None
        self._state_generation = -1
        self.settings = settings  # fixed for the engine's life (``layout`` derives from it)
        self.layout = self._effective()

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
