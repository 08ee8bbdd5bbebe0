"""``kvrouter bench admit``: the router's own CPU per request before any I/O, in-process.

What a hot-endpoint request costs between "body received" and "bytes go upstream", phase by
phase, on an idle core, with the proxy benchmark's model and body (router/bench/proxy_bench):
``parse`` (JSON + field checks), ``prompt`` (template, tokenization, block hashes),
``route`` (``RouterState.route``: candidates, policy, dispatch, with the load completed
right after), ``metrics`` (the per-request decision metrics), and ``memo_hit`` (what a
byte-identical body costs instead of parse + prompt: the body-memo lookup). ``--unique``
gives every request a fresh user text, as ``bench proxy --unique`` does.

Each figure is the minimum over ``--rounds`` rounds of ``--requests`` requests (microseconds
per request): the least disturbed round on a shared machine. Compare figures from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from router.bench.measure import emit
from router.cliargs import at_least
from router.compile import compiled, service_compiled


def _best(rounds: int, n: int, step: Callable[[int], None]) -> float:
    best = float("inf")
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(r * n, (r + 1) * n):
            step(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return round(best * 1e6, 2)


async def _run(args: argparse.Namespace) -> dict[str, object]:
    from router.bench.proxy_bench import MODEL, chat_body, kvrouter_config
    from router.service.body_memo import Admitted
    from router.service.config import load_settings
    from router.service.handling import record
    from router.service.intake import field_types, parse_body
    from router.service.state import RouterState

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "kvrouter.toml"
        kvrouter_config(cfg, [9001, 9002, 9003, 9004], 9000, 1)
        state = RouterState(load_settings(cfg, environ={}))
    rounds, n = args.rounds, args.requests
    base = chat_body(False).encode()
    total = rounds * n
    # bodies[:total] are measured; the warm-up and the routing phase's prompts use others,
    # so with --unique no measured text was seen before (the piece memo cannot help)
    extra = 1000 + n
    bodies = (
        [base.replace(b"UNIQUE ", b"u%dx " % i) for i in range(total + extra)]
        if args.unique
        else [base] * (total + extra)
    )
    proc = state.processor(MODEL)
    loop = asyncio.get_running_loop()
    for raw in bodies[total : total + 1000]:  # warm-up
        proc.chat(parse_body(raw))
    prompts = [proc.chat(parse_body(raw)) for raw in bodies[total + 1000 :]]
    gc.collect()

    def parse(i: int) -> None:
        field_types(parse_body(bodies[i]))

    def prompt(i: int) -> None:
        proc.chat(parse_body(bodies[i]))

    routed = []

    def route(i: int) -> None:
        rid = f"r{i}"
        routed.append(state.route(MODEL, prompts[i % len(prompts)], rid, loop.time()))
        state.load.complete(rid)

    def metrics(i: int) -> None:
        record(state, routed[i % len(routed)])

    memo = state.body_memo
    memo.put("chat", bodies[0], Admitted(MODEL, prompts[0], None, 8))

    def memo_hit(i: int) -> None:
        memo.get("chat", bodies[0])

    figures = {
        "parse_us": _best(rounds, n, parse),
        "prompt_us": _best(rounds, n, prompt),
        "route_us": _best(rounds, n, route),
        "metrics_us": _best(rounds, n, metrics),
        "memo_hit_us": _best(rounds, n, memo_hit),
    }
    return {
        "bench": "admit",
        "core_compiled": compiled(),  # make compile
        "service_compiled": service_compiled(),
        "unique_prompts": args.unique,
        "replicas": len(state.registry.keys_for(MODEL)),
        "prompt_tokens": prompts[0].prompt_tokens,
        "requests": n,
        "rounds": rounds,
        **figures,
    }


def run(args: argparse.Namespace) -> int:
    emit(asyncio.run(_run(args)))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("admit", help="per-request CPU before I/O: parse, prompt, route, metrics")
    p.add_argument("--requests", type=at_least(1), default=4000, help="requests per round")
    p.add_argument("--rounds", type=at_least(1), default=10)
    p.add_argument("--unique", action="store_true", help="a fresh user text in every request")
    p.set_defaults(handler=run)
