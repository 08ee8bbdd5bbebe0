"""gRPC Admin Drain / Undrain with several worker processes (``server.workers = N``).

Every worker binds the gRPC port with SO_REUSEPORT, so a call lands on one of them; the drain
must still reach every worker (through the control sockets the HTTP admin drain uses, see
tests/test_workers_admin.py), or the drained replica keeps the other workers' traffic. Real
``kvrouter serve --workers 2`` processes, the generated client stubs over a real channel, and
HTTP requests over fresh connections to look at each worker's state.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import grpc
import pytest

from router.rpc.gen import admin_pb2, admin_pb2_grpc, router_pb2, router_pb2_grpc
from router.service.report_relay import Reported
from tests.backends import Backend
from tests.ports import free_port
from tests.procs import Fleet, Proc
from tests.test_workers_admin import TOKEN, call, start_router, traffic, worker_pids
from tests.waiting import eventually

META = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


async def grpc_router(
    fleet: Fleet, backends: list[Backend], engine: str, dp_ranks: dict[str, int] | None = None
) -> tuple[Proc, str]:
    port = free_port()
    proc = await start_router(
        fleet, backends, workers=2, engine=engine, dp_ranks=dp_ranks, server={"grpc_port": port}
    )
    return proc, f"127.0.0.1:{port}"


async def admin_call(target: str, method: str, **fields: Any) -> Any:
    """One Admin call on a new channel (a new connection: the kernel picks the worker)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        return await getattr(stub, method)(
            admin_pb2.DrainRequest(**fields), metadata=META, timeout=10
        )


async def draining_per_worker(proc: Proc) -> dict[int, dict[str, bool]]:
    """{worker pid: {replica: draining}} from every worker's GET /admin/replicas."""
    answers = await worker_pids(proc, 2)
    return {
        pid: {r["replica"]: r["draining"] for r in answer["replicas"]}
        for pid, answer in answers.items()
    }


@pytest.mark.parametrize("engine", ["fast"])
async def test_grpc_drain_and_undrain_reach_every_worker(fleet: Fleet, engine: str) -> None:
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc, target = await grpc_router(fleet, [b0, b1], engine)
        out = await admin_call(target, "Drain", replica="b1", all_ranks=True)
        assert out.changed == 1
        states = await draining_per_worker(proc)
        assert list(states.values()) == [{"b0": False, "b1": True}] * 2, states
        b0.received.clear()
        b1.received.clear()
        await traffic(proc, 40)
        assert b1.received == [] and len(b0.received) == 40  # no worker routes to b1
        again = await admin_call(target, "Drain", replica="b1", all_ranks=True)
        assert again.changed == 0  # already drained where the call landed
        out = await admin_call(target, "Undrain", replica="b1", all_ranks=True)
        assert out.changed == 1
        states = await draining_per_worker(proc)
        assert list(states.values()) == [{"b0": False, "b1": False}] * 2, states
    finally:
        await b0.stop()
        await b1.stop()


@pytest.mark.parametrize("rank", [0, 1])
async def test_grpc_drain_of_one_rank_reaches_every_worker_and_only_that_rank(
    fleet: Fleet, rank: int
) -> None:
    """``dp_rank`` without ``all_ranks`` is one rank on every worker: rank 0 too (whose key
    prints as the bare name, which would mean every rank)."""
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc, target = await grpc_router(fleet, [b0, b1], "fast", dp_ranks={"b1": 2})
        out = await admin_call(target, "Drain", replica="b1", dp_rank=rank)
        assert out.changed == 1
        want = {"b0": False, "b1": rank == 0, "b1#dp1": rank == 1}
        states = await draining_per_worker(proc)
        assert list(states.values()) == [want] * 2, states
        b1.received.clear()
        await traffic(proc, 45)
        ranks = {r["headers"].get("x-data-parallel-rank") for r in b1.received}
        assert ranks == {str(1 - rank)}, ranks
        await admin_call(target, "Undrain", replica="b1", dp_rank=rank)
        states = await draining_per_worker(proc)
        assert all(not any(s.values()) for s in states.values()), states
    finally:
        await b0.stop()
        await b1.stop()


async def test_grpc_drain_that_misses_a_worker_is_unavailable_naming_it(fleet: Fleet) -> None:
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc, target = await grpc_router(fleet, [b0, b1], "fast")
        dead, _survivor = sorted(await worker_pids(proc, 2))
        os.kill(dead, signal.SIGKILL)  # a worker of the router this test started
        await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin_call(target, "Drain", replica="b1", all_ranks=True)
        err = info.value
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert str(dead) in err.details() and "1 of 2" in err.details(), err.details()
        # applied where it could be: the surviving worker no longer routes to b1
        b1.received.clear()
        await traffic(proc, 10)
        assert b1.received == []
        status, data = await call(proc, "GET", "/admin/replicas")
        # the survivor, or the dead one's replacement (the supervisor may have started it
        # by now, on a slow machine), which takes the survivor's drains before it listens
        assert status == 200 and data["worker_pid"] != dead, data
        assert {r["replica"]: r["draining"] for r in data["replicas"]} == {"b0": False, "b1": True}
    finally:
        await b0.stop()
        await b1.stop()


async def pick_each(target: str, count: int, meta: Any = ()) -> list[str]:
    """``count`` Picks, each on a new connection (the kernel picks the worker): their ids."""
    ids = []
    for i in range(count):
        async with grpc.aio.insecure_channel(target) as channel:
            pick = router_pb2.PickRequest(
                model="m", token_ids=router_pb2.TokenIds(ids=[i + 1] * 40)
            )
            got = await router_pb2_grpc.RouterStub(channel).Pick(pick, metadata=meta, timeout=10)
            ids.append(got.decision_id)
    return ids


async def report_each(target: str, ids: list[str], meta: Any = ()) -> list[bool]:
    """A COMPLETED Report of each of ``ids``, each on a new connection: ``accepted``."""
    accepted = []
    for decision in ids:
        async with grpc.aio.insecure_channel(target) as channel:
            done = router_pb2.ReportRequest(
                decision_id=decision, phase=router_pb2.ReportRequest.COMPLETED
            )
            got = await router_pb2_grpc.RouterStub(channel).Report(done, metadata=meta, timeout=10)
            accepted.append(got.accepted)
    return accepted


async def in_flight_per_replica(proc: Proc) -> list[int]:
    rows = await worker_pids(proc, 2)
    return [r["in_flight"] for a in rows.values() for r in a["replicas"]]


@pytest.mark.parametrize(("owner", "status"), [(None, None), ("key:3", 400), ("key:0", 503)])
def test_a_relayed_report_carries_its_caller(owner: str | None, status: int | None) -> None:
    """What the control socket's report route reads back of a relayed Report's target
    (its caller, and the replica's answer status that decides whether it is a failure)."""
    sent = Reported("id/with?odd&chars %", 2, 7, 5, owner, status)
    path, _, query = sent.target().partition("?")
    name = unquote(path.removeprefix("/internal/decisions/").removesuffix("/report"))
    got = Reported.parse(name, {k: v[-1] for k, v in parse_qs(query).items()})
    assert got == sent


async def test_a_relayed_report_ends_only_its_own_callers_decision(fleet: Fleet) -> None:
    """The worker a Report lands on hands the reporting caller along with it: the deciding
    worker applies it only to a decision of that caller's key (as a Report landing there
    would be), and answers another key's as an unknown id."""
    keys = ("sk-alpha-0123456789abcdef", "sk-bravo-fedcba9876543210")
    key_a, key_b = ((("authorization", f"Bearer {k}"),) for k in keys)
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        port = free_port()
        server = {"grpc_port": port, "api_keys": ",".join(keys)}
        proc = await start_router(fleet, [b0, b1], workers=2, engine="fast", server=server)
        target = f"127.0.0.1:{port}"
        ids = await pick_each(target, 8, key_a)
        assert await report_each(target, ids, key_b) == [False] * len(ids)
        assert sum(await in_flight_per_replica(proc)) == len(ids)
        assert await report_each(target, ids, key_a) == [True] * len(ids)
        assert await in_flight_per_replica(proc) == [0] * 4
    finally:
        await b0.stop()
        await b1.stop()


async def test_a_report_reaches_the_worker_that_made_the_decision(fleet: Fleet) -> None:
    """A gateway that reconnects between Pick and Report may land on another worker: the
    Report still completes the decision where its load is counted (report_relay.py)."""
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc, target = await grpc_router(fleet, [b0, b1], "fast")
        ids = await pick_each(target, 8)
        assert await report_each(target, ids) == [True] * len(ids)
        assert await in_flight_per_replica(proc) == [0] * 4
        async with grpc.aio.insecure_channel(target) as channel:
            unknown = router_pb2.ReportRequest(
                decision_id="never-picked", phase=router_pb2.ReportRequest.COMPLETED
            )
            got = await router_pb2_grpc.RouterStub(channel).Report(unknown, timeout=10)
            assert not got.accepted
    finally:
        await b0.stop()
        await b1.stop()


async def test_a_handed_over_report_waits_for_no_worker_once_one_applied_it(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The worker that made the decision applies the Report; one other worker that hangs
    must not hold the gateway's Report call (nor each Report after it) until the
    control-socket timeout: the first worker to apply it answers it."""
    import functools

    from router.service import report_relay
    from router.service.workers import PIDS_FILE, Workers

    # a hung worker would hold the call a minute, so only the first answer can end it
    monkeypatch.setattr(
        report_relay, "peer_call", functools.partial(report_relay.peer_call, timeout_s=60.0)
    )
    group = Workers(str(tmp_path), 3)
    deciding, hung = 1, 2  # the other workers' pids, as the parent lists them
    (tmp_path / PIDS_FILE).write_text(f"{os.getpid()}\n{deciding}\n{hung}\n")
    release = asyncio.Event()

    async def applies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.close()

    servers = [
        await asyncio.start_unix_server(applies, group.socket(deciding)),
        await asyncio.start_unix_server(hangs, group.socket(hung)),
    ]
    report = Reported("d-1", router_pb2.ReportRequest.COMPLETED)
    task = asyncio.ensure_future(report_relay.report_to_peers(group, report))
    try:
        await eventually(task.done, message="the Report waited for the hung worker")
        assert task.result() is True and not release.is_set()
    finally:
        release.set()
        task.cancel()
        for server in servers:
            server.close()
