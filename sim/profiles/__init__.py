"""Replica profiles: the hardware/model figures the engine model runs on.

A profile is a TOML file (``sim/profiles/<name>.toml``, or any path) with these keys::

    name = "dense-70b"
    description = "..."            # free text: the assumptions behind the figures
    block_size = 64                # the block size kv_blocks / cpu_blocks are counted in
    kv_blocks = 16384              # GPU KV capacity of one replica
    max_running = 256              # continuous-batching limit (sequences in the batch)
    hybrid = false                 # recurrent-state (KDA / mamba) layers present?
    checkpoint = "every_n"         # state checkpoint grid: every_block | step_end | every_n
    checkpoint_interval_tokens = 8192   # grid step for every_n (multiple of the block size)
    checkpoint_prompt_end = true   # also snapshot at the prompt's last full block
    eagle = false                  # EAGLE / MTP speculative decoding: a hit gives back its
                                   # last block, the prompt-end snapshot one block lower
    state_checkpoint_blocks = 64.0 # memory of one state checkpoint, in KV blocks
    sliding_window_tokens = 0      # full + sliding-window attention (gpt-oss, Gemma 3): the
                                   # window; 0: none (not with hybrid or eagle)
    window_block_cost = 1.0        # memory of a block's sliding-window KV, in KV blocks
    cpu_blocks = 0                 # optional host-memory tier (0: none)
    cpu_load_s_per_token = 2e-7    # host -> GPU reload time per cached token
    kv_bytes_per_token = 327680.0  # KV bytes a token (what a remote prefill moves)
    state_bytes = 0.0              # recurrent state of one sequence, moved with it

    [cost]                         # router.core.load.CostModel fields (seconds)
    step_overhead_s = 0.008
    ...

The same ``[cost]`` table is what ``ours`` uses to predict TTFT, so a simulated fleet and
the router's model of it agree unless you deliberately give them different figures.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from router.core.errors import ConfigError
from router.core.load import CostModel
from router.events.window import blocks_needed

PROFILE_DIR = Path(__file__).resolve().parent
CHECKPOINT_MODES = ("every_block", "step_end", "every_n")


@dataclass(slots=True, frozen=True)
class EngineProfile:
    """Figures of one replica (one model instance over several GPUs). See the module doc."""

    name: str
    cost: CostModel = field(default_factory=CostModel)
    block_size: int = 64
    kv_blocks: int = 16384
    max_running: int = 256
    hybrid: bool = False
    checkpoint: str = "every_n"
    checkpoint_interval_tokens: int = 8192
    checkpoint_prompt_end: bool = True
    eagle: bool = False
    state_checkpoint_blocks: float = 0.0
    sliding_window_tokens: int = 0
    window_block_cost: float = 1.0
    cpu_blocks: int = 0
    cpu_load_s_per_token: float = 2e-7
    kv_bytes_per_token: float = 327680.0
    state_bytes: float = 0.0
    description: str = ""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.kv_blocks <= 0 or self.max_running <= 0:
            raise ConfigError(f"profile {self.name}: block_size, kv_blocks, max_running > 0")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ConfigError(
                f"profile {self.name}: checkpoint must be one of {', '.join(CHECKPOINT_MODES)}"
            )
        if self.checkpoint_interval_tokens <= 0 or self.cpu_blocks < 0:
            raise ConfigError(f"profile {self.name}: bad checkpoint interval or cpu_blocks")
        if self.kv_bytes_per_token < 0 or self.state_bytes < 0:
            raise ConfigError(f"profile {self.name}: kv_bytes_per_token, state_bytes >= 0")
        if self.state_checkpoint_blocks < 0:
            raise ConfigError(f"profile {self.name}: state_checkpoint_blocks must be >= 0")
        if self.sliding_window_tokens < 0 or self.window_block_cost < 0:
            raise ConfigError(f"profile {self.name}: sliding window figures must be >= 0")
        if self.sliding_window_tokens and (self.hybrid or self.eagle):
            raise ConfigError(
                f"profile {self.name}: a sliding window is not modelled with hybrid or eagle"
            )

    def window_blocks(self, block_size: int) -> int:
        """Blocks of ``block_size`` a prefix hit needs before its end in the sliding-window
        layers (vLLM's ``cdiv(window - 1, block_size)``, at least 1); 0 without a window."""
        if not self.sliding_window_tokens:
            return 0
        return blocks_needed(self.sliding_window_tokens, block_size)

    def scaled(self, block_size: int) -> EngineProfile:
        """The same memory expressed in blocks of ``block_size`` tokens."""
        if block_size == self.block_size:
            return self
        ratio = self.block_size / block_size
        return replace(
            self,
            block_size=block_size,
            kv_blocks=max(1, int(self.kv_blocks * ratio)),
            cpu_blocks=int(self.cpu_blocks * ratio),
            state_checkpoint_blocks=self.state_checkpoint_blocks * ratio,
        )

    def with_overrides(self, **changes: Any) -> EngineProfile:
        """Copy with some fields replaced (None values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def profile_from_mapping(data: dict[str, Any], source: str = "<mapping>") -> EngineProfile:
    """Build a profile from parsed TOML; unknown keys raise ConfigError (typos are loud)."""
    data = dict(data)
    cost_data = data.pop("cost", {})
    allowed = {f.name for f in fields(EngineProfile)} - {"cost"}
    unknown = set(data) - allowed
    if unknown:
        raise ConfigError(f"{source}: unknown profile key(s) {', '.join(sorted(unknown))}")
    cost_allowed = {f.name for f in fields(CostModel)}
    bad = set(cost_data) - cost_allowed
    if bad:
        raise ConfigError(f"{source}: unknown [cost] key(s) {', '.join(sorted(bad))}")
    if "name" not in data:
        raise ConfigError(f"{source}: a profile needs a name")
    try:
        return EngineProfile(cost=CostModel(**cost_data), **data)
    except TypeError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_profile(name_or_path: str) -> EngineProfile:
    """A bundled profile by name (``dense-70b``, ``kimi-k3``) or a TOML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise ConfigError(
            f"no profile {name_or_path!r}; bundled: {', '.join(profile_names())} or a .toml path"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return profile_from_mapping(data, str(path))
