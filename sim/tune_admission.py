"""``kvrouter sim tune --tune admission``: search the admission knobs (router/core/admission.py).

Every grid point runs on every (trace, speed-up) case, in parallel worker processes, with
the run's policy (``ours`` with the fleet's cost model) and class shares. Objective: the
mean goodput over the cases, among the settings whose priority class meets its SLO for at
least ``min_priority`` of its requests in every case; settings below that floor rank after
all the others, by their worst priority attainment. The defaults are always in the grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from router.core.admission import AdmissionSettings
from sim.cluster_config import ClusterConfig
from sim.runner import RunSpec, run_many
from sim.workload import Workload

# knob -> values; a per-class knob is searched in one class's position (name, index)
GRID: dict[tuple[str, int], tuple[float, ...]] = {
    ("stall_share", 0): (0.05, 0.1, 0.25),
    ("stall_share", 1): (0.3, 0.5, 0.8),
    ("headroom", 1): (0.5, 1.0),
    ("max_stall", 1): (1.0, 3.0, 10.0),
}


@dataclass(slots=True, frozen=True)
class AdmissionTrial:
    settings: AdmissionSettings
    goodput: float  # mean over cases
    priority: float  # worst priority attainment over cases (1.0 without priority traffic)
    cases: tuple[dict[str, Any], ...]


def grid_settings(
    base: AdmissionSettings, grid: Mapping[tuple[str, int], Sequence[float]] = GRID
) -> list[AdmissionSettings]:
    """``base`` first, then every grid combination applied to it."""
    keys = list(grid)
    out = [base]
    for combo in itertools.product(*(grid[k] for k in keys)):
        s = base
        for (name, at), value in zip(keys, combo, strict=True):
            old = list(getattr(s, name))
            old[at] = value
            changes: dict[str, Any] = {name: tuple(old)}
            s = replace(s, **changes)
        if s not in out:
            out.append(s)
    return out


def tune_admission(
    workloads: Sequence[tuple[str, Workload]],
    config: ClusterConfig,
    *,
    speedups: Sequence[float],
    min_priority: float = 0.99,
    jobs: int = 2,
    grid: Mapping[tuple[str, int], Sequence[float]] = GRID,
    budget: int | None = None,
    log: Callable[[str], None] | None = None,
) -> list[AdmissionTrial]:
    """Every grid point (the first ``budget`` of them, the defaults first) on every case,
    best first (module docstring)."""
    points = grid_settings(config.admission or AdmissionSettings(), grid)[:budget]
    cases: list[list[dict[str, Any]]] = [[] for _ in points]
    for name, workload in workloads:
        specs = [RunSpec("ours", None, s, admission=p) for p in points for s in speedups]
        results = run_many(workload, config, specs, jobs=jobs)
        n = len(speedups)
        for i in range(len(points)):
            for s, r in zip(speedups, results[i * n : (i + 1) * n], strict=True):
                x = r.summary
                cases[i].append(
                    {
                        "trace": name,
                        "speedup": s,
                        "goodput": x["goodput"],
                        "slo_attainment": x["slo_attainment"],
                        "shed": x["shed"],
                    }
                )
        if log:
            log(f"{name}: {len(points)} settings x {len(speedups)} speed-ups done")
    trials = []
    for p, cs in zip(points, cases, strict=True):
        prio = [c["slo_attainment"]["priority"] for c in cs]
        worst = min((v for v in prio if v is not None), default=1.0)
        mean = sum(float(c["goodput"]) for c in cs) / len(cs)
        trials.append(AdmissionTrial(p, round(mean, 5), worst, tuple(cs)))
    return ranked(trials, min_priority)


def ranked(trials: Sequence[AdmissionTrial], min_priority: float) -> list[AdmissionTrial]:
    """``trials`` best first: those whose priority attainment meets ``min_priority`` by
    mean goodput, then the others by their worst priority attainment (goodput breaks ties)."""

    def key(t: AdmissionTrial) -> tuple[bool, float, float]:
        if t.priority >= min_priority:
            return (False, -t.goodput, -t.priority)
        return (True, -t.priority, -t.goodput)

    return sorted(trials, key=key)


def admission_toml(model: str, settings: AdmissionSettings, header: str) -> str:
    """The ``[models.NAME.admission]`` table of ``settings`` (service configuration)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f'[models."{model}".admission]', "enabled = true"]
    for key, value in asdict(settings).items():
        if isinstance(value, tuple):
            items = ", ".join(_num(v) for v in value)
            lines.append(f"{key} = [{items}]")
        else:
            lines.append(f"{key} = {_num(value)}")
    return "\n".join(lines) + "\n"


def _num(value: float) -> str:
    if isinstance(value, bool):  # TOML's spelling
        return "true" if value else "false"
    if value == float("inf"):
        return "inf"
    return repr(float(value)) if isinstance(value, float) else str(value)
