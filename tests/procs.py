"""Real processes on loopback for fault, security and load tests.

``Proc`` is one child process (``kvrouter serve``, ``kvrouter mock-replica``,
``kvrouter publish`` ...) with its output in a log file, a readiness wait and a stop that
never leaves it behind (SIGTERM, then SIGKILL). ``Fleet`` owns a set of them and stops them
all at once (SIGTERM to each, newest first, then a wait for each); tests use it as a context
manager so a failing assertion still cleans up. Ports come from ``tests.ports.free_port``;
everything binds 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import forkserver
from tests.ports import free_port

KVROUTER = str(Path(sys.executable).parent / "kvrouter")
# a mock replica's --time-scale for tests that do not measure the modelled prefill / decode
# times: the same schedule, 20 times faster
FAST = 0.05


def http_get(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> Any:
    """(status, parsed JSON or text) of a GET; (0, error) when nothing answered."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    except (OSError, urllib.error.URLError) as exc:
        return 0, str(exc)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


@dataclass
class Proc:
    """A child process with its log in ``log_path``."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    url: str = ""
    process: subprocess.Popen[bytes] | forkserver.Forked | None = field(default=None, repr=False)

    def start(self) -> Proc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        if forkserver.ENABLED and self.args[:1] == [KVROUTER]:
            self.process = forkserver.spawn(self.args, self.log_path, env)
            return self
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.process = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_http(self, path: str = "/health", timeout: float = 20.0, status: int = 200) -> None:
        """Wait until ``GET url+path`` answers ``status``; fail with the log if it dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early:\n{self.log()[-3000:]}")
            code, _ = http_get(self.url + path, timeout=1.0)
            if code == status:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log()[-3000:]}")

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (a crash), and reap."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        return proc.returncode


class Fleet:
    """Processes of one test; ``with Fleet(tmp) as f:`` stops them all at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        """SIGTERM to all (newest first), then wait for each: they shut down side by side."""
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.signal(signal.SIGTERM)
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop(timeout=5)

    def spawn(self, name: str, args: Sequence[str], url: str = "", **kw: Any) -> Proc:
        proc = Proc(name, list(args), self.workdir / f"{name}.log", url=url, **kw).start()
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------ kvrouter parts

    def mock(
        self,
        name: str,
        *,
        model: str = "m",
        port: int = 0,
        events: bool = False,
        extra: Sequence[str] = (),
        wait: bool = True,
        time_scale: float = 1.0,
    ) -> Proc:
        """``kvrouter mock-replica``; with ``events`` it publishes KV events on ZMQ
        (``proc.zmq`` / ``proc.replay`` endpoints). ``time_scale``: wall seconds per
        modelled second (``FAST``: the engine's timing is not what the test is about)."""
        port = port or free_port()
        args = [KVROUTER, "mock-replica", "--port", str(port), "--replica", name]
        args += ["--model", model, "--block-size", "16", "--engine-block-size", "16"]
        args += ["--time-scale", str(time_scale)]
        zmq = replay = ""
        if events:
            zmq = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            args += ["--zmq", zmq, "--replay", replay]
        args += ["--log-level", "WARNING", *extra]
        proc = self.spawn(name, args, url=f"http://127.0.0.1:{port}")
        proc.zmq, proc.replay, proc.port = zmq, replay, port  # type: ignore[attr-defined]
        if wait:
            proc.wait_http("/health")
        return proc

    def router(
        self,
        name: str,
        replicas: Sequence[tuple[str, str]],
        *,
        model: str = "m",
        server: dict[str, Any] | None = None,
        port: int = 0,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """``kvrouter serve`` with a TOML config: ``replicas`` are (name, url) pairs."""
        port = port or free_port()
        cfg = self.workdir / f"{name}.toml"
        srv = {"port": port, "log_level": "info", "health_interval_s": 0.5, **(server or {})}
        lines = ["[server]"] + [f"{k} = {_toml(v)}" for k, v in srv.items()]
        for rname, url in replicas:
            lines += ["[[replicas]]", f"name = {_toml(rname)}", f"url = {_toml(url)}"]
            lines += [f"model = {_toml(model)}"]
        lines += [f"[models.{model}]", "block_size = 16", "policy = 'ours'"]
        cfg.write_text("\n".join(lines) + "\n")
        proc = self.spawn(
            name, [KVROUTER, "serve", "--config", str(cfg)], url=f"http://127.0.0.1:{port}", env=env
        )
        proc.port = port  # type: ignore[attr-defined]
        if wait:
            proc.wait_http("/health")
        return proc

    def publisher(
        self,
        name: str,
        mock: Proc,
        redis_url: str,
        *,
        model: str = "m",
        prefix: str = "kvr",
        metrics: bool = False,
        extra: Sequence[str] = (),
    ) -> Proc:
        """``kvrouter publish`` for a mock started with ``events=True``; with ``metrics`` its
        own /metrics is served at ``proc.url``."""
        port = free_port() if metrics else 0
        args = [KVROUTER, "publish", "--replica", name, "--model", model, "--url", mock.url]
        if metrics:
            args += ["--metrics-port", str(port)]
        args += list(extra)
        args += ["--zmq", mock.zmq, "--replay", mock.replay, "--block-size", "16"]  # type: ignore[attr-defined]
        args += ["--redis", redis_url, "--key-prefix", prefix, "--lease-ttl", "3"]
        args += ["--heartbeat", "0.5", "--log-level", "INFO"]
        args += ["--engine-metrics", mock.url + "/metrics"]
        url = f"http://127.0.0.1:{port}" if metrics else ""
        return self.spawn(f"pub-{name}", args, url=url)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def token_prompt(seed: int, n: int, vocab: int = 50000) -> list[int]:
    """A deterministic token-id prompt (``/v1/completions`` with a list of ints)."""
    x = seed * 2654435761 % 2**32 or 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(x % vocab)
    return out


@contextlib.contextmanager
def fleet(workdir: Path) -> Iterator[Fleet]:
    f = Fleet(workdir)
    try:
        yield f
    finally:
        f.stop_all()
