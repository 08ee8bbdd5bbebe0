"""Admin drain / undrain with several worker processes (``server.workers = N``, SO_REUSEPORT).

Each worker has its own state; a drain received by one worker must reach every worker, or the
drained replica keeps getting the other workers' traffic. Real ``kvrouter serve`` processes
on loopback, in-process test backends that count what they receive, and fresh connections
for every request so the kernel spreads them over the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.backends import Backend
from tests.ports import free_port
from tests.procs import KVROUTER, Fleet, Proc, _toml
from tests.waiting import eventually

TOKEN = "workers-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def start_router(
    fleet: Fleet,
    backends: list[Backend],
    *,
    workers: int,
    engine: str,
    dp_ranks: dict[str, int] | None = None,
    server: dict[str, Any] | None = None,
) -> Proc:
    """``kvrouter serve`` over ``backends`` (model ``m``, round robin, so each worker spreads
    its requests over every replica it may route to); ``server``: more ``[server]`` keys."""
    port = free_port()
    srv = {
        "port": port,
        "workers": workers,
        "http_engine": engine,
        "admin_token": TOKEN,
        "log_level": "info",
        **(server or {}),
    }
    lines = ["[server]"] + [f"{k} = {_toml(v)}" for k, v in srv.items()]
    for b in backends:
        lines += ["[[replicas]]", f"name = {_toml(b.name)}", f"url = {_toml(b.url)}"]
        lines += ["model = 'm'", f"dp_ranks = {(dp_ranks or {}).get(b.name, 1)}"]
    lines += ["[models.m]", "block_size = 16", "policy = 'round_robin'"]
    cfg = fleet.workdir / "router.toml"
    cfg.write_text("\n".join(lines) + "\n")
    proc = fleet.spawn(
        "router", [KVROUTER, "serve", "--config", str(cfg)], url=f"http://127.0.0.1:{port}"
    )
    # the backends run on this event loop: wait without blocking it
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        assert proc.alive(), proc.log()[-3000:]
        assert asyncio.get_running_loop().time() < deadline, proc.log()[-3000:]
        try:
            status, _ = await call(proc, "GET", "/ready")
            if status == 200:
                break
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    if workers > 1:
        await worker_pids(proc, workers)  # every worker listens
    return proc


async def call(proc: Proc, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request over a fresh connection (so SO_REUSEPORT picks a worker each time)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.request(
            method,
            proc.url + path,
            json=body,
            headers=AUTH,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as r,
    ):
        try:
            data = await r.json(content_type=None)
        except ValueError:
            data = await r.text()
        return r.status, data


async def worker_pids(proc: Proc, workers: int, path: str = "/admin/replicas") -> dict[int, Any]:
    """``path``'s answer per worker pid, asked over fresh connections until every worker
    answered (a worker still starting on a loaded machine may take a while)."""
    seen: dict[int, Any] = {}

    async def all_answered() -> bool:
        status, data = await call(proc, "GET", path)
        assert status == 200, data
        assert data["workers"] == workers, data
        seen.setdefault(data["worker_pid"], data)
        return len(seen) == workers

    await eventually(all_answered, timeout=30, interval=0)
    return seen


async def traffic(proc: Proc, n: int) -> None:
    for i in range(n):
        status, data = await call(
            proc, "POST", "/v1/completions", {"model": "m", "prompt": f"req {i}", "max_tokens": 1}
        )
        assert status == 200, data


@pytest.mark.parametrize("engine", ["fast"])
async def test_drain_and_undrain_reach_every_worker(fleet: Fleet, engine: str) -> None:
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0, b1], workers=2, engine=engine)
        status, out = await call(proc, "POST", "/admin/replicas/b1/drain")
        assert status == 200, out
        b0.received.clear()
        b1.received.clear()
        await traffic(proc, 60)
        assert len(b1.received) == 0  # no worker routed to the drained replica
        assert len(b0.received) == 60
        assert out["replicas"] == ["b1"] and out["draining"] is True
        assert out["workers"] == 2 and out["workers_applied"] == 2, out
        # both workers routed some of those requests (else the test proves nothing)
        decisions = await worker_pids(proc, 2, "/admin/decisions?limit=100")
        assert all(d["decisions"] for d in decisions.values()), decisions
        replicas = await worker_pids(proc, 2)
        for answer in replicas.values():
            assert {r["name"]: r["draining"] for r in answer["replicas"]} == {
                "b0": False,
                "b1": True,
            }
        status, out = await call(proc, "POST", "/admin/replicas/b1/undrain")
        assert status == 200, out
        assert out["draining"] is False and out["workers_applied"] == 2, out
        await traffic(proc, 40)
        assert len(b1.received) >= 10  # round robin on each worker: about half
        assert proc.pid not in replicas  # the parent only supervises
    finally:
        await b0.stop()
        await b1.stop()


@pytest.mark.parametrize(("engine", "workers"), [("fast", 1), ("fast", 2)])
async def test_drain_one_dp_rank_with_percent_encoded_hash(
    fleet: Fleet, engine: str, workers: int
) -> None:
    """``b1#dp1`` is sent as ``b1%23dp1`` (a literal ``#`` would start the URL's fragment):
    the router decodes it, and with several workers forwards it still encoded."""
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc = await start_router(
            fleet, [b0, b1], workers=workers, engine=engine, dp_ranks={"b1": 2}
        )
        status, out = await call(proc, "POST", "/admin/replicas/b1%23dp1/drain")
        assert status == 200, out
        assert out["replicas"] == ["b1#dp1"] and out["workers_applied"] == workers, out
        await traffic(proc, 45)
        ranks = [r["headers"].get("x-data-parallel-rank") for r in b1.received]
        assert ranks and set(ranks) == {"0"}, ranks  # rank 1 drained on every worker
        assert len(b0.received) > 0
        if workers == 1:
            status, data = await call(proc, "GET", "/admin/replicas")
            assert data["worker_pid"] == proc.pid and data["workers"] == 1
        status, out = await call(proc, "POST", "/admin/replicas/b1%23dp1/undrain")
        assert status == 200 and out["replicas"] == ["b1#dp1"], out
        b1.received.clear()
        await traffic(proc, 45)
        assert {r["headers"].get("x-data-parallel-rank") for r in b1.received} == {"0", "1"}
    finally:
        await b0.stop()
        await b1.stop()


async def test_drain_that_misses_a_worker_is_an_error_naming_it(fleet: Fleet) -> None:
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        # a short hang bound: the parent, stopped below, must not take the heartbeats it
        # did not read meanwhile for a hung worker once it continues; not so short that a
        # live worker whose event loop a loaded machine holds up is killed as hung (0.5 s
        # killed the survivor in a full run of the suite)
        proc = await start_router(
            fleet, [b0, b1], workers=2, engine="fast", server={"worker_hang_s": 2.0}
        )
        found = re.search(r"worker control sockets in (\S+)", proc.log())
        assert found, proc.log()[-2000:]
        control = Path(found.group(1))
        assert stat.S_IMODE(control.stat().st_mode) == 0o700
        pids = sorted(await worker_pids(proc, 2))
        assert sorted(int(p.stem.split("-")[1]) for p in control.glob("worker-*.sock")) == pids
        dead, alive = pids
        proc.signal(signal.SIGSTOP)  # the parent replaces no worker until it continues
        try:
            os.kill(dead, signal.SIGKILL)  # a worker of the router this test started
            # Its listening socket leaves the port's SO_REUSEPORT group only when the last of
            # its threads has exited: its main thread may be a zombie already while its
            # libuv threads still hold the descriptors. Until then the kernel hands that
            # socket its share of new connections, and resets the ones it queued when it
            # closes: the drain is sent once only the survivor listens.
            port = int(proc.url.rsplit(":", 1)[1])
            await eventually(lambda: not _running(dead) and _listeners(port) == 1)
            status, out = await call(proc, "POST", "/admin/replicas/b1/drain")
            assert status == 502, out
            err = out["error"]
            assert err["code"] == "workers_unreachable" and err["type"] == "upstream_error"
            assert str(dead) in err["message"] and "1 of 2" in err["message"], err
            assert out["workers_applied"] == 1 and out["worker_pid"] == alive
            assert [w["pid"] for w in out["workers_failed"]] == [dead]
            # applied where it could be: the surviving worker no longer routes to b1
            b1.received.clear()
            await traffic(proc, 10)
            assert b1.received == []
        finally:
            proc.signal(signal.SIGCONT)
        await replacement(proc, dead, alive)
        assert proc.stop() == 0, proc.log()[-2000:]  # a replaced worker fails no stop
        assert not control.exists()  # the parent removed the control directory
    finally:
        await b0.stop()
        await b1.stop()


async def test_replicas_of_all_workers_in_one_answer(fleet: Fleet) -> None:
    """``GET /admin/replicas?workers=all``: every worker's view in one row a replica, the
    load each worker sent summed (here: requests held open at the replica)."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(fleet, [slow], workers=2, engine="fast")
        status, out = await call(proc, "POST", "/admin/replicas/b0/drain")
        assert status == 200 and out["workers_applied"] == 2, out
        status, out = await call(proc, "GET", "/admin/replicas?workers=all")
        assert out["replicas"][0]["draining"] and out["replicas"][0]["draining_workers"] == 2
        status, out = await call(proc, "POST", "/admin/replicas/b0/undrain")
        assert status == 200, out
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(16)
        ]

        async def all_held() -> bool:  # the replica holds all 16 (both workers sent some)
            status, out = await call(proc, "GET", "/admin/replicas?workers=all")
            assert status == 200, out
            return bool(out["replicas"][0]["in_flight"] == 16)

        await eventually(all_held)
        status, out = await call(proc, "GET", "/admin/replicas?workers=all")
        row = out["replicas"][0]
        assert out["workers"] == 2 and out["workers_answered"] == 2 and out["workers_failed"] == []
        assert row["replica"] == "b0" and row["in_flight"] == 16, row
        assert row["workers_known"] == 2 and row["healthy"] and not row["draining"]
        per_worker = await worker_pids(proc, 2)  # each worker's own share
        shares = [a["replicas"][0]["in_flight"] for a in per_worker.values()]
        assert sum(shares) <= 16 and all(s > 0 for s in shares), shares
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 16
        status, out = await call(proc, "GET", "/admin/replicas?workers=some")
        assert status == 400 and out["error"]["param"] == "workers"
    finally:
        await slow.stop()


@pytest.mark.parametrize("share", [0.02, 0])
async def test_workers_count_each_others_requests_in_flight(fleet: Fleet, share: float) -> None:
    """With ``load_share_interval_s`` each worker routes on the others' requests too: its
    ``peers_in_flight`` is what the others hold at the replica (load_share.py); with 0, none."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(
            fleet, [slow], workers=2, engine="fast", server={"load_share_interval_s": share}
        )
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(16)
        ]

        async def all_held() -> bool:
            status, out = await call(proc, "GET", "/admin/replicas?workers=all")
            assert status == 200, out
            return bool(out["replicas"][0]["in_flight"] == 16)

        await eventually(all_held)  # every request at the replica...
        await asyncio.sleep(0.3)  # ...then a few exchange rounds (or, with 0, none)
        per_worker = await worker_pids(proc, 2)
        rows = [a["replicas"][0] for a in per_worker.values()]
        own = [r["in_flight"] for r in rows]
        assert sum(own) == 16 and all(n > 0 for n in own), own  # both workers sent some
        peers = [r["peers_in_flight"] for r in rows]
        assert peers == ([own[1], own[0]] if share else [0, 0]), (own, peers)
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 16
    finally:
        await slow.stop()


def _listeners(port: int) -> int:
    """How many TCP sockets listen on ``port`` (/proc/net/tcp and tcp6; state 0A: LISTEN)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] != "Z"


async def test_workers_stop_when_their_parent_is_killed(fleet: Fleet) -> None:
    """The parent SIGKILLed (the OOM killer, a supervisor's hard stop): its workers must not
    go on serving the port unsupervised (a restarted router would share it with them, each
    generation with its own drains and load); they stop as on SIGTERM."""
    b0 = await Backend("b0", ["m"]).start()
    pids: list[int] = []
    try:
        proc = await start_router(fleet, [b0], workers=2, engine="fast")
        pids = sorted(await worker_pids(proc, 2))
        proc.kill()
        await eventually(lambda: not any(_running(p) for p in pids), timeout=20)
    finally:
        for pid in pids:  # (the workers of the router this test started)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        await b0.stop()


async def serving_pids(proc: Proc, tries: int = 40) -> set[int]:
    """The worker pids that answered ``tries`` requests over fresh connections."""
    seen: set[int] = set()
    for _ in range(tries):
        status, data = await call(proc, "GET", "/admin/replicas")
        assert status == 200, data
        seen.add(data["worker_pid"])
    return seen


async def replacement(proc: Proc, dead: int, alive: int) -> int:
    """The pid of the worker that replaced ``dead``, once it serves beside ``alive``: one
    request a poll until a new pid answered, then ``serving_pids``' 40 requests find these
    two, and only these, serving (40 a poll while the replacement started cost ~500
    requests a test)."""
    seen: set[int] = set()

    async def replaced() -> bool:
        try:
            status, data = await call(proc, "GET", "/admin/replicas")
        except aiohttp.ClientConnectionError:
            # the killed worker's socket stays in the port's SO_REUSEPORT group until its
            # last thread exits, and resets what the kernel hashed to it meanwhile
            # (docs/service.md "The parent supervises"): not yet
            return False
        assert status == 200, data
        seen.add(data["worker_pid"])
        return bool(seen - {alive, dead})

    await eventually(replaced, timeout=30)
    new = seen - {alive, dead}
    assert len(new) == 1 and dead not in seen, (seen, dead, alive)
    assert await serving_pids(proc) == {alive, *new}, (new, alive)
    return new.pop()


async def test_a_killed_worker_is_replaced(fleet: Fleet) -> None:
    """A worker killed after start-up (the OOM killer, a crash) is replaced on the same port,
    with the same worker index, logged and counted; the others know the new one."""
    b0 = await Backend("b0", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0], workers=2, engine="fast")
        dead, alive = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started

        await replacement(proc, dead, alive)
        await traffic(proc, 20)
        log = proc.log()
        assert f"(pid {dead}) was killed by signal SIGKILL (9)" in log, log[-3000:]
        status, page = await call(proc, "GET", "/metrics")
        assert status == 200
        assert "kvrouter_worker_restarts_total 1" in page, page[-2000:]
        assert "kvrouter_workers_scraped 2" in page  # the survivor asks the new one too
        assert 'worker="0"' in page and 'worker="1"' in page  # the index is kept
        status, out = await call(proc, "GET", "/admin/replicas?workers=all")
        assert out["workers_answered"] == 2 and out["workers_failed"] == [], out
        assert proc.stop() == 0, proc.log()[-2000:]  # a replaced worker is no failed stop
    finally:
        await b0.stop()


async def test_a_hung_worker_is_killed_and_replaced(fleet: Fleet) -> None:
    """A worker whose event loop stops (SIGSTOP here; a call that never returns alike) sends
    its parent no heartbeat: after ``worker_hang_s`` the parent kills it and replaces it as
    one that died, logged as hung and counted; the worker that kept beating stays."""
    b0 = await Backend("b0", ["m"]).start()
    hung: int | None = None
    try:
        proc = await start_router(
            fleet, [b0], workers=2, engine="fast", server={"worker_hang_s": 1}
        )
        hung, alive = sorted(await worker_pids(proc, 2))
        os.kill(hung, signal.SIGSTOP)  # a worker of the router this test started
        await replacement(proc, hung, alive)
        hung = None  # (killed)
        await traffic(proc, 10)
        log = proc.log()
        assert "sent no heartbeat for" in log and log.count("(hung): killed") == 1, log[-3000:]
        status, page = await call(proc, "GET", "/metrics")
        assert status == 200 and "kvrouter_worker_restarts_total 1" in page, page[-2000:]
        assert proc.stop() == 0, proc.log()[-2000:]
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)
        await b0.stop()


async def test_no_worker_is_replaced_while_the_router_stops(fleet: Fleet) -> None:
    """A worker that dies while the router drains (SIGTERM) is not replaced: the router
    exits once the others finished, with the status of the one that died."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(fleet, [slow], workers=2, engine="fast")
        pids = sorted(await worker_pids(proc, 2))
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(8)
        ]
        await eventually(lambda: len(slow.received) == 8)
        proc.signal(signal.SIGTERM)

        async def closed() -> bool:  # both workers stopped listening: both are draining
            try:
                await call(proc, "GET", "/health")
            except aiohttp.ClientError:
                return True
            return False

        await eventually(closed)
        os.kill(pids[0], signal.SIGKILL)
        slow.gate.set()  # type: ignore[union-attr]
        await asyncio.gather(*held, return_exceptions=True)
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code == 128 + signal.SIGKILL, proc.log()[-2000:]
        assert "replacement" not in proc.log(), proc.log()[-2000:]
        assert not any(_running(p) for p in pids)
    finally:
        await slow.stop()


async def _draining(proc: Proc, slow: Backend, n: int) -> list[asyncio.Task[Any]]:
    """``n`` requests held by ``slow`` (its gate closed) when the router begins to drain."""
    held = [
        asyncio.create_task(
            call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
        )
        for i in range(n)
    ]
    await eventually(lambda: len(slow.received) == n)
    return held


async def _closed(proc: Proc) -> bool:
    """Every worker stopped listening: all drain."""
    try:
        await call(proc, "GET", "/health")
    except aiohttp.ClientError:
        return True
    return False


async def test_sigterm_to_the_whole_group_drains_once(fleet: Fleet) -> None:
    """A service manager that signals every process of the group (systemd's
    ``KillMode=control-group``) gives each worker a SIGTERM of its own beside the one the
    parent passes on: that is one stop, which drains, not a second that cuts."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(fleet, [slow], workers=2, engine="fast")
        await worker_pids(proc, 2)
        held = await _draining(proc, slow, 6)
        os.killpg(proc.pid, signal.SIGTERM)  # (its own session: the group is the router's)
        await eventually(lambda: _closed(proc))
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 6
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code == 0, proc.log()[-2000:]
        assert "second stop signal" not in proc.log(), proc.log()[-3000:]
    finally:
        await slow.stop()


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
async def test_a_second_signal_cuts_every_workers_drain(fleet: Fleet, second: int) -> None:
    """A second SIGTERM / SIGINT to the parent while the workers drain (for up to 60 s
    here) cuts what they still serve at once (the parent passes it on as SIGQUIT); all
    exit and the router exits 0."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(
            fleet, [slow], workers=2, engine="fast", server={"shutdown_timeout_s": 60.0}
        )
        pids = sorted(await worker_pids(proc, 2))
        held = await _draining(proc, slow, 6)
        proc.signal(signal.SIGTERM)
        await eventually(lambda: _closed(proc))
        proc.signal(second)
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 8)
        assert code == 0, proc.log()[-2000:]
        got = await asyncio.gather(*held, return_exceptions=True)
        assert all(isinstance(g, aiohttp.ClientError) for g in got), got  # cut, not timed out
        assert not any(_running(p) for p in pids)
    finally:
        slow.gate.set()  # type: ignore[union-attr]
        await slow.stop()


def test_restart_delay_doubles_and_resets() -> None:
    from router.service.workers import (
        RESTART_FIRST_S,
        RESTART_MAX_S,
        RESTART_RESET_S,
        restart_delay,
    )

    delay = None
    seen = []
    for _ in range(10):  # replacements that die at once (or before they listen)
        delay = restart_delay(delay, None if len(seen) % 2 else 0.1)
        seen.append(delay)
    assert seen[:3] == [RESTART_FIRST_S, 2 * RESTART_FIRST_S, 4 * RESTART_FIRST_S]
    assert seen[-1] == RESTART_MAX_S
    assert restart_delay(RESTART_MAX_S, RESTART_RESET_S) == RESTART_FIRST_S


async def test_a_replacement_worker_keeps_the_drains(fleet: Fleet) -> None:
    """Drains live in each worker's memory: the worker that replaces a killed one takes them
    from the others before it listens, or it would send requests to a replica under
    maintenance."""
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc = await start_router(fleet, [b0, b1], workers=2, engine="fast")
        status, out = await call(proc, "POST", "/admin/replicas/b1/drain")
        assert status == 200 and out["workers_applied"] == 2, out
        dead, alive = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started

        new = await replacement(proc, dead, alive)
        b1.received.clear()
        await traffic(proc, 40)
        assert b1.received == []
        answers = await worker_pids(proc, 2)
        assert set(answers) == {alive, new}
        for answer in answers.values():
            assert {r["name"]: r["draining"] for r in answer["replicas"]} == {
                "b0": False,
                "b1": True,
            }
    finally:
        await b0.stop()
        await b1.stop()


async def test_a_replacement_worker_shares_load_both_ways(fleet: Fleet) -> None:
    """The survivor exchanges its load with the worker that replaced a killed one (it asks
    the workers of the parent's new pid list, not those it knew first), and the other way."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(
            fleet, [slow], workers=2, engine="fast", server={"load_share_interval_s": 0.02}
        )
        dead, alive = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started
        new = await replacement(proc, dead, alive)
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(16)
        ]
        await eventually(lambda: len(slow.received) == 16)

        async def shared() -> bool:
            rows = {pid: a["replicas"][0] for pid, a in (await worker_pids(proc, 2)).items()}
            assert set(rows) == {alive, new}
            own = {pid: r["in_flight"] for pid, r in rows.items()}
            return (
                all(own.values())
                and rows[alive]["peers_in_flight"] == own[new]
                and rows[new]["peers_in_flight"] == own[alive]
            )

        await eventually(shared)
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 16
    finally:
        await slow.stop()


_STOP_DURING_SPAWN = """
import os, signal, sys
from router.service import supervisor

real_pipe, calls = os.pipe, [0]

def pipe():
    calls[0] += 1
    if calls[0] == 3:  # the second worker's: after spawn's stop check, before its fork
        # the parent's SIGTERM handler, run here as CPython may run it: at a bytecode after
        # the signal arrived (before spawn blocked it), past that check
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    return real_pipe()

os.pipe = pipe

def work(group, index, ready_fd, replacing):
    os.write(ready_fd, b"x")
    while True:
        signal.pause()

sys.exit(supervisor.supervise(2, 0, work))
"""


def test_a_stop_whose_handler_runs_during_a_fork_stops_that_worker_too() -> None:
    """A signal's Python handler runs at a later bytecode than its C handler, so the parent's
    ``forward`` could run between a spawn's stop check and its fork: it stopped the workers
    listed then, the new one never heard of the stop and the parent waited for it forever."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _STOP_DURING_SPAWN], env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    try:
        assert proc.wait(timeout=20) == 0
    finally:
        left = _children_of(proc.pid)  # (a worker the old code left behind)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in left:
            os.kill(pid, signal.SIGKILL)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        try:
            stat_line = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and int(stat_line.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


_LISTENED_THEN_DIED = """
import os, signal, sys
from router.service import supervisor

real_write = supervisor._write

def write(directory, name, text):
    if name == supervisor.PIDS_FILE and not getattr(write, "held", False):
        write.held = True
        # the parent busy elsewhere (forking, writing) while its first worker says it
        # listens and dies: it is reaped before its byte is read
        pid = int(text.split()[0])
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    real_write(directory, name, text)

supervisor._write = write

def work(group, index, ready_fd, replacing):
    os.write(ready_fd, b"x")
    if not replacing:
        os._exit(3)  # (a crash just after it listened)
    os.kill(os.getppid(), signal.SIGTERM)  # the replacement stops the router: done
    while True:
        signal.pause()

sys.exit(supervisor.supervise(1, 0, work))
"""


def test_a_worker_that_listened_and_died_before_its_byte_was_read_is_replaced() -> None:
    """A worker that said it listens is replaced when it dies, also when the parent reaps it
    before reading its byte (both waiting when the parent looks): the parent took it for a
    worker of the first start that never listened and stopped the whole router with its
    status."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _LISTENED_THEN_DIED],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        left = _children_of(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
