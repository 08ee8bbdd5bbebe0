"""``kvrouter bench route``: the routing step's cost per request as the fleet grows.

One model served by N replicas (a region of NVL72 racks has ~900), in the pure core:
every replica holds a shared 16-block system prompt, most also hold a few agent sessions
(200-2,000-block chains), the load model has requests in flight (some already decoding) and
a third of the replicas have a fresh engine report. Each measured request is a session
continuation or a new session; a request is ``candidates`` + ``choose`` + ``dispatched``
(speculative entries) and its completion, as the service runs it.

Both shapes of the candidates are timed on the same fleet and requests: ``per_candidate_us``
(one ``Candidate`` per replica) and ``arrays_us`` (``CandidateColumns``, numpy), with the
one the router picks by default for that size (``COLUMNAR_MIN``), and a check that both
decided alike on every measured request. Figures: median over ``--rounds`` rounds of
microseconds per request.

``pd_decode_per_candidate_us`` / ``pd_decode_arrays_us``: the decode pick of a disaggregated
request (``Disaggregator.pick_decode``) on the same fleet split into prefill and decode
replicas (every third prefills), 9 replicas a rack, both paths, with the same check.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from router.bench.measure import emit
from router.cliargs import at_least, sizes
from router.core.disagg import Disaggregator, PdKnobs, Role, Site
from router.core.index import PrefixIndex
from router.core.load import CostModel, EngineReport, LoadTracker
from router.core.policies import Ours
from router.core.routing import COLUMNAR_MIN, RoutingEngine
from router.core.routing_settings import RoutingSettings
from router.core.types import ReplicaKey, RouteRequest

BLOCK = 64


def _fleet(
    n: int, seed: int
) -> tuple[PrefixIndex, LoadTracker, tuple[ReplicaKey, ...], list[list[int]]]:
    rng = random.Random(seed)
    index, load = PrefixIndex(), LoadTracker()
    keys = tuple(ReplicaKey(f"r{i:04d}") for i in range(n))
    system = [rng.getrandbits(63) for _ in range(16)]
    sessions: list[list[int]] = []
    for key in keys:
        index.add_replica(key)
        load.add_replica(key)
        index.store(key, system)
        for _ in range(rng.randrange(0, 4)):
            chain = system + [rng.getrandbits(63) for _ in range(rng.randrange(200, 2000))]
            index.store(key, chain)
            sessions.append(chain)
    for i in range(3 * n):
        key = rng.choice(keys)
        prompt = rng.randrange(1000, 60000)
        load.dispatch(f"bg{i}", key, prompt, rng.randrange(0, prompt))
        if rng.random() < 0.6:
            load.first_token(f"bg{i}")
    for key in keys[::3]:
        load.engine_report(key, EngineReport(rng.randrange(0, 16), rng.randrange(0, 8), 0.5, 0.0))
    return index, load, keys, sessions


def _requests(sessions: list[list[int]], count: int, seed: int) -> list[RouteRequest]:
    rng = random.Random(seed + 1)
    out = []
    for i in range(count):
        base = rng.choice(sessions) if sessions and rng.random() < 0.7 else sessions[0][:16]
        chain = base + [rng.getrandbits(63) for _ in range(rng.randrange(1, 50))]
        out.append(RouteRequest(f"q{i}", "m", len(chain) * BLOCK + 10, chain, BLOCK))
    return out


def _per_request_us(
    requests: list[RouteRequest], rounds: int, step: Callable[[int, RouteRequest], ReplicaKey]
) -> tuple[float, list[ReplicaKey]]:
    """Median over ``rounds`` of the microseconds ``step`` takes a request, and the replicas
    it chose in the last round."""
    samples = []
    chosen: list[ReplicaKey] = []
    for r in range(rounds):
        chosen = []
        t0 = time.perf_counter()
        # (the clock goes on across rounds, as the service's does: one step a request)
        for i, req in enumerate(requests, r * len(requests)):
            chosen.append(step(i, req))
        samples.append((time.perf_counter() - t0) / len(requests) * 1e6)
    return round(statistics.median(samples), 2), chosen


def _time(
    engine: RoutingEngine, keys: tuple[ReplicaKey, ...], requests: list[RouteRequest], rounds: int
) -> tuple[float, list[ReplicaKey]]:
    """The routing step of each request, as the service runs it."""
    rng = random.Random(0)

    def step(i: int, req: RouteRequest) -> ReplicaKey:
        now = float(i)
        decision = engine.choose(req, engine.candidates(req, keys, now), now, rng)
        engine.dispatched(req, decision, now)
        engine.load.complete(req.request_id)
        return decision.replica

    return _per_request_us(requests, rounds, step)


def _time_pd(
    engine: RoutingEngine, keys: tuple[ReplicaKey, ...], requests: list[RouteRequest], rounds: int
) -> tuple[float, list[ReplicaKey]]:
    """The decode pick of each request prefilled on the prefill replicas in turn."""
    roles = {k: Role.PREFILL if i % 3 == 0 else Role.DECODE for i, k in enumerate(keys)}
    sites = {k: Site("reg0", f"rack{i // 9}") for i, k in enumerate(keys)}
    pd = Disaggregator(PdKnobs(mode="always"), CostModel(), roles=roles, sites=sites)
    prefill = [k for k in keys if roles[k] is Role.PREFILL]
    rng = random.Random(0)

    def step(i: int, req: RouteRequest) -> ReplicaKey:
        pick = pd.pick_decode(engine, req, prefill[i % len(prefill)], keys, float(i), rng)
        return pick.decision.replica

    return _per_request_us(requests, rounds, step)


Timer = Callable[
    [RoutingEngine, tuple[ReplicaKey, ...], list[RouteRequest], int], tuple[float, list[ReplicaKey]]
]


def _both_paths(args: argparse.Namespace, n: int, timer: Timer) -> tuple[float, float, bool]:
    """``timer`` per candidate and on arrays, each on a fresh fleet of ``n`` (speculative
    entries of one must not help the other): both figures, and whether they chose alike."""
    timed = []
    for columnar_min in (10**9, 1):
        index, load, keys, sessions = _fleet(n, args.seed)
        requests = _requests(sessions, args.requests, args.seed)
        settings = RoutingSettings(block_size=BLOCK)
        engine = RoutingEngine(index, load, Ours(), settings, columnar_min=columnar_min)
        timed.append(timer(engine, keys, requests, args.rounds))
    (per_candidate, chosen), (arrays, chosen_too) = timed
    return per_candidate, arrays, chosen == chosen_too


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for n in args.replicas:
        figures: dict[str, Any] = {"replicas": n}
        per_candidate, arrays, same = _both_paths(args, n, _time)
        figures.update(per_candidate_us=per_candidate, arrays_us=arrays)
        figures["default"] = "arrays" if n >= COLUMNAR_MIN else "per_candidate"
        figures["same_decisions"] = same
        per_candidate, arrays, same = _both_paths(args, n, _time_pd)
        figures.update(pd_decode_per_candidate_us=per_candidate, pd_decode_arrays_us=arrays)
        figures["same_pd_decisions"] = same
        rows.append(figures)
    emit(
        {
            "bench": "route",
            "policy": "ours",
            "columnar_min": COLUMNAR_MIN,
            "requests": args.requests,
            "rounds": args.rounds,
            "fleets": rows,
        }
    )
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("route", help="routing cost per request vs fleet size (both code paths)")
    p.add_argument("--replicas", type=sizes, default=[4, 16, 32, 64, 256, 900])
    p.add_argument("--requests", type=at_least(1), default=300, help="requests per round")
    p.add_argument("--rounds", type=at_least(1), default=5)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=run)
