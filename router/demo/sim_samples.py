"""The simulator's prediction over several samples of a bench workload (``kvrouter bench live
--sim-samples N``).

One trace of a few hundred requests ranks policies by luck: its percentiles rest on a few
dozen requests, and a small change of weights moves them by more than routers differ. So a
what-if is judged on ``N`` samples of the same shape: the workload's own trace and further
ones, namely the generator's next seeds for an ``agentic:`` workload, or the next windows of
``requests`` consecutive rows of a Mooncake trace (timestamps rebased to 0). Each policy runs
on every sample; the summary gives each figure's mean over the samples and, for every other
policy, ``ours`` over that policy per sample (mean, min, max): a ratio whose whole range lies
on one side of 1 is a difference the samples agree on.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from router.core.slo import scale_label

if TYPE_CHECKING:
    from router.demo.live_bench import Workload

FIGURES = (
    "hit",
    "goodput",
    "goodput_half",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "e2e_p90_ms",
    "tpot_p90_ms",
)


def samples(
    workload: Workload,
    trace: Path,
    n: int,
    directory: Path,
    write_agentic: Callable[[Workload, Path], Path],
) -> list[tuple[str, Workload, Path]]:
    """``n`` samples ``(name, workload, trace file)`` of ``workload`` whose own trace file is
    ``trace``, that one first; ``write_agentic(workload, directory)`` writes an agentic
    workload's trace."""
    if workload.trace.startswith("agentic"):
        from sim.agentic import AgenticSpec

        seed = AgenticSpec.parse(workload.trace).seed
        out = [(f"seed={seed}", workload, trace)]
        for k in range(1, n):
            # a later key overrides an earlier one
            joint = "," if ":" in workload.trace else ":"
            spec = f"{workload.trace}{joint}seed={seed + k}"
            other = dataclasses.replace(workload, trace=spec)
            where = directory / f"sample-{k}"
            where.mkdir()
            out.append((f"seed={seed + k}", other, write_agentic(other, where)))
        return out
    rows = trace.read_text().splitlines()
    size = workload.requests
    windows: list[tuple[str, Workload, Path]] = []
    for k in range(min(n, max(len(rows) // size, 1))):
        window = [json.loads(line) for line in rows[k * size : (k + 1) * size]]
        start = window[0]["timestamp"]
        path = directory / f"window-{k}.jsonl"
        with path.open("w") as fh:
            for row in window:
                fh.write(json.dumps({**row, "timestamp": row["timestamp"] - start}) + "\n")
        windows.append((f"rows {k * size}-{k * size + len(window) - 1}", workload, path))
    return windows


def summarize(
    results: Mapping[str, Sequence[dict[str, Any]]], names: Sequence[str]
) -> dict[str, Any]:
    """``results``: per policy (``kvrouter_ours`` first), its figures on each sample (the
    simulator's prediction rows, with ``goodput_by_slo_scale``)."""

    def value(row: dict[str, Any], figure: str) -> float:
        if figure == "goodput_half":
            return float(row["goodput_by_slo_scale"][scale_label(0.5)])
        return float(row[figure])

    out: dict[str, Any] = {"samples": list(names), "mean": {}, "ours_over": {}}
    ours = results.get("kvrouter_ours")
    for policy, rows in results.items():
        out["mean"][policy] = {
            f: round(statistics.mean(value(r, f) for r in rows), 4) for f in FIGURES
        }
        if ours is None or policy == "kvrouter_ours":
            continue
        ratios: dict[str, Any] = {}
        for f in FIGURES:
            each = [
                value(a, f) / value(b, f) for a, b in zip(ours, rows, strict=True) if value(b, f)
            ]
            if each:
                ratios[f] = {
                    "mean": round(statistics.mean(each), 4),
                    "min": round(min(each), 4),
                    "max": round(max(each), 4),
                }
        out["ours_over"][policy] = ratios
    return out
