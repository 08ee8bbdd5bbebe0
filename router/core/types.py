"""Value types shared by the index, the load model, the policies and their callers.

Everything here is an immutable value: the core records what happened as values and the
edges (service, simulator, publisher) move them around.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple


class Tier(enum.IntEnum):
    """Where a cached KV block lives. Values are bit positions in the index's tier masks."""

    GPU = 0
    CPU = 1
    DISK = 2

    @classmethod
    def parse(cls, medium: str | None) -> Tier:
        """Map an engine's ``medium`` string (vLLM: "GPU", "CPU", ...; None means GPU)."""
        if medium is None:
            return cls.GPU
        name = medium.strip().upper()
        if name in ("GPU", "HBM", "DEVICE", "CUDA"):
            return cls.GPU
        if name in ("CPU", "HOST", "DRAM", "CPU_PINNED"):
            return cls.CPU
        if name in ("DISK", "SSD", "NVME", "STORAGE", "REMOTE", "EXTERNAL"):
            return cls.DISK
        raise ValueError(f"unknown cache medium {medium!r}")


class Kind(enum.IntEnum):
    """What a published block hash names: attention KV for the prefix, or a recurrent-state
    (KDA / mamba) checkpoint taken exactly at the end of that prefix."""

    KV = 0
    STATE = 1


class ReplicaKey(NamedTuple):
    """One schedulable engine: a replica id plus its data-parallel rank.

    A NamedTuple rather than a frozen dataclass: it is the key of every per-replica dict on
    the routing hot path, and tuple hashing and equality run in C.
    """

    replica: str
    dp_rank: int = 0

    def __str__(self) -> str:
        return self.replica if self.dp_rank == 0 else f"{self.replica}#dp{self.dp_rank}"

    @classmethod
    def parse(cls, text: str) -> ReplicaKey:
        """``name`` or ``name#dpN`` (N in ASCII digits, at most 9: what ``int`` takes; any
        other text is a name of its own, which names no replica)."""
        name, sep, rank = text.rpartition("#dp")
        if sep and rank.isascii() and rank.isdigit() and len(rank) <= 9:
            return cls(name, int(rank))
        return cls(text, 0)


# ---------------------------------------------------------------------------- index events


@dataclass(slots=True, frozen=True)
class BlocksStored:
    """Canonical block hashes now cached on a replica (in chain order, parents first)."""

    hashes: tuple[int, ...]
    tier: Tier = Tier.GPU
    kind: Kind = Kind.KV


@dataclass(slots=True, frozen=True)
class BlocksRemoved:
    hashes: tuple[int, ...]
    tier: Tier = Tier.GPU
    kind: Kind = Kind.KV


@dataclass(slots=True, frozen=True)
class AllCleared:
    """The replica dropped its whole cache (engine restart, reset_prefix_cache)."""


IndexEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass(slots=True, frozen=True)
class EventBatch:
    """Events of one replica in wire order. ``seq`` is the replica's monotonically increasing
    batch number (None when the source has no sequence, e.g. the simulator)."""

    replica: ReplicaKey
    events: tuple[IndexEvent, ...]
    seq: int | None = None


class ApplyOutcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq already applied: ignored (idempotent redelivery)
    GAP = "gap"  # seq skipped ahead: applied, but events were lost; the caller must resync


# ---------------------------------------------------------------------------- lookups


class PrefixMatch(NamedTuple):
    """Cached prefix of one request on one replica, in blocks of the router's block size.

    ``kv_blocks``: every KV block in [0, kv_blocks) is cached in some tier.
    ``gpu_blocks`` / ``host_blocks``: how many of them from the start are on GPU, on GPU or CPU.
    ``usable_blocks``: the longest prefix the engine can actually reuse; for a hybrid model the
    largest L <= kv_blocks with a recurrent-state checkpoint at L (0 is always usable).
    """

    kv_blocks: int = 0
    gpu_blocks: int = 0
    host_blocks: int = 0
    usable_blocks: int = 0


NO_MATCH = PrefixMatch()


class RouteRequest(NamedTuple):
    """What the policies know about a request: its size and its canonical block chain.

    (Value objects built per request or per candidate are NamedTuples: immutable like a
    frozen dataclass, and several times cheaper to build.)"""

    request_id: str
    model: str
    prompt_tokens: int
    block_hashes: Sequence[int]
    block_size: int
    session_id: str | None = None
    max_output_tokens: int | None = None
    # False: the engine reads no prefix cache for it (vLLM: prompt logprobs asked); every
    # replica's match is empty, its blocks are still cached where it is sent
    reads_cache: bool = True
    # sequences decoded for each prompt (``n``) and prompts sent together (a batch of
    # completion prompts, ``prompt_tokens`` their sum): the load it adds (LoadTracker)
    samples: int = 1
    prompts: int = 1

    @property
    def prompt_blocks(self) -> int:
        """Blocks the prompt occupies, the partial tail counted as one."""
        return -(-self.prompt_tokens // self.block_size)


class Decision(NamedTuple):
    """A routing decision with everything needed to explain it.

    ``terms`` maps each score component to its value (for ``ours``: seconds of predicted
    TTFT per component); ``score`` is the policy's figure of merit for the winner (its
    direction is the policy's own; only ``ours`` and ``dynamo`` are "lower is better").
    ``ranking`` lists other candidates best-first, for retries on the next-best replica (at
    most ``MAX_RANKING`` of them for large fleets). A NamedTuple: built once per request.
    """

    replica: ReplicaKey
    policy: str
    usable_tokens: int
    kv_tokens: int
    score: float
    terms: Mapping[str, float] = MappingProxyType({})
    ranking: tuple[ReplicaKey, ...] = ()


MAX_RANKING = 32
