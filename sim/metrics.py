"""Per-run metrics and the two cache ceilings every report carries.

Definitions (all times from the request's arrival at a router; percentiles are nearest rank,
as the live bench's). A request is what its client sent: the rows of one completions batch
(sim/fanout.py) are one request, as the live figures count and judge it (:func:`answers`:
one TTFT, E2E and TPOT, its summed prompt's SLO tier, one count in ``requests`` and in
goodput's denominator); the token figures sum every row's.

* TTFT: first token time - arrival. ITL: (finish - first token) / (output tokens - 1) (the
  finish is the last token's time, as the service and the live replay time TPOT), one
  value per request with more than one output token; ``tpot_ms_*`` are the same figures under
  the name the SLO uses (TPOT). Both over streamed answers only, as the live figures
  (router/demo/figures.py): a request not streamed (a recorded row's ``stream: false``)
  reaches its client whole, so the SLO judges it by its E2E and not its TPOT
  (``router.core.slo.answered_as``). E2E: finish - arrival. Queueing delay: time a request waited
  in its engine's queue before admission.
* ``goodput``: share of all requests that met their SLO (``router.core.slo``: TTFT within
  the target of their prompt's tier, times their service class's ``ttft_factor`` under
  admission, TPOT within the TPOT target); rejected or shed requests did not.
  ``slo_attainment``: the same per service class (``priority``, ``default``, ``flex``).
  ``router_wait_ms_*``: time between arrival and dispatch (held by admission).
  ``slo_ttft_met`` / ``slo_tpot_met``: the share meeting each half; ``goodput_by_tier``: the
  goodput of each prompt tier's requests; ``goodput_by_slo_scale``: goodput with every target
  scaled by 0.25, 0.5, 1 and 2 (``router.core.slo.SLO_SCALES``; "1" is ``goodput``).
* ``token_hit_rate``: prompt tokens the engines actually reused (the *usable* hit: hybrid
  rule applied, whole engine blocks before the prompt's last token, which is recomputed with
  its block) over all prompt tokens of completed requests. ``kv_token_hit_rate``: same with
  the KV-only hit.
* Utilisation of a replica: time it spent running steps / the run's makespan. Imbalance:
  max / mean of the per-replica utilisations (1.0 is perfectly even).
* ``ceiling_infinite``: hit rate of one cache that never evicts, fed the requests in arrival
  order. ``ceiling_global_lru``: one LRU cache with the cluster's total KV capacity, fed the
  same way (blocks touched tail first so children are evicted before parents). Both ignore
  timing (a block is reusable as soon as its request arrived) and the hybrid-state rule, so
  they bound what any routing policy can reach on the KV side.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from router.bench.measure import percentiles
from router.core.admission import CLASS_NAMES
from router.core.slo import (
    Answered,
    SloTargets,
    answered_as,
    goodput_by_scale,
    sequence_tokens,
    tpot_s,
)
from sim.workload import SimRequest, by_batch


class RequestRecord:
    """What happened to one request in a run (times in seconds, NaN until known)."""

    __slots__ = (
        "arrival",
        "batch",
        "cached",
        "finish",
        "first",
        "klass",
        "kv_hit",
        "output",
        "prompt",
        "queued",
        "rejected",
        "replica",
        "request_id",
        "samples",
        "sent",
        "stream",
    )

    def __init__(self, request_id: str, arrival: float, prompt: int, replica: int) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.prompt = prompt
        self.replica = replica
        self.first = float("nan")
        self.finish = float("nan")
        self.cached = 0
        self.kv_hit = 0
        self.queued = 0.0
        self.output = 0  # one sequence's output tokens
        self.samples = 1  # the sequences it sampled (``n``), each of ``output`` tokens
        self.rejected = False
        self.klass = 1  # service class (router/core/admission.py): default
        self.sent = arrival  # when the router dispatched it (later if admission held it)
        self.stream = True  # its answer streamed (else its client gets it whole at the end)
        self.batch: str | None = None  # a completions batch's row: the batch's first row's id


def answers(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The requests as their clients saw them, in order of their first record: a record
    alone, or the rows of one completions batch (one ``batch``) as the one answer the
    live replay measures (router/demo/replay.py ``Outcome``): its rows' prompt, cached and
    KV-hit tokens summed, its first token the first of any row's, its end the last row's
    (none while any row has none), rejected when any row was, one sequence's output tokens
    as its usage tells them (``router.core.slo.sequence_tokens`` over all its sequences),
    its engine queueing the longest of its rows'."""
    groups = by_batch(records, lambda r: r.batch)
    return [rows[0] if len(rows) == 1 else _one_answer(rows) for rows in groups]


def _one_answer(rows: Sequence[RequestRecord]) -> RequestRecord:
    head = rows[0]
    out = RequestRecord(head.request_id, head.arrival, sum(r.prompt for r in rows), head.replica)
    firsts = [r.first for r in rows if r.first == r.first]
    out.first = min(firsts) if firsts else float("nan")
    finishes = [r.finish for r in rows]
    out.finish = max(finishes) if all(f == f for f in finishes) else float("nan")
    out.cached = sum(r.cached for r in rows)
    out.kv_hit = sum(r.kv_hit for r in rows)
    out.queued = max(r.queued for r in rows)
    out.samples = sum(r.samples for r in rows)
    out.output = sequence_tokens(sum(r.output * r.samples for r in rows), out.samples)
    out.rejected = any(r.rejected for r in rows)
    out.klass, out.sent, out.stream = head.klass, head.sent, head.stream
    return out


def _pcts(values: Sequence[float], prefix: str, scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {
            f"{prefix}_p50": float("nan"),
            f"{prefix}_p90": float("nan"),
            f"{prefix}_p99": float("nan"),
            f"{prefix}_mean": float("nan"),
        }
    arr = np.asarray(values, dtype=float) * scale
    # nearest rank: the live figures' function (router.bench.measure), not a copy of it
    p50, p90, p99 = percentiles(arr.tolist(), (50, 90, 99))
    return {
        f"{prefix}_p50": round(p50, 3),
        f"{prefix}_p90": round(p90, 3),
        f"{prefix}_p99": round(p99, 3),
        f"{prefix}_mean": round(float(arr.mean()), 3),
    }


def slo_figures(
    records: Sequence[RequestRecord],
    slo: SloTargets,
    ttft_factor: Sequence[float] = (1.0, 1.0, 1.0),
) -> dict[str, object]:
    """Goodput and the share meeting each half of the SLO, over all ``records``; a request's
    TTFT target is its tier's times its class's ``ttft_factor`` (flex traffic is promised
    a longer one). ``slo_attainment``: goodput per class (None for a class without
    requests)."""
    n = len(records)
    ttft_ok = tpot_ok = both = 0
    tiers: dict[str, list[int]] = {t.label: [0, 0] for t in slo.tiers}
    classes = [[0, 0] for _ in CLASS_NAMES]
    # each answered request with its TTFT over its class's factor, for the SLO scales
    answered: list[Answered] = []
    for r in records:
        counts = tiers[slo.tier(r.prompt).label]
        counts[1] += 1
        per_class = classes[r.klass]
        per_class[1] += 1
        if r.rejected or r.finish != r.finish:
            continue
        prompt, ttft, tpot = answered_as(
            r.prompt, r.first - r.arrival, r.finish - r.arrival, r.output, r.stream
        )
        answered.append((prompt, ttft / ttft_factor[r.klass], tpot))
        _, a, b = slo.judge(prompt, ttft, tpot, ttft_factor[r.klass])
        ttft_ok += a
        tpot_ok += b
        if a and b:
            both += 1
            counts[0] += 1
            per_class[0] += 1
    return {
        "goodput": round(both / n, 5) if n else 0.0,
        "goodput_by_slo_scale": goodput_by_scale(answered, n, slo),
        "slo_ttft_met": round(ttft_ok / n, 5) if n else 0.0,
        "slo_tpot_met": round(tpot_ok / n, 5) if n else 0.0,
        "goodput_by_tier": {k: round(m / c, 5) for k, (m, c) in tiers.items() if c},
        "slo_attainment": {
            name: (round(m / c, 5) if c else None)
            for name, (m, c) in zip(CLASS_NAMES, classes, strict=True)
        },
        "requests_by_class": {name: c for name, (_, c) in zip(CLASS_NAMES, classes, strict=True)},
    }


def summarize(
    records: Iterable[RequestRecord],
    busy_s: Sequence[float],
    replica_names: Sequence[str],
    slo: SloTargets | None = None,
    ttft_factor: Sequence[float] = (1.0, 1.0, 1.0),
) -> dict[str, object]:
    """The per-run figures (see the module doc), as a JSON-ready dict."""
    rows = list(records)
    recs = answers(rows)  # a completions batch's rows as its one answer
    done = [r for r in recs if not r.rejected and r.finish == r.finish]
    answered = {r.request_id for r in done}  # a batch's: its first row's
    output = sum(r.output * r.samples for r in rows if (r.batch or r.request_id) in answered)
    prompt = sum(r.prompt for r in done)
    start = min((r.arrival for r in recs), default=0.0)
    end = max((r.finish for r in done), default=start)
    makespan = max(end - start, 1e-9)
    util = [b / makespan for b in busy_s]
    mean_util = sum(util) / len(util) if util else 0.0
    per_replica = [0] * len(replica_names)
    for r in recs:
        if r.replica >= 0:
            per_replica[r.replica] += 1
    out: dict[str, object] = {
        "requests": len(recs),
        "completed": len(done),
        "rejected": sum(1 for r in recs if r.rejected),
        "token_hit_rate": round(sum(r.cached for r in done) / prompt, 5) if prompt else 0.0,
        "kv_token_hit_rate": round(sum(r.kv_hit for r in done) / prompt, 5) if prompt else 0.0,
    }
    # TTFT and ITL of the streamed answers alone, as the live figures (router/demo/figures.py):
    # a client gets an answer not streamed whole
    streamed = [r for r in done if r.stream]
    out.update(_pcts([r.first - r.arrival for r in streamed], "ttft_ms"))
    # one sequence's TPOT, first token to last (the finish): router.core.slo's, not a copy
    tpots = [tpot_s(r.finish, r.first, r.output) for r in streamed]
    itl = _pcts([t for t in tpots if t is not None], "itl_ms")
    out.update(itl)
    out.update({"tpot" + k[3:]: v for k, v in itl.items()})
    out.update(_pcts([r.finish - r.arrival for r in done], "e2e_ms"))
    out.update(_pcts([r.queued for r in done], "queue_ms"))
    out.update(_pcts([r.sent - r.arrival for r in recs if r.replica >= 0], "router_wait_ms"))
    out.update(slo_figures(recs, slo or SloTargets(), ttft_factor))
    out.update(
        {
            "makespan_s": round(makespan, 3),
            "throughput_rps": round(len(done) / makespan, 4),
            "output_tokens_per_s": round(output / makespan, 2),
            "prompt_tokens_per_s": round(prompt / makespan, 2),
            "replica_utilisation": [round(u, 4) for u in util],
            "utilisation_imbalance": round(max(util) / mean_util, 4) if mean_util > 0 else 1.0,
            "requests_per_replica": per_replica,
        }
    )
    return out


@dataclass(slots=True, frozen=True)
class Ceilings:
    infinite: float
    global_lru: float
    capacity_blocks: int


def ceilings(requests: Iterable[SimRequest], capacity_blocks: int, block_size: int) -> Ceilings:
    """Hit rates of an infinite cache and of one LRU of ``capacity_blocks`` (module doc)."""
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    move = lru.move_to_end
    inf_hit = lru_hit = total = 0
    for r in requests:
        hashes = r.block_hashes
        n = len(hashes)
        k = 0
        while k < n and hashes[k] in seen:
            k += 1
        inf_hit += min(k * block_size, r.prompt_tokens)
        k = 0
        while k < n and hashes[k] in lru:
            k += 1
        lru_hit += min(k * block_size, r.prompt_tokens)
        total += r.prompt_tokens
        chain = list(hashes) + list(r.output_block_hashes)
        seen.update(chain)
        for h in reversed(chain):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    if not total:
        return Ceilings(0.0, 0.0, capacity_blocks)
    return Ceilings(round(inf_hit / total, 5), round(lru_hit / total, 5), capacity_blocks)
