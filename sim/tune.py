"""``kvrouter sim tune``: search ``ours``' coefficients on one or more traces.

Search: a grid over the coefficients that matter most, then successive halving. Rung 0 runs
every grid point on the first quarter of every trace at every requested speed-up; the best
third goes on to half the traces, the best third of those to the whole traces. Runs execute
in parallel worker processes. The defaults are always in the grid and always reach the full
traces, so the winner is never worse than them on the objective as measured there.

Seeds (``seeds``, ``kvrouter sim tune --seeds N``, default 3): the run's seed draws the
arrival jitter (``--arrival-jitter-ms``), the routers' tie-breaks and the admission
classes, so one run is one sample. Rungs 1 and 2 run every setting at seeds ``seed`` ..
``seed + N - 1`` and score it by the mean of its per-seed objectives (``Trial.by_seed``
their values; the spread is their min and max), so the final pick is not a lucky seed's;
rung 0, a screen that passes on a third, runs the first seed only (the cost: about twice
the one-seed search's, not N times).

Objectives (``objective``), over every (trace, speed-up) case:

* ``goodput`` (the default): the mean goodput (share of requests meeting their TTFT and TPOT
  targets, ``router.core.slo``; higher is better), ties broken by the geometric mean of E2E
  p90. A setting must serve every trace and load level well, not one.
* ``ttft``: the geometric mean of p90 TTFT (lower is better), ties broken by the higher token
  hit rate: what TTFT alone would choose (kept for comparison; it buys TTFT with decode
  speed under load).

With prefill/decode disaggregation on (``--pd always|auto``) the grid is ``PD_GRID``
instead: the prefill share of each rack and the decision's knobs (router/core/disagg.py
``PdKnobs``), ``ours``' weights at their defaults. Those keys carry a ``pd.`` prefix; they
go to the simulated cluster, not to the policy.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from router.core.disagg import PdKnobs
from router.core.policies import Ours
from sim.cluster_config import ClusterConfig
from sim.runner import RunSpec, run_many
from sim.workload import Workload

GRID: dict[str, tuple[float, ...]] = {
    "w_prefill": (4.0, 8.0, 12.0, 16.0, 24.0),
    "w_queue": (0.5, 1.0, 1.5),
    "w_interference": (0.0, 1.0, 2.0, 4.0, 8.0),
}
PD_GRID: dict[str, tuple[float, ...]] = {
    "pd.prefill_share": (0.125, 0.25, 0.5),
    "pd.min_uncached_tokens": (2048.0, 4096.0, 16384.0),
    "pd.max_local_hit": (0.3, 0.5, 0.8),
    "pd.rack_penalty_s": (0.5, 2.0, 8.0),
}
OBJECTIVES = ("goodput", "ttft")


def _default(key: str) -> float:
    if key == "pd.prefill_share":
        return 0.25
    if key.startswith("pd."):
        return float(getattr(PdKnobs(), key[3:]))
    return float(getattr(Ours(), key))


def split_point(point: Mapping[str, float]) -> tuple[dict[str, float], dict[str, Any]]:
    """(policy parameters, cluster overrides) of a grid point."""
    policy = {k: v for k, v in point.items() if not k.startswith("pd.")}
    knobs: dict[str, Any] = {k[3:]: v for k, v in point.items() if k.startswith("pd.")}
    cluster: dict[str, Any] = {}
    if "prefill_share" in knobs:
        cluster["prefill_share"] = knobs.pop("prefill_share")
    if "min_uncached_tokens" in knobs:
        knobs["min_uncached_tokens"] = int(knobs["min_uncached_tokens"])
    if knobs:
        cluster["pd_params"] = knobs
    return policy, cluster


@dataclass(slots=True, frozen=True)
class Case:
    """One trace's figures for a setting at one speed-up."""

    trace: str
    speedup: float
    seed: int
    goodput: float
    hit_rate: float
    ttft_p90_ms: float
    tpot_p90_ms: float
    e2e_p90_ms: float


@dataclass(slots=True, frozen=True)
class Trial:
    params: dict[str, float]
    objective: float  # the mean over seeds of the per-seed objective; lower is better
    goodput: float  # means over every case of every seed
    hit_rate: float
    p90_ms: dict[float, float]  # TTFT p90 per speed-up (mean over traces and seeds)
    cases: tuple[Case, ...]  # every (trace, speed-up, seed)
    requests: int
    by_seed: dict[int, float]  # the objective at each seed (goodput negated, as ``objective``)

    @property
    def spread(self) -> tuple[float, float]:
        """(min, max) of the per-seed objective."""
        return min(self.by_seed.values()), max(self.by_seed.values())


def grid_points(
    grid: Mapping[str, Sequence[float]], budget: int | None, seed: int
) -> list[dict[str, float]]:
    """All grid combinations (or ``budget`` of them sampled with ``seed``), defaults first."""
    keys = list(grid)
    points = [
        dict(zip(keys, combo, strict=False))
        for combo in itertools.product(*(grid[k] for k in keys))
    ]
    default = {k: _default(k) for k in keys}
    points = [p for p in points if p != default]
    if budget is not None and budget - 1 < len(points):
        points = random.Random(seed).sample(points, max(0, budget - 1))
    return [default, *points]


def _geomean(values: Sequence[float]) -> float:
    """The geometric mean of lower-is-better figures; a NaN one (a case with no answer to
    time: every request refused) is infinite, ranking its setting last, not as a tie (NaN
    compares as neither better nor worse, and the sort kept the grid's order)."""
    if any(v != v for v in values):
        return math.inf
    return math.exp(sum(math.log(max(v, 1e-3)) for v in values) / len(values))


def _score(cases: Sequence[Case], objective: str) -> tuple[float, float]:
    """(objective, tie-break) of one seed's cases, both lower-is-better."""
    if objective == "goodput":
        mean = sum(c.goodput for c in cases) / len(cases)
        return -mean, _geomean([c.e2e_p90_ms for c in cases])
    return _geomean([c.ttft_p90_ms for c in cases]), -sum(c.hit_rate for c in cases) / len(cases)


def _seed_scores(cases: Sequence[Case], objective: str) -> dict[int, tuple[float, float]]:
    """:func:`_score` of each seed's cases."""
    seeds = sorted({c.seed for c in cases})
    return {s: _score([c for c in cases if c.seed == s], objective) for s in seeds}


def rank(
    points: Sequence[dict[str, float]],
    per_point: Sequence[Sequence[Case]],
    objective: str,
    requests: int = 0,
) -> list[Trial]:
    """Trials of ``points`` (``per_point[i]``: point i's cases over every trace, speed-up and
    seed), best first: by the mean over seeds of the per-seed objective, then of its
    tie-break."""
    trials = []
    keys = []
    for p, cases in zip(points, per_point, strict=True):
        scores = _seed_scores(cases, objective)
        n = len(scores)
        key = (sum(o for o, _ in scores.values()) / n, sum(t for _, t in scores.values()) / n)
        speedups = sorted({c.speedup for c in cases})
        p90 = {
            s: statistics.fmean(c.ttft_p90_ms for c in cases if c.speedup == s) for s in speedups
        }
        trials.append(
            Trial(
                p,
                key[0],
                statistics.fmean(c.goodput for c in cases),
                statistics.fmean(c.hit_rate for c in cases),
                p90,
                tuple(cases),
                requests,
                {s: o for s, (o, _) in scores.items()},
            )
        )
        keys.append(key)
    order = sorted(range(len(trials)), key=lambda i: keys[i])
    return [trials[i] for i in order]


def evaluate(
    workloads: Sequence[tuple[str, Workload]],
    config: ClusterConfig,
    points: Sequence[dict[str, float]],
    speedups: Sequence[float],
    jobs: int,
    base: Mapping[str, Any],
    objective: str = "goodput",
    seeds: Sequence[int] | None = None,
) -> list[Trial]:
    """Every point on every (trace, speed-up, seed), best first (:func:`rank`); ``seeds``
    default: the config's one."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    seeds = [config.seed] if not seeds else list(seeds)
    runs = [(s, seed) for seed in seeds for s in speedups]
    per_point: list[list[Case]] = [[] for _ in points]
    for name, workload in workloads:
        specs = []
        for p in points:
            policy, cluster = split_point(p)
            specs += [
                RunSpec("ours", {**base, **policy}, s, cluster={**cluster, "seed": seed})
                for s, seed in runs
            ]
        results = run_many(workload, config, specs, jobs=jobs)
        n = len(runs)
        for i in range(len(points)):
            for (s, seed), r in zip(runs, results[i * n : (i + 1) * n], strict=True):
                x = r.summary
                per_point[i].append(
                    Case(
                        name,
                        s,
                        seed,
                        float(x["goodput"]),
                        float(x["token_hit_rate"]),
                        float(x["ttft_ms_p90"]),
                        float(x["tpot_ms_p90"]),
                        float(x["e2e_ms_p90"]),
                    )
                )
    return rank(points, per_point, objective, sum(w.client_requests() for _, w in workloads))


def tune(
    workload: Workload | Sequence[tuple[str, Workload]],
    config: ClusterConfig,
    *,
    speedups: Sequence[float] = (1.0, 4.0),
    grid: Mapping[str, Sequence[float]] = GRID,
    budget: int | None = None,
    jobs: int = 2,
    seed: int = 0,
    objective: str = "goodput",
    log: Callable[[str], None] | None = None,
    seeds: int = 3,
) -> tuple[dict[str, Any], list[Trial]]:
    """Return the best ``ours`` parameters (cost model and TPOT target included) and the
    final rung. ``workload``: one workload, or ``(name, workload)`` pairs; ``seeds``: the
    simulation seeds (``config.seed`` onwards) rungs 1 and 2 score each setting over."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    workloads = [("trace", workload)] if isinstance(workload, Workload) else list(workload)
    if objective == "ttft":  # answers not streamed have no TTFT (sim/metrics.py)
        for name, w in workloads:
            if not any(r.stream for r in w.requests):
                raise ValueError(
                    f"--objective ttft: {name} has no streamed request, so no TTFT to rank "
                    "by (its answers reach their clients whole); --objective goodput "
                    "judges them by their E2E"
                )
    if config.pd != "off" and grid is GRID:
        grid = PD_GRID
    base: dict[str, Any] = {"cost": asdict(config.profile.cost), "tpot_target_s": config.slo.tpot_s}
    points = grid_points(grid, budget, seed)
    fractions = (0.25, 0.5, 1.0)
    trials: list[Trial] = []
    default = points[0]
    for rung, frac in enumerate(fractions):
        parts = [
            (name, w if frac >= 1.0 else w.head(max(1, int(len(w) * frac))))
            for name, w in workloads
        ]
        run_seeds = [config.seed + i for i in range(seeds if rung else 1)]
        trials = evaluate(parts, config, points, speedups, jobs, base, objective, run_seeds)
        if log:
            best = trials[0]
            sign = -1.0 if objective == "goodput" else 1.0
            low, high = sorted(sign * v for v in best.spread)
            sent = sum(w.client_requests() for _, w in parts)
            log(
                f"rung {rung}: {len(points)} settings on {sent} "
                f"requests x {len(run_seeds)} seed(s); best {best.params} goodput "
                f"{best.goodput:.4f} ({objective} per seed {low:.4f} .. {high:.4f}), "
                f"TTFT p90 {best.p90_ms} ms, hit {best.hit_rate:.1%}"
            )
        if rung < len(fractions) - 1:
            keep = max(1, math.ceil(len(points) / 3))
            points = [t.params for t in trials[:keep]]
            if default not in points:  # the defaults always reach the full traces
                points.append(default)
    best = trials[0]
    return {**best.params, **base}, trials
