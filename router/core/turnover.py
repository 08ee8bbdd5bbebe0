"""How long a replica's cached blocks live before its engine evicts them.

A replica whose cache is full evicts a block for every block it stores: the more new
prefill it is sent, the sooner the prefixes it holds are gone, and a conversation that
comes back after its cache turned over is prefilled again. Its *horizon* (cached blocks over
blocks evicted per second) is how long an unused block survives there; it is infinite while
the engine evicts nothing (the cache still has room).

Two sources, because each alone misleads: the engine's eviction counts (its KV events, read
from the index every ``interval_s``) say whether and how fast a cache turns over, but only
after the fact; the blocks this router just sent there uncached (``dispatched``) are what it
will have to evict next. A replica's turnover rate is the larger of the two (the second
counts only while the first shows the cache is full). Without the second a replica that
looked calm at the last sample would take every new prefix until the next one.

Routing compares replicas, so what it reads is each replica's *eviction risk*: the chance
that a block unused for the replica's horizon ``h`` would have been used again,
``exp(-h / reuse_window_s)``, less the same chance on the fleet's calmest cache at the last
sample (horizon ``H``): what placing a new block there loses beyond placing it on the
calmest one. It is 0 on the calmest cache, where nothing is evicted, and wherever the
horizons are alike (a fleet turning over every 30 s, a replica at 27 s: 0.01), so the cost
of a miss is not counted twice (``prefill`` already prices it); it approaches 1 on a
replica whose cache turns over far faster than the others'. ``Ours``
(router/core/policies.py) charges a placement's new prefill by it.

Pure: the caller passes ``now`` and the index's counts (``PrefixIndex.evicted_blocks`` /
``replica_size``). Rates are smoothed over ``window_s`` (exponential decay), so one burst
does not define a replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.core.types import ReplicaKey

INFINITE = math.inf
# How long after its last use a block is still worth keeping: the time scale of the chance
# that it is used again (a conversation's next turn, an agent's next step). The default of
# RoutingSettings.reuse_window_s (a model setting; `sim replay --reuse-window-s`).
REUSE_WINDOW_S = 300.0


@dataclass(slots=True)
class _Meter:
    evicted: int  # the index's count at the last sample
    at: float  # when it was taken
    rate: float = 0.0  # blocks the engine evicted per second, smoothed
    sent: float = 0.0  # uncached blocks this router sent there, decayed over the window
    held: int = 0  # cached blocks at the last sample

    def turnover(self, window_s: float) -> float:
        """Share of the cache replaced per second; 0 while the engine evicts nothing (less
        than a block a window: its cache still has room)."""
        if self.rate * window_s < 1.0:
            return 0.0
        return max(self.rate, self.sent / window_s) / max(self.held, 1)


class CacheTurnover:
    """Per-replica cache turnover, horizons and eviction risks (see the module docstring)."""

    __slots__ = (
        "_calm",
        "_columns",
        "_meters",
        "_sampled_at",
        "interval_s",
        "reuse_window_s",
        "window_s",
    )

    def __init__(
        self,
        interval_s: float = 5.0,
        window_s: float = 60.0,
        reuse_window_s: float = REUSE_WINDOW_S,
    ) -> None:
        if interval_s <= 0 or window_s <= 0 or reuse_window_s <= 0:
            raise ValueError("interval_s, window_s and reuse_window_s must be positive")
        self.interval_s = interval_s
        self.window_s = window_s
        self.reuse_window_s = reuse_window_s
        self._meters: dict[ReplicaKey, _Meter] = {}
        self._sampled_at = -INFINITE
        self._calm = 0.0  # the reuse chance lost on the calmest sampled cache
        # risks of the last sequence asked for, as an array (CandidateColumns), and where
        # each key sits in it (updated in place by ``dispatched``)
        self._columns: tuple[Sequence[ReplicaKey], np.ndarray, dict[ReplicaKey, list[int]]]
        self._columns = ((), np.empty(0), {})

    def due(self, now: float) -> bool:
        """Whether a sample is due (``interval_s`` since the last one)."""
        return now - self._sampled_at >= self.interval_s

    def sample(
        self,
        now: float,
        replicas: Sequence[ReplicaKey],
        evicted: Callable[[ReplicaKey], int],
        held: Callable[[ReplicaKey], int],
    ) -> None:
        """Take each replica's eviction count (``evicted``: cumulative, restarting at 0 when
        the replica's cache was cleared) and cached block count (``held``) at ``now``; risks
        are then against the calmest of ``replicas``."""
        self._sampled_at = now
        meters = self._meters
        window = self.window_s
        for key in replicas:
            count = evicted(key)
            meter = meters.get(key)
            if meter is None or count < meter.evicted:  # new, or its cache was cleared
                meters[key] = _Meter(count, now, held=held(key))
                continue
            dt = now - meter.at
            if dt <= 0:
                continue
            keep = math.exp(-dt / window)
            meter.rate += (1.0 - keep) * ((count - meter.evicted) / dt - meter.rate)
            meter.sent *= keep
            meter.evicted, meter.at, meter.held = count, now, held(key)
        self._calm = min((self._lost(meters[k]) for k in replicas if k in meters), default=0.0)
        self._columns = ((), np.empty(0), {})

    def dispatched(self, key: ReplicaKey, blocks: float) -> None:
        """This router sent ``blocks`` uncached blocks to ``key`` (what it will store, and
        evict to make room for once its cache is full)."""
        meter = self._meters.get(key)
        if meter is None or blocks <= 0:
            return
        meter.sent += blocks
        cached = self._columns
        at = cached[2].get(key)
        if at:
            value = self.risk(key)
            for i in at:
                cached[1][i] = value

    def _lost(self, meter: _Meter) -> float:
        """The chance that a block evicted at ``meter``'s horizon would have been used
        again."""
        rate = meter.turnover(self.window_s)
        return math.exp(-1.0 / (rate * self.reuse_window_s)) if rate > 0 else 0.0

    def horizon_s(self, key: ReplicaKey) -> float:
        """Seconds an unused block lasts on ``key`` at its current turnover (infinite: it
        evicts nothing, or it was never sampled)."""
        meter = self._meters.get(key)
        rate = 0.0 if meter is None else meter.turnover(self.window_s)
        return 1.0 / rate if rate > 0 else INFINITE

    def risk(self, key: ReplicaKey) -> float:
        """``key``'s eviction risk: see the module docstring (0 for replicas never
        sampled)."""
        meter = self._meters.get(key)
        if meter is None:
            return 0.0
        return max(self._lost(meter) - self._calm, 0.0)

    def risks(self, replicas: Sequence[ReplicaKey]) -> np.ndarray:
        """``risk`` of each of ``replicas``, as an array; kept (and updated by
        ``dispatched``) until the next sample while the same sequence object is passed
        (routing passes each model's tuple)."""
        cached = self._columns
        if cached[0] is replicas:
            return cached[1]
        out = np.fromiter(map(self.risk, replicas), dtype=np.float64, count=len(replicas))
        where: dict[ReplicaKey, list[int]] = {}
        for i, key in enumerate(replicas):
            where.setdefault(key, []).append(i)
        self._columns = (replicas, out, where)
        return out

    def forget(self, key: ReplicaKey) -> None:
        """Drop ``key``'s meter (it left the fleet)."""
        self._meters.pop(key, None)
        self._columns = ((), np.empty(0), {})
