"""A private ``redis-server`` process on a free loopback port: what ``kvrouter bench store``
measures against when no ``--redis`` is given (``--cluster N``: a private Redis Cluster), and
what the test suite starts (tests/conftest.py).

Never touches a shared instance: it binds 127.0.0.1 on a port nobody listens on, persists
nothing (``--save '' --appendonly no``) and keeps its working files in a directory the
caller owns. ``restart()`` brings it back empty on the same port (a Redis restart as far as
clients can tell).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from router.bench.ports import free_port as free_port
from router.sigterm import held


def _ping(port: int, password: str | None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if password:
                sock.sendall(f"AUTH {password}\r\n".encode())
                sock.recv(64)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass(slots=True)
class LocalRedis:
    """A redis-server child process. ``url`` carries the password when one is set."""

    workdir: Path
    port: int = 0
    password: str | None = None
    binary: str = "redis-server"
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        """Start the server (on a fresh free port unless one is set) and wait for PONG."""
        exe = shutil.which(self.binary)
        if exe is None:
            raise RuntimeError(f"{self.binary} not found on PATH (apt-get install redis-server)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port()
        args = [
            exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.extra_args,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        with held():
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err.strip()}")
            if _ping(self.port, self.password):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and wait for it to exit."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr is not None:
            with contextlib.suppress(OSError):
                proc.stderr.close()

    def restart(self) -> None:
        """Stop and start again on the same port with an empty dataset."""
        self.stop()
        self.start()

    def __enter__(self) -> LocalRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass(slots=True)
class LocalRedisCluster:
    """A Redis Cluster of ``nodes`` primaries (no replicas) as child processes, for tests:
    each node is a :class:`LocalRedis` with cluster mode on; ``redis-cli --cluster create``
    assigns the slots. ``url`` is a ``redis+cluster://`` URL of the first node.
    ``extra_args``: more redis-server arguments for every node."""

    workdir: Path
    nodes: int = 3
    extra_args: tuple[str, ...] = ()
    servers: list[LocalRedis] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    def start(self, timeout_s: float = 20.0) -> LocalRedisCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli not found on PATH (apt-get install redis-tools)")
        for i in range(self.nodes):
            node = LocalRedis(
                self.workdir / f"node{i}",
                port=_cluster_port(),
                extra_args=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                    *self.extra_args,
                ),
            )
            self.servers.append(node.start())
        addrs = [f"127.0.0.1:{s.port}" for s in self.servers]
        try:
            subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=timeout_s,
            )
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                states = [
                    subprocess.run(
                        [cli, "-p", str(s.port), "cluster", "info"],
                        capture_output=True,
                        text=True,
                        timeout=5,
                    ).stdout
                    for s in self.servers
                ]
                if all("cluster_state:ok" in st for st in states):
                    return self
                time.sleep(0.1)
        except (subprocess.SubprocessError, OSError) as exc:
            self.stop()
            raise RuntimeError(f"could not form the Redis cluster: {exc}") from None
        self.stop()
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()

    def __enter__(self) -> LocalRedisCluster:
        return self.start() if not self.servers else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
