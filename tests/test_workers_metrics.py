"""``/metrics`` with several worker processes: one page with every worker's samples.

A scrape lands on whichever worker the kernel picks; each worker counts only its own
requests. The page must hold all workers (labelled ``worker``), so the sum over workers is
the same whichever worker answered. Real ``kvrouter serve`` processes on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.service.worker_metrics import families, labelled, merge
from tests.backends import Backend
from tests.procs import Fleet, Proc
from tests.test_workers_admin import start_router, traffic, worker_pids
from tests.waiting import eventually


def test_labelled_puts_the_worker_first() -> None:
    assert labelled('a_total{model="m"} 3.0', "1") == 'a_total{worker="1",model="m"} 3.0'
    assert labelled("a_total 3.0", "0") == 'a_total{worker="0"} 3.0'
    assert labelled("a{} 1", "2") == 'a{worker="2"} 1'
    # label values may hold braces and spaces: only the name part is looked at
    assert labelled('a{m="x {y} z"} 1', "0") == 'a{worker="0",m="x {y} z"} 1'


def test_merge_keeps_each_family_together() -> None:
    page0 = (
        '# HELP a_total A.\n# TYPE a_total counter\na_total{m="x"} 1.0\n'
        "# HELP g G.\n# TYPE g gauge\ng 5.0\n"
    )
    page1 = "# HELP g G.\n# TYPE g gauge\ng 7.0\n# HELP b B.\n# TYPE b gauge\nb 1.0\n"
    out = merge([("0", page0), ("1", page1)])
    assert [name for name, _, _ in families(out)] == ["a_total", "g", "b"]
    assert out.count("# TYPE g gauge") == 1
    assert 'g{worker="0"} 5.0\ng{worker="1"} 7.0' in out
    parsed = {f.name: f for f in text_string_to_metric_families(out)}
    assert [s.labels for s in parsed["g"].samples] == [{"worker": "0"}, {"worker": "1"}]


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def scrape(proc: Proc, timeout_s: float = 10.0) -> dict[str, Any]:
    """``/metrics`` over a fresh connection (SO_REUSEPORT picks the worker), parsed."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.get(proc.url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r,
    ):
        assert r.status == 200
        text = await r.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


def ok_requests(page: dict[str, Any]) -> dict[str, float]:
    """Requests answered ok, per worker label."""
    out: dict[str, float] = {}
    for s in page["kvrouter_requests"].samples:
        if s.name == "kvrouter_requests_total" and s.labels["outcome"] == "ok":
            out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out


@pytest.mark.parametrize("engine", ["fast"])
async def test_every_scrape_holds_every_worker(fleet: Fleet, engine: str) -> None:
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0, b1], workers=2, engine=engine)
        await traffic(proc, 60)
        for _ in range(8):  # fresh connections: both workers answer some of these
            page = await scrape(proc)
            assert page["kvrouter_workers"].samples[0].value == 2
            assert page["kvrouter_workers_scraped"].samples[0].value == 2
            per_worker = ok_requests(page)
            assert sorted(per_worker) == ["0", "1"]
            assert sum(per_worker.values()) == 60  # whichever worker answered
            assert all(v > 0 for v in per_worker.values()), per_worker
    finally:
        await b0.stop()
        await b1.stop()


async def test_a_worker_that_is_gone_is_left_out(fleet: Fleet) -> None:
    b0 = await Backend("b0", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0], workers=2, engine="fast")
        await traffic(proc, 20)
        dead, _alive = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started
        await asyncio.sleep(0.3)
        t0 = asyncio.get_running_loop().time()
        page = await scrape(proc)
        assert asyncio.get_running_loop().time() - t0 < 5
        assert page["kvrouter_workers"].samples[0].value == 2
        assert page["kvrouter_workers_scraped"].samples[0].value == 1
        assert len(ok_requests(page)) == 1  # the survivor's own samples
    finally:
        await b0.stop()


async def test_a_hung_worker_is_left_out_of_the_pages_the_other_answers(fleet: Fleet) -> None:
    """A worker alive but not answering (SIGSTOPped, as one whose event loop is stuck in a
    call): the parent sees it alive and replaces nothing. A scrape the kernel hands to it
    is not answered (Prometheus: a failed scrape, the pod's series stale); one the other
    worker answers leaves its samples out, ``kvrouter_workers_scraped`` 1 of
    ``kvrouter_workers`` 2: what ``KVRouterWorkerHung`` watches
    (deploy/k8s/base/prometheus-rules.yaml). Once it answers again, the pages hold it."""
    b0 = await Backend("b0", ["m"]).start()
    hung: int | None = None
    try:
        # the parent would replace it after worker_hang_s: here it stays hung
        proc = await start_router(
            fleet, [b0], workers=2, engine="fast", server={"worker_hang_s": 0}
        )
        await traffic(proc, 20)
        hung, _alive = sorted(await worker_pids(proc, 2))
        os.kill(hung, signal.SIGSTOP)  # a worker of the router this test started
        pages: list[dict[str, Any]] = []

        async def answered(want: int) -> bool:
            # four fresh connections at once: the kernel hands some to the answering worker
            # (which waits up to 2 s for the hung one's page); those it hands to the hung
            # one are not answered
            tries = [asyncio.create_task(scrape(proc, timeout_s=4)) for _ in range(4)]
            try:
                for first in asyncio.as_completed(tries):
                    with contextlib.suppress(TimeoutError):
                        pages.append(await first)
                        return pages[-1]["kvrouter_workers_scraped"].samples[0].value == want
                return False
            finally:
                for t in tries:
                    t.cancel()

        await eventually(lambda: answered(1), timeout=60, interval=0)
        page = pages[-1]
        assert page["kvrouter_workers"].samples[0].value == 2
        assert len(ok_requests(page)) == 1  # the answering worker's own samples
        assert page["kvrouter_worker_restarts"].samples[0].value == 0  # not replaced
        os.kill(hung, signal.SIGCONT)
        hung = None
        await eventually(lambda: answered(2), timeout=60, interval=0)
        assert sorted(ok_requests(pages[-1])) == ["0", "1"]
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)  # (a stopped worker would not take the SIGTERM)
        await b0.stop()


async def test_in_flight_gauges_sum_over_workers_to_the_requests_in_flight(fleet: Fleet) -> None:
    """``kvrouter_in_flight_requests`` / ``kvrouter_queued_prefill_tokens`` are the requests
    each worker sent: summed over ``worker`` (as docs/metrics.md says to, and as the
    dashboard sums them) they are the requests in flight, not that many times over once the
    workers share their load for routing (load_share.py)."""
    from tests.test_workers_admin import call

    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(
            fleet, [slow], workers=2, engine="fast", server={"load_share_interval_s": 0.02}
        )
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(16)
        ]

        async def shared() -> bool:
            # every request at the replica, and each worker routes on the other's
            rows = [a["replicas"][0] for a in (await worker_pids(proc, 2)).values()]
            own = [r["in_flight"] for r in rows]
            return sum(own) == 16 and [r["peers_in_flight"] for r in rows] == own[::-1]

        await eventually(shared)
        status, view = await call(proc, "GET", "/admin/replicas?workers=all")
        assert status == 200, view
        page = await scrape(proc)
        for family, field in (
            ("kvrouter_in_flight_requests", "in_flight"),
            ("kvrouter_queued_prefill_tokens", "queued_prefill_tokens"),
        ):
            per_worker = {s.labels["worker"]: s.value for s in page[family].samples}
            assert sorted(per_worker) == ["0", "1"], per_worker
            want = view["replicas"][0][field]
            assert want > 0 and sum(per_worker.values()) == want, (family, per_worker, want)
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 16
    finally:
        if slow.gate is not None:
            slow.gate.set()
        await slow.stop()
