"""The figures of one live replay, as the demo and ``kvrouter bench live`` report them.

From the client's side of each request (router/demo/replay.py ``Outcome``): the share of
prompt tokens the engines reported cached (``hit``; ``kv_hit``: the mock's KV-only hit, before
the hybrid-state rule), the router's predicted usable hit where it told (kvrouter's decision
header) and ``error_p99``, the 99th percentile over requests of ``|predicted - reused| /
prompt`` (a prediction of the whole prompt counts as prompt - 1: engines always compute the
last token), TTFT and E2E percentiles, per-request TPOT (one sequence's:
``(last token - TTFT) / (output tokens / n - 1)``, ``Outcome.tpot_s``, as vLLM and the
simulator time it; TTFT and TPOT of the
answers streamed alone) and goodput: the share of *all* requests, failed ones included,
that met their SLO (router.core.slo; an answer not streamed judged by its E2E,
``Outcome.judged``). Times in milliseconds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from router.bench.measure import median_row, percentile
from router.core.slo import Answered, SloTargets, count_met, goodput_by_scale
from router.demo.replay import Outcome


def _pcts(values: Sequence[float], name: str, which: Sequence[int]) -> dict[str, float]:
    return {
        f"{name}_p{p}_ms": round(percentile(values, p), 1) if values else math.nan for p in which
    }


def summarize(outcomes: Sequence[Outcome], slo: SloTargets | None = None) -> dict[str, Any]:
    """``requests``, ``ok``, ``failed``, ``hit``, ``kv_hit``, ``predicted_hit``,
    ``error_p99``, ``goodput``, ``goodput_by_slo_scale`` (``router.core.slo.SLO_SCALES``),
    ``ttft_mean_ms``, ``ttft_p50/p90/p99_ms``, ``e2e_p50/p90/p99_ms``,
    ``tpot_p50/p90_ms``."""
    slo = slo or SloTargets()
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    answered: list[Answered] = [o.judged() for o in ok]
    tpots = [tpot * 1e3 for _, _, tpot in answered if tpot is not None]
    streamed = [o for o in ok if o.ttft_s == o.ttft_s]  # answers not streamed have no TTFT
    errors = [
        abs(min(o.predicted_tokens, o.prompt_tokens - 1) - o.cached_tokens) / o.prompt_tokens
        for o in ok
        if o.prompt_tokens
    ]

    def share(tokens: int) -> float:
        return round(tokens / prompt, 4) if prompt else 0.0

    out: dict[str, Any] = {
        "requests": len(outcomes),
        "ok": len(ok),
        "failed": len(outcomes) - len(ok),
        "hit": share(sum(o.cached_tokens for o in ok)),
        "kv_hit": share(sum(o.kv_hit_tokens for o in ok)),
        "predicted_hit": share(sum(o.predicted_tokens for o in ok)),
        "error_p99": round(percentile(errors, 99), 4) if errors else math.nan,
        "goodput": round(count_met(answered, slo) / len(outcomes), 4) if outcomes else 0.0,
        "goodput_by_slo_scale": goodput_by_scale(answered, len(outcomes), slo),
    }
    out["ttft_mean_ms"] = (
        round(statistics.fmean(o.ttft_s for o in streamed) * 1e3, 1) if streamed else math.nan
    )
    out.update(_pcts([o.ttft_s * 1e3 for o in streamed], "ttft", (50, 90, 99)))
    out.update(_pcts([o.e2e_s * 1e3 for o in ok], "e2e", (50, 90, 99)))
    out.update(_pcts(tpots, "tpot", (50, 90)))
    return out


TOTALS = ("requests", "ok", "failed")
SPREAD = ("hit", "goodput", "ttft_p50_ms", "ttft_p90_ms", "e2e_p90_ms", "tpot_p90_ms")


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of it (``kvrouter bench live --repeat``): ``requests``,
    ``ok`` and ``failed`` summed, every other figure the median of the runs, ``runs`` their
    number and ``spread`` the ``[min, max]`` of the headline figures (``median_row``), and
    the first three distinct ``errors``. A run that failed as a whole (``error``) is the
    row's answer."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return dict(failed)
    out = median_row(runs, totals=TOTALS, spread=SPREAD)
    if len(runs) > 1 and any("errors" in r for r in runs):
        out["errors"] = sorted({e for r in runs for e in r.get("errors", ())})[:3]
    return out
