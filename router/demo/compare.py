"""How sure a head-to-head is: ``kvrouter``'s figures over a peer's, with a paired bootstrap
interval.

Both routers replay the same requests (``kvrouter bench live``), so request ``i`` of a run of
one is request ``i`` of the matching run of the other: resampling *pairs* of them keeps what
the two runs share (the trace's long prompts, its bursts) out of the interval, which is then
about the routers alone. Runs are paired in order (the bench interleaves them) and pooled.

For each figure, ``ratio`` is ours over the peer's on the pooled pairs and ``ci95`` the 2.5th
and 97.5th percentiles of the same ratio over ``resamples`` resamplings of the pairs (seeded:
the same runs give the same interval). Latency percentiles are over answered requests (nearest
rank, as router/demo/figures.py; TPOT one sequence's), goodput over all of them, failed ones
as misses. An interval that holds 1 says the runs cannot tell the two routers apart on that
figure; one that lies past 1.05 says ours is more than 5 % worse (for latencies; for
goodput, below 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from router.bench.measure import nearest_rank
from router.core.slo import SloTargets
from router.demo.replay import Outcome

# figure -> (per-request value, percentile or None for a share)
FIGURES: dict[str, tuple[str, float | None]] = {
    "goodput": ("met", None),
    "ttft_p50_ms": ("ttft", 50.0),
    "ttft_p90_ms": ("ttft", 90.0),
    "e2e_p90_ms": ("e2e", 90.0),
    "tpot_p90_ms": ("tpot", 90.0),
}
RESAMPLES = 1000


def _columns(outcomes: Sequence[Outcome], slo: SloTargets) -> dict[str, np.ndarray]:
    """Per-request values: ``met`` (0/1), ``ttft`` / ``e2e`` / ``tpot`` (NaN where the request
    failed or, for TPOT, had at most one output token)."""
    nan = math.nan
    ttft, e2e, tpot, met = [], [], [], []
    for o in outcomes:
        t = o.tpot_s() if o.ok else None
        ttft.append(o.ttft_s if o.ok else nan)
        e2e.append(o.e2e_s if o.ok else nan)
        tpot.append(t if t is not None else nan)
        met.append(o.ok and slo.met(*o.judged()))
    return {
        "ttft": np.asarray(ttft) * 1e3,
        "e2e": np.asarray(e2e) * 1e3,
        "tpot": np.asarray(tpot) * 1e3,
        "met": np.asarray(met, dtype=np.float64),
    }


def _figure(values: np.ndarray, q: float | None) -> np.ndarray:
    """The figure along the last axis: the share of ones (``q`` None) or the ``q``th
    percentile of the non-NaN values."""
    if q is None:
        result: np.ndarray = values.mean(axis=-1)
        return result
    # the live figures' nearest rank (router.bench.measure), row by row over the known values
    ordered = np.sort(values, axis=-1)  # NaN last
    known = (~np.isnan(values)).sum(axis=-1)
    flat = ordered.reshape(-1, values.shape[-1])
    out = np.full(flat.shape[0], np.nan)
    for i, n in enumerate(known.reshape(-1).tolist()):
        if n:
            out[i] = flat[i, nearest_rank(n, q)]
    return out.reshape(known.shape)


def paired(
    ours: Sequence[Sequence[Outcome]],
    peer: Sequence[Sequence[Outcome]],
    slo: SloTargets,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, Any]:
    """``{figure: {"ratio", "ci95"}}`` for ``FIGURES``, plus ``pairs`` (requests compared),
    from runs of ours and of the peer over the same requests (see the module docstring).
    Empty without a pair of runs of equal length."""
    matched = [(a, b) for a, b in zip(ours, peer, strict=False) if a and len(a) == len(b)]
    if not matched:
        return {}
    mine = [_columns(a, slo) for a, _ in matched]
    theirs = [_columns(b, slo) for _, b in matched]
    n = sum(len(a) for a, _ in matched)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(resamples, n))
    out: dict[str, Any] = {"pairs": n}
    # a resample whose column is all NaN (every request in it failed) has no figure: numpy
    # warns, and it is left out
    with np.errstate(divide="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, (column, q) in FIGURES.items():
            a = np.concatenate([m[column] for m in mine])
            b = np.concatenate([t[column] for t in theirs])
            point = float(_figure(a, q) / _figure(b, q))
            spread = _figure(a[picks], q) / _figure(b[picks], q)
            spread = spread[np.isfinite(spread)]
            if not math.isfinite(point) or not spread.size:
                out[name] = {"ratio": None, "ci95": None}
                continue
            lo, hi = np.percentile(spread, [2.5, 97.5])
            out[name] = {"ratio": round(point, 4), "ci95": [round(lo, 4), round(hi, 4)]}
    return out
