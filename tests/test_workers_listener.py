"""``server.listener``: how the workers of ``kvrouter serve --workers N`` share the port.

``reuseport``: each worker binds its own socket with SO_REUSEPORT; the kernel hashes each
new connection to one socket's accept queue, so a worker that dies resets the connections
queued on its socket, and a stopped one keeps getting its share, unanswered. ``shared``: the
parent binds one socket before forking and every worker accepts from it, so whichever
worker runs takes them. Real ``kvrouter serve`` processes on loopback, raw sockets for the
queued connections (opened, the kernel's handshake done, while no worker accepts).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.backends import Backend
from tests.procs import Fleet, Proc
from tests.test_workers_admin import (
    TOKEN,
    call,
    replacement,
    start_router,
    traffic,
    worker_pids,
)
from tests.waiting import eventually

QUEUED = 40  # connections opened while no worker accepts


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


def _migrates() -> bool:
    """Whether the kernel hands a closed SO_REUSEPORT socket's queue to another one."""
    try:
        return Path("/proc/sys/net/ipv4/tcp_migrate_req").read_text().strip() == "1"
    except OSError:
        return False


async def _open(proc: Proc) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection whose request is sent: the kernel completed the handshake (it sits in a
    listening socket's accept queue until a worker accepts it)."""
    host, port = proc.url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /admin/replicas HTTP/1.1\r\nHost: router\r\nConnection: close\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\n\r\n"
    )
    await writer.drain()
    return reader, writer


async def _answer(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> int | str:
    """The pid of the worker that answered, or how the connection failed."""
    reader, writer = conn
    try:
        data = await asyncio.wait_for(reader.read(), 20)
    except (ConnectionError, TimeoutError) as exc:
        return type(exc).__name__
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return f"no answer: {data[:80]!r}"
    return int(json.loads(body)["worker_pid"])


@pytest.mark.parametrize("listener", ["reuseport", "shared"])
async def test_connections_queued_on_a_killed_worker(fleet: Fleet, listener: str) -> None:
    """Both workers stopped, connections queue; one is SIGKILLed, the other continues.
    ``shared``: one queue, the survivor answers every connection. ``reuseport``: the ones
    the kernel had queued on the killed worker's socket are reset (documents the defect;
    ``tcp_migrate_req=1`` would hand them over instead)."""
    b0 = await Backend("b0", ["m"]).start()
    stopped: list[int] = []
    try:
        # (reuseport: the default, so that this also runs on a router without the key)
        server: dict[str, Any] = {"worker_hang_s": 0}  # stopped here, never killed as hung
        if listener == "shared":
            server["listener"] = "shared"
        proc = await start_router(fleet, [b0], workers=2, engine="fast", server=server)
        dead, alive = sorted(await worker_pids(proc, 2))
        for pid in (dead, alive):  # workers of the router this test started
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        conns = [await _open(proc) for _ in range(QUEUED)]
        os.kill(dead, signal.SIGKILL)
        os.kill(alive, signal.SIGCONT)
        stopped.clear()
        answers = await asyncio.gather(*(_answer(c) for c in conns))
        lost = [a for a in answers if not isinstance(a, int)]
        if listener == "shared":
            assert lost == [] and set(answers) == {alive}, answers
        elif not _migrates():
            assert lost, answers  # reset with the killed worker's socket
            assert all(a == alive for a in answers if isinstance(a, int)), answers
        await replacement(proc, dead, alive)  # replaced, on the same port
        await traffic(proc, 10)
        assert proc.stop() == 0, proc.log()[-2000:]
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        await b0.stop()


async def test_a_stopped_worker_leaves_new_connections_to_the_others(fleet: Fleet) -> None:
    """``shared``: a worker that does not run (SIGSTOP here; a stuck event loop alike) takes
    no new connection: the other answers all of them while it stays stopped (with
    ``reuseport`` its share would wait until it runs again or is killed as hung)."""
    b0 = await Backend("b0", ["m"]).start()
    stopped: int | None = None
    try:
        proc = await start_router(
            fleet, [b0], workers=2, engine="fast", server={"listener": "shared", "worker_hang_s": 0}
        )
        pids = sorted(await worker_pids(proc, 2))
        stopped, alive = pids
        os.kill(stopped, signal.SIGSTOP)  # a worker of the router this test started
        answered = set()
        for _ in range(QUEUED):  # (each call fails after 10 s unanswered)
            status, data = await call(proc, "GET", "/admin/replicas")
            assert status == 200, data
            answered.add(data["worker_pid"])
        assert answered == {alive}
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        assert sorted(await worker_pids(proc, 2)) == pids  # it serves again
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        await b0.stop()


async def test_drain_and_metrics_with_a_shared_listener(fleet: Fleet) -> None:
    """``shared``: a drain / undrain reaches every worker, both workers take connections and
    a scrape holds both workers' samples."""
    b0, b1 = await Backend("b0", ["m"]).start(), await Backend("b1", ["m"]).start()
    try:
        proc = await start_router(
            fleet, [b0, b1], workers=2, engine="fast", server={"listener": "shared"}
        )
        assert "(one listening socket, shared)" in proc.log(), proc.log()[-2000:]
        status, out = await call(proc, "POST", "/admin/replicas/b1/drain")
        assert status == 200 and out["workers_applied"] == 2, out
        b1.received.clear()
        await traffic(proc, 40)
        assert b1.received == [] and len(b0.received) >= 40
        assert len(await worker_pids(proc, 2, "/admin/decisions?limit=100")) == 2
        status, out = await call(proc, "POST", "/admin/replicas/b1/undrain")
        assert status == 200 and out["workers_applied"] == 2, out
        b0.received.clear()
        await traffic(proc, 40)
        assert b1.received and b0.received
        status, page = await call(proc, "GET", "/metrics")
        assert status == 200 and "kvrouter_workers_scraped 2" in page, page[-2000:]
        assert proc.stop() == 0, proc.log()[-2000:]
    finally:
        await b0.stop()
        await b1.stop()


async def test_sigterm_with_a_shared_listener_closes_the_port(fleet: Fleet) -> None:
    """``shared``, SIGTERM: requests in flight finish, and the port closes once the workers
    stopped accepting: the parent lets its copy of the socket go, so a new connection is
    refused rather than queued where no worker will take it."""
    slow = await Backend("b0", ["m"], gate=asyncio.Event()).start()  # holds until set
    try:
        proc = await start_router(
            fleet, [slow], workers=2, engine="fast", server={"listener": "shared"}
        )
        held = [
            asyncio.create_task(
                call(proc, "POST", "/v1/completions", {"model": "m", "prompt": f"p{i}"})
            )
            for i in range(8)
        ]
        await eventually(lambda: len(slow.received) == 8)
        proc.signal(signal.SIGTERM)

        async def refused() -> bool:
            try:
                await call(proc, "GET", "/health")
            except aiohttp.ClientConnectorError:  # (not a timeout: queued, unanswered)
                return True
            return False

        await eventually(refused)
        slow.gate.set()  # type: ignore[union-attr]
        assert [s for s, _ in await asyncio.gather(*held)] == [200] * 8
        code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
        assert code == 0, proc.log()[-2000:]
    finally:
        await slow.stop()


def test_listener_setting_and_shared_socket_refusals() -> None:
    """``server.listener`` takes the two modes only; the parent's socket refuses a taken port
    (``kvrouter serve: error: ...``, status 2, as a worker that cannot bind)."""
    import socket

    from router.core.errors import ConfigError
    from router.service.config import build_settings
    from router.service.supervisor import shared_socket

    assert build_settings({"server": {"listener": "shared"}}).server.listener == "shared"
    assert build_settings({}).server.listener == "reuseport"
    with pytest.raises(ConfigError, match=r"server\.listener"):
        build_settings({"server": {"listener": "both"}})
    sock = shared_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0
        with pytest.raises(OSError):
            shared_socket("127.0.0.1", port)
    finally:
        sock.close()
