"""Running several simulations of one workload: policies side by side, speed-up sweeps,
in parallel worker processes (forked, so the hashed workload is shared, not re-read)."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from router.core.admission import AdmissionSettings
from router.core.policies import POLICY_NAMES
from sim.agentic import AgenticSpec, generate
from sim.cluster import Progress, Simulation
from sim.cluster_config import ClusterConfig, RunResult
from sim.metrics import Ceilings, ceilings
from sim.workload import Workload, check_limit, load_trace


@dataclass(slots=True, frozen=True)
class RunSpec:
    """One simulation to run: a policy with its parameters at an arrival speed-up."""

    policy: str
    params: Mapping[str, Any] | None = None
    speedup: float = 1.0
    label: str | None = None
    cluster: Mapping[str, Any] | None = None  # ClusterConfig fields replaced for this run
    admission: AdmissionSettings | None = None  # overrides the config's (sim tune)


def build_workload(
    trace: str,
    *,
    block_size: int,
    fmt: str = "auto",
    trace_block: int | None = None,
    limit: int | None = None,
    model: str = "sim-model",
) -> Workload:
    """A trace path, ``mooncake`` (the bundled trace) or ``agentic[:k=v,...]`` (synthetic);
    ``limit``: its first requests only (None: all)."""
    check_limit(limit, "--limit")
    if trace == "agentic" or trace.startswith("agentic:"):
        workload = generate(AgenticSpec.parse(trace), block_size=block_size, model=model)
        return workload.head(limit) if limit else workload
    return load_trace(
        trace, block_size=block_size, fmt=fmt, trace_block=trace_block, model=model, limit=limit
    )


def parse_policies(text: str) -> list[str]:
    """``all`` or a comma-separated list of policy names (unknown names -> ValueError)."""
    names = list(POLICY_NAMES) if text == "all" else [p.strip() for p in text.split(",") if p]
    bad = [n for n in names if n not in POLICY_NAMES]
    if bad or not names:
        raise ValueError(
            f"unknown policy {', '.join(bad) or text!r}; choose from all, {', '.join(POLICY_NAMES)}"
        )
    return names


def run_one(
    workload: Workload, config: ClusterConfig, spec: RunSpec, progress: Progress | None = None
) -> RunResult:
    started = time.perf_counter()
    if spec.cluster:
        config = replace(config, **spec.cluster)
    if spec.admission is not None:
        config = replace(config, admission=spec.admission)
    result = Simulation(
        workload, config, spec.policy, spec.params, speedup=spec.speedup, progress=progress
    ).run()
    result.summary["sim_s"] = round(time.perf_counter() - started, 3)
    result.summary["speedup"] = spec.speedup
    if spec.label:
        result.summary["label"] = spec.label
    return result


# Workers inherit these through fork instead of pickling the workload per task.
_SHARED: tuple[Workload, ClusterConfig] | None = None


def _worker(spec: RunSpec) -> RunResult:
    assert _SHARED is not None
    workload, config = _SHARED
    return run_one(workload, config, spec)


def run_many(
    workload: Workload,
    config: ClusterConfig,
    specs: Sequence[RunSpec],
    *,
    jobs: int = 1,
    on_done: Callable[[int, int], None] | None = None,
) -> list[RunResult]:
    """Run ``specs`` (in order of the returned list), ``jobs`` at a time in forked workers."""
    global _SHARED
    jobs = max(1, min(jobs, len(specs)))
    if jobs == 1 or "fork" not in multiprocessing.get_all_start_methods():
        results = []
        for i, spec in enumerate(specs):
            results.append(run_one(workload, config, spec))
            if on_done:
                on_done(i + 1, len(specs))
        return results
    _SHARED = (workload, config)
    try:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(jobs) as pool:
            results = []
            for i, res in enumerate(pool.imap(_worker, specs)):
                results.append(res)
                if on_done:
                    on_done(i + 1, len(specs))
    finally:
        _SHARED = None
    return results


def default_jobs() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def workload_ceilings(
    workload: Workload, config: ClusterConfig, order: Sequence[str] | None = None
) -> Ceilings:
    """Both ceilings over ``order`` (request ids as they arrived in a run; default: the
    workload's open-loop order)."""
    reqs = workload.requests
    if order:
        by_id = {r.request_id: r for r in reqs}
        reqs = [by_id[i] for i in order if i in by_id]
    return ceilings(reqs, config.capacity_blocks(), config.block_size)
