"""``kvrouter bench ...``: benchmarks that print one JSON object each (never timed tests)."""

from __future__ import annotations

import argparse
import importlib

# Modules under router.bench (or elsewhere) exposing register(subparsers).
_BENCHES: tuple[str, ...] = (
    "router.bench.hash_bench",
    "router.bench.index_bench",
    "router.bench.ingest_bench",
    "router.bench.store_bench",
    "router.bench.tokenize_bench",
    "router.bench.render_bench",
    "router.bench.body_bench",
    "router.bench.proxy_bench",
    "router.bench.grpc_bench",
    "router.bench.reliability_bench",
    "router.bench.faults_bench",
    "router.bench.admit_bench",
    "router.bench.route_bench",
    "router.bench.instructions_bench",
    "router.bench.pods_bench",
    "router.bench.stall_bench",
    "router.bench.scrape_bench",
    "router.bench.longctx_bench",
    "router.bench.listener_bench",
    "router.demo.overload_bench",  # a command-line entry point: it reads a sim profile
    "router.demo.live_bench",  # a command-line entry point: it may run the simulator
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("bench", help="run a benchmark; prints one JSON object")
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in _BENCHES:
        importlib.import_module(name).register(benches)
