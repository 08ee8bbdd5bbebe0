"""Outlier ejection and retries with real processes: ``kvrouter serve`` in front of three
``kvrouter mock-replica`` processes, one of them switched through the fault modes of
router/mock/faults.py at run time. For each mode every client request succeeds (all are
retryable before the first byte), and the bad replica is ejected for the right kind of
failure. The timed targets (its share of requests after 2 s, time to move off a
SIGSTOPped replica) are measured by ``kvrouter bench faults``, not asserted here."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from tests.procs import FAST, Fleet, http_get, token_prompt
from tests.waiting import eventually

ADMIN = "admin-token"


def _series(page: str, name: str, replica: str) -> float:
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name + "{") and f'replica="{replica}"' in line:
            total += float(line.rpartition(" ")[2])
    return total


async def _metrics(url: str) -> str:
    _, page = await asyncio.to_thread(http_get, url + "/metrics")
    return str(page)


async def _one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, bool]:
    stream = i % 2 == 0
    body = {"model": "m", "prompt": token_prompt(i, 40), "max_tokens": 3, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.read()
        complete = b"[DONE]" in data if stream else b'"usage"' in data
        return resp.status, complete


async def test_each_fault_is_retried_and_its_replica_ejected(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        mocks = {n: fleet.mock(n, time_scale=FAST) for n in ("bad", "b", "c")}
        router = fleet.router(
            "router",
            [(n, m.url) for n, m in mocks.items()],
            server={
                "admin_token": ADMIN,
                "first_byte_min_s": 1.0,  # head-only answers time out quickly
                "outlier_base_ejection_s": 0.3,
                "outlier_max_ejection_s": 0.6,
                "retry_budget_min": 1000,
            },
        )
        bad = mocks["bad"].url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            sent = 0
            for mode, kind in (
                ("429", "http_429"),
                ("500", "http_5xx"),
                ("short-body", "broken"),
                ("head-only", "timeout"),
            ):
                before = await _metrics(router.url)
                async with s.post(bad + "/admin/fault", json={"mode": mode}) as r:
                    assert r.status == 200
                failures = _series(before, "kvrouter_replica_failures_total", "bad")

                async def failed_there(
                    kind: str = kind, failures: float = failures, mode: str = mode
                ) -> bool:
                    nonlocal sent
                    got = await asyncio.gather(*(_one(s, router.url, sent + j) for j in range(6)))
                    sent += 6
                    assert all(code == 200 and ok for code, ok in got), (mode, got)
                    page = await _metrics(router.url)
                    return (
                        f'kind="{kind}"' in page
                        and _series(page, "kvrouter_replica_failures_total", "bad") > failures
                    )

                await eventually(failed_there, timeout=20, interval=0.01)

                async def ejected(before: str = before) -> bool:
                    page = await _metrics(router.url)
                    return _series(page, "kvrouter_replica_ejections_total", "bad") > _series(
                        before, "kvrouter_replica_ejections_total", "bad"
                    )

                async def more_traffic(mode: str = mode) -> bool:
                    nonlocal sent
                    got = await asyncio.gather(*(_one(s, router.url, sent + j) for j in range(6)))
                    sent += 6
                    assert all(code == 200 and ok for code, ok in got), (mode, got)
                    return await ejected()

                await eventually(more_traffic, timeout=20, interval=0.01)
            code, reps = await asyncio.to_thread(
                http_get, router.url + "/admin/replicas", 2.0, {"X-Admin-Token": ADMIN}
            )
            assert code == 200
            row: dict[str, Any] = next(r for r in reps["replicas"] if r["name"] == "bad")
            assert row["outlier"]["failures_in_a_row"] >= 1, row
            async with s.post(bad + "/admin/fault", json={"mode": "none"}) as r:
                assert r.status == 200
        # serve's start-up lines: where it listens, how it routes (no tokenizer here)
        log = router.log()
        assert f"listening on http://127.0.0.1:{router.port}" in log, log[-2000:]  # type: ignore[attr-defined]
        assert "model m: policy ours, 3 configured replica(s), APPROXIMATE" in log
