"""Small measuring helpers shared by the benchmarks (they run at the edge, so clocks are fine)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as fh:
            pages = int(fh.read().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sample."""
    ordered = sorted(samples)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def emit(result: dict[str, Any]) -> None:
    """Print one JSON object on stdout (the benchmarks' contract)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
