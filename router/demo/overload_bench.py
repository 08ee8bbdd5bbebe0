"""``kvrouter bench overload``: the router in front of mock replicas driven past saturation,
SLO-aware admission off and on (router/service/admission.py), one JSON object.

Each row starts its own fleet (``--replicas`` mock replicas of ``--profile``, real processes,
KV events over ZMQ) and a router whose cost model is the profile's (``policy_params.cost``:
without it the router would misjudge TTFT and admit what then misses) and whose SLO is the
default one; then replays the first ``--requests`` rows of the bundled Mooncake trace open
loop at ``--speedup`` x their arrival rate, a ``--priority-share`` / ``--flex-share`` of
them with ``service_tier`` ``priority`` / ``flex``. ``--time-scale`` runs the mocks faster
(0.05: 20x) with the router's cost model, the SLO and the arrivals scaled to match.

Per row: ``served`` (200 and a complete stream), ``refused`` (429/503), how many of those
carried ``Retry-After``, ``lost`` (anything else: errors, cut streams; must be 0),
``goodput`` (share of all requests that met their class's SLO, as the client measured),
``slo_attainment`` per class, the refusal latency (request sent -> refusal received) and
the served requests' TTFT / TPOT (percentiles nearest rank, as ``kvrouter bench live``'s and
the simulator's). Each answer is read and judged as ``kvrouter bench live`` does it
(router/demo/replay.py ``read_answer``, ``Outcome.judged``): TTFT at the first event that
carries a token (not a keep-alive, an empty or usage-only chunk), TPOT from the first token
to the last (not to ``[DONE]``, router.core.slo), a stream without its usage or its end a
loss. Figures of a shared machine: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from router.bench.measure import percentile
from router.cliargs import at_least, fraction, positive_float
from router.core.admission import CLASS_NAMES, class_of, class_ttft_factor
from router.core.slo import SloTargets
from router.demo.replay import Outcome

TRACE = Path(__file__).resolve().parents[2] / "sim" / "traces" / "mooncake_synthetic_trace.jsonl"


@dataclass(slots=True)
class Result:
    """One request as the client saw it: refused (``status`` 429 / 503, ``retry_after``,
    the error ``code``), or answered (``answer``: the live bench's reading of it,
    router/demo/replay.py ``read_answer``, timed and judged as every live figure is)."""

    klass: int
    status: int = 0
    retry_after: bool = False
    code: str = ""
    elapsed_s: float = float("nan")  # to the refusal, or to the answer's end
    answer: Outcome | None = None
    error: str = ""

    @property
    def served(self) -> bool:
        return self.status == 200 and self.answer is not None and self.answer.ok


def router_toml(
    port: int, model: str, replicas: list[dict[str, str]], profile: str, scale: float, slo: bool
) -> str:
    from sim.profiles import load_profile

    cost = asdict(load_profile(profile).cost)
    for k, v in list(cost.items()):
        if k != "chunk_tokens":
            cost[k] = v * scale
    targets = SloTargets().scaled(scale)
    tiers = ",".join(
        f"{'*' if t.max_prompt_tokens is None else t.max_prompt_tokens}:{t.ttft_s:g}"
        for t in targets.tiers
    )
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        'log_level = "warning"',
        "",
        f'[models."{model}"]',
        'policy = "ours"',
        "block_size = 64",
        f'[models."{model}".slo]',
        f'ttft_tiers = "{tiers}"',
        f"tpot_s = {targets.tpot_s!r}",
        f'[models."{model}".policy_params.cost]',
        *(f"{k} = {v!r}" for k, v in cost.items()),
    ]
    if slo:
        lines += [f'[models."{model}".admission]', "enabled = true"]
    for rep in replicas:
        lines += ["", "[[replicas]]"] + [f'{k} = "{v}"' for k, v in rep.items()]
    return "\n".join(lines) + "\n"


async def _one(session: Any, url: str, body: bytes, klass: int) -> Result:
    import aiohttp

    from router.demo.replay import read_answer

    r = Result(klass)
    t0 = time.perf_counter()
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.elapsed_s = time.perf_counter() - t0
                r.retry_after = "Retry-After" in resp.headers
                try:
                    r.code = str((await resp.json())["error"]["code"])
                except (ValueError, KeyError, TypeError, aiohttp.ContentTypeError):
                    r.code = "unparsed"
                return r
            # TTFT at the first token, TPOT to the last, as the live bench (module doc)
            r.answer = await read_answer(resp, Outcome(True), t0)
            r.elapsed_s = r.answer.e2e_s
            r.error = r.answer.error
    except (aiohttp.ClientError, TimeoutError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    return r


async def _replay(url: str, requests: list[tuple[float, bytes, int]]) -> list[Result]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        start = time.perf_counter()

        async def later(at: float, body: bytes, klass: int) -> Result:
            wait = at - (time.perf_counter() - start)
            if wait > 0:
                await asyncio.sleep(wait)
            return await _one(session, url + "/v1/completions", body, klass)

        return list(await asyncio.gather(*(later(*r) for r in requests)))


def _pct(values: list[float], q: float) -> float | None:
    """The ``q``th percentile in ms, nearest rank as the live bench's and the simulator's."""
    return round(percentile(values, q) * 1000, 1) if values else None


def summarize(results: list[Result], slo: SloTargets) -> dict[str, Any]:
    """The row's figures; each served request judged as the live bench judges it
    (router/demo/replay.py ``Outcome.judged``: the usage's prompt for its tier, TTFT at the
    first token, TPOT to the last), its TTFT target its class's (the router's default
    ``ttft_factor``s: its config names none)."""
    served = [r for r in results if r.served]
    refused = [r for r in results if r.status in (429, 503)]
    met = [0, 0, 0]
    total = [0, 0, 0]
    misses = {name: {"ttft": 0, "tpot": 0} for name in CLASS_NAMES}
    ttfts, tpots = [], []
    for r in results:
        total[r.klass] += 1
        if not r.served or r.answer is None:
            continue
        prompt, ttft, tpot = r.answer.judged()
        ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        _, ok, tpot_ok = slo.judge(prompt, ttft, tpot, class_ttft_factor(None, r.klass))
        if ok and tpot_ok:
            met[r.klass] += 1
        missed = misses[CLASS_NAMES[r.klass]]
        missed["ttft"] += not ok
        missed["tpot"] += not tpot_ok
    lost = [r for r in results if not r.served and r.status not in (429, 503)]
    return {
        "requests": len(results),
        "served": len(served),
        "refused": len(refused),
        "refused_with_retry_after": sum(r.retry_after for r in refused),
        "refusal_codes": sorted({r.code for r in refused}),
        "lost": len(lost),
        "goodput": round(sum(met) / len(results), 4) if results else 0.0,
        "slo_attainment": {
            name: (round(m / t, 4) if t else None)
            for name, m, t in zip(CLASS_NAMES, met, total, strict=True)
        },
        "served_missed": misses,  # served requests that missed TTFT / TPOT, by class
        "refusal_latency_ms_p50": _pct([r.elapsed_s for r in refused], 50),
        "refusal_latency_ms_p90": _pct([r.elapsed_s for r in refused], 90),
        "refusal_latency_ms_p99": _pct([r.elapsed_s for r in refused], 99),
        "refusal_latency_ms_max": _pct([r.elapsed_s for r in refused], 100),
        "ttft_ms_p50": _pct(ttfts, 50),
        "ttft_ms_p90": _pct(ttfts, 90),
        "tpot_ms_p90": _pct(tpots, 90),
        "errors": sorted({r.error or f"HTTP {r.status}" for r in lost})[:3],
    }


def workload(
    n: int, speedup: float, scale: float, priority: float, flex: float, seed: int, model: str
) -> list[tuple[float, bytes, int]]:
    """(arrival s, body, class) of the first ``n`` trace rows."""
    from router.demo.replay import load_requests

    rng = random.Random(seed)
    out = []
    for req in load_requests(TRACE, n, model, max_output=256):
        u = rng.random()
        tier = "priority" if u < priority else "flex" if u < priority + flex else None
        body = json.loads(req.body)
        if tier is not None:
            body["service_tier"] = tier
        klass = class_of(tier or "default")
        out.append((req.arrival_s / speedup * scale, json.dumps(body).encode(), klass))
    return out


async def _row(args: argparse.Namespace, slo_on: bool, requests: Any) -> Any:
    from router.demo.fleet import MODEL, Fleet, FleetSpec

    spec = FleetSpec(
        replicas=args.replicas, policy=None, profile=args.profile, time_scale=args.time_scale
    )
    started = time.perf_counter()
    async with Fleet(spec) as fleet:
        port = fleet.port()
        assert fleet._tmp is not None
        config = Path(fleet._tmp.name) / "router.toml"
        reps = [
            {k: v for k, v in r.items() if k in ("url", "model", "name", "zmq", "zmq_replay")}
            for r in fleet.replicas
        ]
        config.write_text(router_toml(port, MODEL, reps, args.profile, args.time_scale, slo_on))
        cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
        await fleet.start_router("router", cmd, f"http://127.0.0.1:{port}", ready="/ready")
        results = await _replay(fleet.router_url, requests)
        fleet.check_alive()
    row = summarize(results, SloTargets().scaled(args.time_scale))
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


def run(args: argparse.Namespace) -> int:
    from router.demo.fleet import MODEL
    from sim.profiles import load_profile

    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not rows or any(r not in ("off", "slo") for r in rows):
        raise SystemExit("--rows: a comma-separated list of off, slo")
    load_profile(args.profile)  # a bad --profile: refused here, not by each mock replica
    requests = workload(
        args.requests, args.speedup, args.time_scale, args.priority_share, args.flex_share,
        args.seed, MODEL,
    )  # fmt: skip
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "bench": "overload",
        "replicas": args.replicas,
        "profile": args.profile,
        "requests": len(requests),
        "speedup": args.speedup,
        "time_scale": args.time_scale,
        "priority_share": args.priority_share,
        "flex_share": args.flex_share,
        "rows": {},
    }
    for row in rows:
        print(f"bench overload: admission {row} ...", file=sys.stderr)
        result["rows"][row] = asyncio.run(_row(args, row == "slo", requests))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    sys.stdout.write(json.dumps(result, indent=None if args.json else 2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "overload", help="mock replicas past saturation, SLO-aware admission off vs on"
    )
    p.add_argument("--replicas", type=at_least(1), default=2)
    p.add_argument("--requests", type=at_least(1), default=200, help="first N rows of the trace")
    p.add_argument(
        "--speedup", type=positive_float, default=2.0, help="arrival speed-up of the trace"
    )
    p.add_argument("--priority-share", type=fraction, default=0.2)
    p.add_argument("--flex-share", type=fraction, default=0.0)
    p.add_argument("--profile", default="dense-70b", help="the mocks' (and router's) profile")
    p.add_argument(
        "--time-scale", type=positive_float, default=1.0, help="mock time scale (0.05: 20x)"
    )
    p.add_argument("--rows", default="off,slo", help="admission modes to run: off, slo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    p.set_defaults(handler=run)
