"""What the router knows about each model's recurrent-state layout, and where it learned it
(the service's side of ``router.core.state_layout``).

Sources, strongest first after the configuration (``[models.NAME] hybrid`` /
``state_interval_blocks``, which override):

* the engines' events: a replica that stores a state checkpoint in the index makes its model
  hybrid (``RoutingEngine.hybrid_for``); in direct mode (ZMQ) every checkpoint's position
  feeds the model's ``CheckpointGrid`` (``observer``);
* publishers' registrations (Redis mode): ``ReplicaInfo.publishes_state`` and the grid the
  publisher learned (``registered`` / ``unregistered``);
* the model's ``config.json`` beside its tokenizer (``hybrid_marker``): hybrid layer types
  make the model hybrid before its engines said anything. Only a guess: engines whose
  stores name no group kind (SGLang) publish no recurrent-state events, so once their
  replicas hold ``KV_ONLY_EVIDENCE_BLOCKS`` KV blocks and none published a checkpoint, the
  hybrid rule would find no usable prefix anywhere: ``check()`` drops the guess (logged) and
  the model is routed on its KV prefix. Engines that name group kinds (vLLM) keep it: a
  hybrid one has prompts too short for a checkpoint before it publishes its first.

The engines' lookahead hashes (vLLM's ``lookahead_token_ids``: EAGLE / MTP engines that give
back no block of a hit, whatever ``[models.NAME] eagle`` says) come from the same two
sources: the engines' events in direct mode (``facts_observer``), publishers'
``ReplicaInfo.lookahead_tokens`` in Redis mode; so does whether their stores name group
kinds (``names_groups``).

``check()`` (the service's housekeeping, every second) compares configuration and evidence
with ``layout_mismatches``, logs each mismatch when it appears and when it clears, and keeps
the per-model :class:`LayoutReport` the metrics export.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.core.index import PrefixIndex
from router.core.routing import RoutingEngine
from router.core.state_layout import (
    KV_ONLY_EVIDENCE_BLOCKS,
    SOURCE_ENGINE,
    SOURCE_MODEL_CONFIG,
    SOURCE_NONE,
    SOURCE_REGISTRY,
    CheckpointGrid,
    layout_mismatches,
)
from router.core.types import ReplicaKey
from router.events.ingest import EngineFacts
from router.store.base import ReplicaInfo

_log = logging.getLogger(__name__)

# config.json keys whose values name layer kinds, and the kinds that keep recurrent state
_LAYER_KEYS = ("layer_types", "layers_block_type", "hybrid_override_pattern")
_RECURRENT = ("linear", "mamba", "kda", "gdn", "delta", "recurrent", "ssm", "rwkv")
_RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "rwkv7"})


def hybrid_marker(config: Mapping[str, Any]) -> str | None:
    """What in a model's ``config.json`` says it keeps recurrent state (None: nothing):
    ``layer_types`` / ``layers_block_type`` naming linear-attention or mamba layers,
    Nemotron-H's ``hybrid_override_pattern`` with ``M`` layers, Kimi Linear's
    ``linear_attn_config``, or a pure state-space ``model_type``; a multimodal model's
    ``text_config`` is looked into."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        found = hybrid_marker(nested)
        if found is not None:
            return f"text_config.{found}"
    linear = config.get("linear_attn_config")
    if isinstance(linear, Mapping) and linear:
        return "linear_attn_config"
    for key in _LAYER_KEYS:
        value = config.get(key)
        if key == "hybrid_override_pattern":
            if isinstance(value, str) and "M" in value:
                return key
            continue
        if isinstance(value, list) and any(
            isinstance(v, str) and any(word in v.lower() for word in _RECURRENT) for v in value
        ):
            return key
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type.lower() in _RECURRENT_MODEL_TYPES:
        return "model_type"
    return None


def read_hybrid_marker(directory: Path) -> str | None:
    """``hybrid_marker`` of ``directory/config.json``; None when it is absent or unreadable
    (the tokenizer loader reports problems with the directory itself)."""
    try:
        data = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return hybrid_marker(data) if isinstance(data, dict) else None


@dataclass(slots=True, frozen=True)
class LayoutReport:
    """One model's layout as routed on, and where configuration and engines disagree."""

    model: str
    hybrid: bool
    hybrid_source: str
    interval_blocks: int
    interval_source: str
    mismatches: Mapping[str, str] = field(default_factory=dict)
    alignment_blocks: int = 1
    alignment_source: str = SOURCE_NONE
    lookahead_tokens: int = 0
    lookahead_source: str = SOURCE_NONE
    drops_eagle_block: bool = False


MISMATCH_FIELDS = ("hybrid", "state_interval_blocks", "block_size", "engine_block_size")


class ModelLayouts:
    """Per-model layout learning for the router (see the module docstring)."""

    def __init__(
        self,
        engines: Mapping[str, RoutingEngine],
        index: PrefixIndex,
        keys_for: Callable[[str], Sequence[ReplicaKey]],
    ) -> None:
        self.engines = engines
        self.index = index
        self.keys_for = keys_for
        self.grids: dict[str, CheckpointGrid] = {}
        self._registered: dict[str, dict[str, ReplicaInfo]] = {}  # model -> replica -> info
        self._model_of: dict[str, str] = {}  # replica -> model
        self._reported: dict[str, LayoutReport] = {}
        self._names_groups: set[str] = set()  # models whose engines' stores name group kinds

    # ------------------------------------------------------------------ evidence

    def model_config(self, model: str, directory: Path) -> None:
        """The model's ``config.json`` (beside its tokenizer) says whether it is hybrid."""
        engine = self.engines.get(model)
        marker = read_hybrid_marker(directory)
        if engine is not None and marker is not None:
            engine.learn(hybrid=SOURCE_MODEL_CONFIG)
            _log.info("model %s: hybrid (recurrent-state layers: config.json %s)", model, marker)

    def observer(self, model: str, block_size: int) -> Callable[[int], None]:
        """``on_checkpoint`` for the model's engine ingests (direct mode): the token position
        of each checkpoint an engine publishes."""
        grid = self.grids.get(model)
        if grid is None:
            grid = self.grids[model] = CheckpointGrid(block_size)

        def observe(end: int) -> None:
            grid.observe_end(end)
            engine = self.engines.get(model)
            if engine is None:
                return
            interval, alignment = grid.interval(), grid.alignment()
            learned = None if interval is None else (interval, SOURCE_ENGINE)
            aligned = None if alignment is None else (alignment, SOURCE_ENGINE)
            if engine.learn(hybrid=SOURCE_ENGINE, interval=learned, alignment=aligned):
                self._log_layout(model, engine)

        return observe

    def facts_observer(self, model: str) -> Callable[[EngineFacts], None]:
        """``on_facts`` for the model's engine ingests (direct mode): what an engine's stores
        showed (lookahead hashes, group kinds)."""

        def observe(facts: EngineFacts) -> None:
            if facts.names_groups:
                self._names_groups.add(model)
            engine = self.engines.get(model)
            if engine is None or not facts.lookahead_tokens:
                return
            if engine.learn(lookahead=(facts.lookahead_tokens, SOURCE_ENGINE)):
                self._log_layout(model, engine)

        return observe

    def registered(self, info: ReplicaInfo) -> None:
        """A publisher (re-)registered its replica (Redis mode)."""
        old = self._model_of.get(info.replica)
        if old is not None and old != info.model:
            self.unregistered(info.replica)
        self._model_of[info.replica] = info.model
        self._registered.setdefault(info.model, {})[info.replica] = info
        self._from_registry(info.model)

    def unregistered(self, replica: str) -> None:
        model = self._model_of.pop(replica, None)
        if model is not None:
            self._registered[model].pop(replica, None)
            self._from_registry(model)

    def _from_registry(self, model: str) -> None:
        engine = self.engines.get(model)
        if engine is None:
            return
        infos = self._registered.get(model, {}).values()
        grids = Counter(i.state_interval_blocks for i in infos if i.state_interval_blocks > 0)
        interval = (grids.most_common(1)[0][0], SOURCE_REGISTRY) if grids else None
        aligns = Counter(i.state_alignment_blocks for i in infos if i.state_alignment_blocks > 0)
        alignment = (aligns.most_common(1)[0][0], SOURCE_REGISTRY) if aligns else None
        hybrid = SOURCE_REGISTRY if any(i.hybrid for i in infos) else None
        if any(i.names_groups for i in infos):
            self._names_groups.add(model)
        most = max((i.lookahead_tokens for i in infos), default=0)
        lookahead = (most, SOURCE_REGISTRY) if most else None
        if engine.learn(hybrid=hybrid, interval=interval, alignment=alignment, lookahead=lookahead):
            self._log_layout(model, engine)

    def _log_layout(self, model: str, engine: RoutingEngine) -> None:
        layout = engine.layout
        _log.info(
            "model %s: routing on hybrid=%s (%s), checkpoint grid %d blocks (%s), "
            "engine block %d blocks (%s), lookahead hashes of %d tokens, EAGLE block "
            "drop %s",
            model,
            layout.hybrid,
            layout.hybrid_source,
            layout.interval_blocks,
            layout.interval_source,
            layout.alignment_blocks,
            layout.alignment_source,
            engine.lookahead_tokens,
            engine.drops_eagle_block,
        )

    # ------------------------------------------------------------------ checks

    def check(self) -> list[LayoutReport]:
        """Re-evaluate every model (detection through the index included); log mismatches
        as they appear and clear. Returns the reports (also kept for ``reports``)."""
        out = []
        for model, engine in self.engines.items():
            keys = self.keys_for(model)
            engine.detect(keys)
            self._check_guess(model, engine, keys)
            report = self._report(model, engine, keys)
            self._announce(self._reported.get(model), report)
            self._reported[model] = report
            out.append(report)
        return out

    def _check_guess(self, model: str, engine: RoutingEngine, keys: Sequence[ReplicaKey]) -> None:
        """Drop a hybrid layout only ``config.json`` suggested, once the engines showed they
        publish no checkpoint (module docstring)."""
        if engine.learned_hybrid != SOURCE_MODEL_CONFIG or engine.settings.hybrid is not None:
            return
        if model in self._names_groups or any(map(self.index.publishes_state, keys)):
            return
        grid = self.grids.get(model)
        if grid is not None and grid.checkpoints:  # they do, off the router's blocks
            return
        if any(i.hybrid for i in self._registered.get(model, {}).values()):
            return
        held = sum(self.index.replica_size(k)[0] for k in keys)
        if held >= KV_ONLY_EVIDENCE_BLOCKS and engine.forget_guessed_hybrid():
            _log.warning(
                "model %s: its config.json names recurrent-state layers, but its engines "
                "published %d KV blocks, no recurrent-state checkpoint and no group kinds "
                "(SGLang publishes none): routing on the KV prefix alone; [models.%s] hybrid "
                "decides",
                model,
                held,
                model,
            )
            self._log_layout(model, engine)

    def reports(self) -> list[LayoutReport]:
        return list(self._reported.values())

    def _report(
        self, model: str, engine: RoutingEngine, keys: Sequence[ReplicaKey]
    ) -> LayoutReport:
        s = engine.settings
        publishes = engine.learned_hybrid in (SOURCE_ENGINE, SOURCE_REGISTRY)
        kv_only = 0 if publishes else sum(self.index.replica_size(k)[0] for k in keys)
        grid = self.grids.get(model)
        learned_interval = engine.learned_interval
        learned_alignment = engine.learned_alignment
        mismatches = layout_mismatches(
            s.hybrid,
            s.state_interval_blocks,
            publishes,
            kv_only,
            learned_interval[0] if learned_interval is not None else None,
            s.alignment_blocks,
            learned_alignment[0] if learned_alignment is not None else None,
        )
        if grid is not None and grid.unaligned:
            mismatches["block_size"] = (
                f"{grid.unaligned} of {grid.checkpoints} state checkpoints end off the "
                f"router's {grid.block_size}-token block boundaries: those prefixes are never "
                "usable; choose a block_size dividing the engines' checkpoint positions"
            )
        layout = engine.layout
        lookahead = engine.learned_lookahead
        return LayoutReport(
            model,
            layout.hybrid,
            layout.hybrid_source,
            layout.interval_blocks,
            layout.interval_source,
            mismatches,
            layout.alignment_blocks,
            layout.alignment_source,
            lookahead[0] if lookahead is not None else 0,
            lookahead[1] if lookahead is not None else SOURCE_NONE,
            engine.drops_eagle_block,
        )

    @staticmethod
    def _announce(old: LayoutReport | None, new: LayoutReport) -> None:
        before = old.mismatches if old is not None else {}
        for name, text in new.mismatches.items():
            if name not in before:
                _log.warning("model %s: %s", new.model, text)
        for name in before:
            if name not in new.mismatches:
                _log.info("model %s: the %s mismatch cleared", new.model, name)
