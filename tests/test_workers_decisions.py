"""``GET /admin/decisions`` with several worker processes: each worker keeps the decisions it
made; ``?workers=all`` asks every worker, as ``/admin/replicas?workers=all`` does. Real
``kvrouter serve`` processes on loopback, fresh connections so the kernel spreads the
requests over the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.backends import Backend
from tests.procs import Fleet
from tests.test_workers_admin import call, start_router, worker_pids

SENT = 16


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def test_decisions_of_all_workers_in_one_answer(fleet: Fleet) -> None:
    """Every decision, whichever worker made it, newest first, each naming its worker; a
    ``workers`` value other than ``this`` / ``all`` is a 400 rather than one worker's
    answer taken for everyone's."""
    b0 = await Backend("b0", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0], workers=2, engine="fast")
        for i in range(SENT):
            status, data = await call(
                proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p {i}", "max_tokens": 1}
            )
            assert status == 200, data
        own = await worker_pids(proc, 2, f"/admin/decisions?limit={SENT}")
        assert all(a["decisions"] for a in own.values()), own  # both workers routed some

        status, out = await call(proc, "GET", f"/admin/decisions?workers=all&limit={SENT + 5}")
        assert status == 200, out
        assert out["workers"] == 2 and out["workers_answered"] == 2, out
        assert out["workers_failed"] == []
        got = out["decisions"]
        assert len(got) == SENT, got
        assert {d["worker_pid"] for d in got} == set(own)
        at = [d["at"] for d in got]
        assert at == sorted(at, reverse=True)  # newest first, across workers
        for pid, answer in own.items():
            mine = [d["request_id"] for d in got if d["worker_pid"] == pid]
            assert mine == [d["request_id"] for d in answer["decisions"]], (pid, got)

        status, out = await call(proc, "GET", "/admin/decisions?workers=all&limit=3")
        assert status == 200 and [d["at"] for d in out["decisions"]] == at[:3], out
        status, out = await call(proc, "GET", "/admin/decisions?workers=every")
        assert status == 400 and out["error"]["param"] == "workers", out
    finally:
        await b0.stop()
