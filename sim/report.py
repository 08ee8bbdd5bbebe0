"""Presenting runs: the side-by-side terminal table, matplotlib PNG plots and an HTML page
that bundles them (plots embedded as files next to it, so the directory is self-contained)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from router.core.errors import KVRouterError
from sim.cluster_config import RunResult

_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("policy", "policy", "{}"),
    ("token_hit_rate", "hit%", "{:.1%}"),
    ("kv_token_hit_rate", "kv hit%", "{:.1%}"),
    ("of_lru_ceiling", "of LRU", "{:.1%}"),
    ("goodput", "goodput", "{:.1%}"),
    ("ttft_ms_p50", "TTFT p50", "{:.0f}"),
    ("ttft_ms_p90", "TTFT p90", "{:.0f}"),
    ("ttft_ms_p99", "TTFT p99", "{:.0f}"),
    ("tpot_ms_p50", "TPOT p50", "{:.1f}"),
    ("tpot_ms_p90", "TPOT p90", "{:.1f}"),
    ("e2e_ms_p50", "E2E p50", "{:.0f}"),
    ("e2e_ms_p90", "E2E p90", "{:.0f}"),
    ("queue_ms_p90", "queue p90", "{:.0f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("utilisation_imbalance", "imbal", "{:.2f}"),
    ("sim_s", "sim s", "{:.2f}"),
)


def _cell(fmt: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return fmt.format(value)
    except (ValueError, TypeError):
        return str(value)


def table(summaries: Sequence[Mapping[str, Any]], ceilings: Mapping[str, float]) -> str:
    """Policies side by side (times in ms), with the ceilings underneath."""
    rows = [[title for _, title, _ in _COLUMNS]]
    for s in summaries:
        rows.append([_cell(fmt, s.get(key)) for key, _, fmt in _COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=False))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"ceilings: infinite cache {ceilings.get('ceiling_infinite', 0):.1%}, "
        f"global LRU (cluster capacity) {ceilings.get('ceiling_global_lru', 0):.1%}"
    )
    return "\n".join(lines)


PLOTTING_MISSING = (
    "plots need matplotlib, which the router does not install: pip install 'kvrouter[sim]'"
)


def require_plotting() -> None:
    """Raise a clear ``KVRouterError`` when matplotlib (the ``sim`` extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise KVRouterError(PLOTTING_MISSING)


def _plt() -> Any:
    require_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_ttft_cdf(runs: Sequence[RunResult], path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        xs = sorted(v * 1000 for v in run.ttft_s)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=run.summary.get("label") or run.policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(runs: Sequence[RunResult], path: Path) -> None:
    """Hit rate and p90 TTFT against arrival speed-up, one line per policy."""
    plt = _plt()
    by_policy: dict[str, list[tuple[float, float, float]]] = {}
    for run in runs:
        s = run.summary
        by_policy.setdefault(run.policy, []).append(
            (float(s["speedup"]), float(s["token_hit_rate"]), float(s["ttft_ms_p90"]))
        )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, pts in by_policy.items():
        pts.sort()
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
    ax1.set_xlabel("arrival speed-up")
    ax1.set_ylabel("token hit rate")
    ax1.set_title("hit rate vs load")
    ax2.set_xlabel("arrival speed-up")
    ax2.set_ylabel("p90 TTFT (ms, log scale)")
    ax2.set_yscale("log")
    ax2.set_title("p90 TTFT vs load")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load(run: RunResult, path: Path) -> None:
    """Requests in flight on every replica over time, for one run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for name, series in zip(run.replica_names, run.load_series, strict=False):
        if series:
            ax.step(
                [t for t, _ in series],
                [n for _, n in series],
                where="post",
                label=name,
                linewidth=0.8,
            )
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests on replica")
    ax.set_title(f"per-replica load over time ({run.policy})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out_dir: Path,
    main_runs: Sequence[RunResult],
    sweep_runs: Sequence[RunResult],
    document: Mapping[str, Any],
    table_text: str,
) -> list[Path]:
    """Write the PNGs, ``summary.json`` and ``index.html`` into ``out_dir``; return paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    cdf = out_dir / "ttft_cdf.png"
    plot_ttft_cdf(main_runs, cdf)
    written.append(cdf)
    sweep = out_dir / "speedup_sweep.png"
    if sweep_runs:
        plot_sweep(sweep_runs, sweep)
        written.append(sweep)
    load_run = next((r for r in main_runs if r.policy == "ours"), main_runs[0])
    load = out_dir / "replica_load.png"
    plot_load(load_run, load)
    written.append(load)
    summary = out_dir / "summary.json"
    summary.write_text(json.dumps(document, indent=2) + "\n")
    written.append(summary)
    imgs = "\n".join(
        f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>{p.stem}</figcaption></figure>'
        for p in written
        if p.suffix == ".png"
    )
    settings = html.escape(json.dumps(document.get("settings", {}), indent=2))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvrouter simulation report</title>
<style>body{{font-family:sans-serif;max-width:1200px;margin:2em auto}}
pre{{background:#f4f4f4;padding:1em;overflow-x:auto}}img{{max-width:100%}}</style></head>
<body><h1>kvrouter simulation report</h1>
<p>Trace <code>{html.escape(str(document.get("trace", "")))}</code>,
{html.escape(str(document.get("requests", "")))} requests.</p>
<h2>Policies side by side</h2><pre>{html.escape(table_text)}</pre>
{imgs}
<h2>Settings</h2><pre>{settings}</pre>
<p>Full figures: <a href="summary.json">summary.json</a>.</p>
</body></html>
"""
    index = out_dir / "index.html"
    index.write_text(page)
    written.append(index)
    return written
