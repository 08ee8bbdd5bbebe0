"""``kvrouter sim tune``: search ``ours``' coefficients on a trace.

Search: a grid over the coefficients that matter most, then successive halving. Rung 0 runs
every grid point on the first quarter of the trace at every requested speed-up; the best
third goes on to half the trace, the best third of those to the whole trace. Runs execute
in parallel worker processes. The objective is the geometric mean over speed-ups of p90 TTFT
(lower is better; ties broken by the higher token hit rate), so a setting must be good both
lightly and heavily loaded. The default settings are always in the grid, so the winner is
never worse than them on the objective as measured on the full trace.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from router.core.policies import Ours
from sim.cluster import ClusterConfig
from sim.runner import RunSpec, run_many
from sim.workload import Workload

GRID: dict[str, tuple[float, ...]] = {
    "w_prefill": (1.0, 4.0, 8.0, 12.0, 16.0, 24.0),
    "w_queue": (0.5, 1.0, 1.5),
    "w_decode": (0.0, 1.0),
}


@dataclass(slots=True, frozen=True)
class Trial:
    params: dict[str, float]
    objective: float
    hit_rate: float
    p90_ms: dict[float, float]
    requests: int


def grid_points(
    grid: Mapping[str, Sequence[float]], budget: int | None, seed: int
) -> list[dict[str, float]]:
    """All grid combinations (or ``budget`` of them sampled with ``seed``), defaults first."""
    keys = list(grid)
    points = [
        dict(zip(keys, combo, strict=False))
        for combo in itertools.product(*(grid[k] for k in keys))
    ]
    default = {k: float(getattr(Ours(), k)) for k in keys}
    points = [p for p in points if p != default]
    if budget is not None and budget - 1 < len(points):
        points = random.Random(seed).sample(points, max(0, budget - 1))
    return [default, *points]


def _objective(p90s: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(p, 1e-3)) for p in p90s) / len(p90s))


def evaluate(
    workload: Workload,
    config: ClusterConfig,
    points: Sequence[dict[str, float]],
    speedups: Sequence[float],
    jobs: int,
    base: Mapping[str, Any],
) -> list[Trial]:
    specs = [RunSpec("ours", {**base, **p}, s) for p in points for s in speedups]
    results = run_many(workload, config, specs, jobs=jobs)
    trials = []
    for i, p in enumerate(points):
        chunk = results[i * len(speedups) : (i + 1) * len(speedups)]
        p90 = {s: float(r.summary["ttft_ms_p90"]) for s, r in zip(speedups, chunk, strict=False)}
        hit = sum(float(r.summary["token_hit_rate"]) for r in chunk) / len(chunk)
        trials.append(Trial(p, _objective(list(p90.values())), hit, p90, len(workload)))
    trials.sort(key=lambda t: (t.objective, -t.hit_rate))
    return trials


def tune(
    workload: Workload,
    config: ClusterConfig,
    *,
    speedups: Sequence[float] = (1.0, 4.0),
    grid: Mapping[str, Sequence[float]] = GRID,
    budget: int | None = None,
    jobs: int = 2,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], list[Trial]]:
    """Return the best ``ours`` parameters (cost model included) and the final rung."""
    base: dict[str, Any] = {"cost": asdict(config.profile.cost)}
    points = grid_points(grid, budget, seed)
    n = len(workload)
    fractions = (0.25, 0.5, 1.0)
    trials: list[Trial] = []
    default = points[0]
    for rung, frac in enumerate(fractions):
        part = workload if frac >= 1.0 else workload.head(max(1, int(n * frac)))
        trials = evaluate(part, config, points, speedups, jobs, base)
        if log:
            best = trials[0]
            log(
                f"rung {rung}: {len(points)} settings on {len(part)} requests; best "
                f"{best.params} p90 {best.p90_ms} ms, hit {best.hit_rate:.1%}"
            )
        if rung < len(fractions) - 1:
            keep = max(1, math.ceil(len(points) / 3))
            points = [t.params for t in trials[:keep]]
            if default not in points:  # the defaults always reach the full trace
                points.append(default)
    best = trials[0]
    return {**best.params, **base}, trials
