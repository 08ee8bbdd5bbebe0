"""Small measuring helpers shared by the benchmarks (they run at the edge, so clocks are fine)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            pages = int(fh.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def nearest_rank(n: int, q: float) -> int:
    """The index, in a sorted sample of ``n`` values, of its ``q``th percentile (q in
    [0, 100]), nearest rank: the one percentile rule of every figure (the live bench's, the
    simulator's, the overload bench's, a head-to-head's bootstrap)."""
    return min(n - 1, max(0, round(q / 100 * (n - 1))))


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[nearest_rank(len(ordered), q)]


def percentiles(samples: Sequence[float], qs: Sequence[float]) -> list[float]:
    """:func:`percentile` of a non-empty sample at each of ``qs`` (sorted once)."""
    ordered = sorted(samples)
    return [ordered[nearest_rank(len(ordered), q)] for q in qs]


def median_row(
    runs: Sequence[dict[str, Any]],
    *,
    totals: Sequence[str] = (),
    spread: Sequence[str] = (),
) -> dict[str, Any]:
    """One row of figures from several runs of the same thing: the ``totals`` keys summed,
    every other number the runs' median (a dict of numbers, key by key), any other value
    kept where all runs agree on it; ``runs`` their number and ``spread`` the ``[min, max]``
    of the ``spread`` keys. A NaN figure (e.g. a TTFT percentile of a run that answered no
    request) counts as the run not having it. One run is returned as it is. Why medians: a
    closed loop or a fleet past its capacity turns a millisecond into another schedule, so
    one run is one sample and cannot rank two configurations."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in runs for k in r):
        values = [r[key] for r in runs if key in r]
        if key in totals:
            out[key] = sum(values)
        elif all(_number(v) for v in values):
            out[key] = median(values)
        elif all(isinstance(v, dict) for v in values):
            inner = [k for k in values[0] if all(k in v and _number(v[k]) for v in values)]
            out[key] = {k: median([v[k] for v in values]) for k in inner}
        elif len(values) == len(runs) and all(v == values[0] for v in values):
            out[key] = values[0]
    out["runs"] = len(runs)
    out["spread"] = {}
    for key in spread:
        if all(key in r for r in runs):
            known = [r[key] for r in runs if r[key] == r[key]]
            out["spread"][key] = [min(known), max(known)] if known else [math.nan, math.nan]
    return out


def median(values: Sequence[float]) -> float:
    """The median of the values that are not NaN (NaN if none is), to 4 decimals:
    ``statistics.median`` sorts a NaN anywhere, so the result would depend on the runs'
    order."""
    known = [v for v in values if v == v]
    return round(statistics.median(known), 4) if known else math.nan


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_text(
    document: Any, indent: int | None = None, default: Callable[[Any], Any] | None = None
) -> str:
    """``document`` as strict JSON: a figure that is no number (NaN, an infinity: a
    percentile of no sample) is ``null``, which every JSON parser reads (``NaN`` is no
    JSON: RFC 8259 6)."""
    return json.dumps(_finite(document), indent=indent, allow_nan=False, default=default)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def emit(result: dict[str, Any]) -> None:
    """Print one JSON object on stdout (the benchmarks' contract)."""
    sys.stdout.write(json_text(result) + "\n")
    sys.stdout.flush()


def use_uvloop() -> None:
    """Run the bench's event loops on uvloop, as ``kvrouter serve`` does, where installed."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
