"""What the router keeps per request must not stay on the garbage collector's lists.

A full collection scans every tracked container. The index keeps one speculative entry per
routed request (about 10^5 alive at fleet rates), so an entry that stays tracked (a tuple
holding an enum member, say) makes each full collection a pause of tens of milliseconds and
shows up as the p99 of every request behind it. Plain tuples of numbers leave the lists at
their first collection; these tests count tracked objects before and after many requests.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

from router.core.index import PrefixIndex
from router.core.types import ReplicaKey


def _tracked_after(step: object, n: int) -> int:
    """Tracked objects left after ``n`` calls of ``step(i)`` and full collections (two: a
    tuple leaves the lists only once what it holds has, and the collector may meet the
    outer one first)."""
    gc.collect()
    gc.collect()
    before = len(gc.get_objects())
    for i in range(n):
        step(i)  # type: ignore[operator]
    gc.collect()
    gc.collect()
    return len(gc.get_objects()) - before


def test_speculative_entries_leave_the_collector() -> None:
    idx = PrefixIndex()
    key = ReplicaKey("a")

    def speculate(i: int) -> None:
        hashes = [i * 100 + j for j in range(8)]
        idx.speculate(key, hashes, hashes[-1:], now=0.0, ttl=1e6)

    grown = _tracked_after(speculate, 3000)
    assert idx.stats().speculative_entries >= 3000 * 8
    assert grown < 300, f"{grown} tracked objects left by 3000 speculative entries"


def test_routing_leaves_nothing_tracked_per_request(tmp_path: Path) -> None:
    from router.bench.proxy_bench import MODEL, chat_body, kvrouter_config
    from router.service.config import load_settings
    from router.service.intake import parse_body
    from router.service.state import RouterState

    cfg = tmp_path / "kvrouter.toml"
    kvrouter_config(cfg, [9001, 9002, 9003, 9004], 9000, 1)
    state = RouterState(load_settings(cfg, environ={}))
    proc = state.processor(MODEL)
    bodies = [chat_body(False).replace("UNIQUE ", f"u{i} ").encode() for i in range(40)]
    prompts = [proc.chat(parse_body(b)) for b in bodies]
    loop = asyncio.new_event_loop()
    try:

        def route(i: int) -> None:
            rid = f"r{i}"
            state.route(MODEL, prompts[i % len(prompts)], rid, loop.time())
            state.load.complete(rid)

        _tracked_after(route, 1000)  # fills the bounded rings (recent decisions)
        grown = _tracked_after(route, 2000)
    finally:
        loop.close()
    assert grown < 200, f"{grown} tracked objects left by 2000 routed requests"
