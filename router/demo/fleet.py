"""Processes of the live demo: mock replicas, optional publishers, the router. Each is a real
subprocess on loopback; ``Fleet`` starts them, waits until they answer and always stops every
one of them (``async with``). With ``policy=None`` no kvrouter is started: the caller puts
another router in front of the mocks with :meth:`Fleet.start_router` (``kvrouter bench live``
does, for vllm-router); ``replicas`` lists what each mock serves on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.bench.redis_server import free_port
from router.sigterm import held

MODEL = "demo-model"
PROFILE = "kimi-k3"  # the mission's model: hybrid KDA + MLA


@dataclass(slots=True, frozen=True)
class FleetSpec:
    replicas: int
    policy: str | None
    block_size: int = 64
    kv_blocks: int = 16384
    profile: str = PROFILE
    redis_url: str | None = None
    key_prefix: str = "kvr-demo"
    record_path: str | None = None
    # prefill/decode disaggregation (docs/pd.md): None: off (no roles); else the router's
    # [models.NAME.pd] mode, the replicas spread over ``racks`` with roles by rack (sim/pd.py)
    pd: str | None = None
    racks: int = 2
    prefill_share: float = 0.5
    time_scale: float = 1.0  # the mocks' --time-scale
    # tokens per block in the mocks' KV events: kimi-k3's MLA attention runs on 64-token pages
    # in vLLM (FlashMLA supports only 64; FlashInfer MLA is set to 64: vLLM PRs #13747, #24692)
    engine_block_size: int = 64
    speculative_ttl_s: float | None = None  # the router model's; None: its default

    def roles(self) -> list[tuple[str, str]]:
        """(rack, role) of each replica."""
        if self.pd is None:
            return [(f"rack-{i // 9}", "both") for i in range(self.replicas)]
        from router.core.types import ReplicaKey
        from sim.pd import roles_of, sites_of

        keys = [
            ReplicaKey(f"reg0-rack{i * self.racks // self.replicas}-r{i}")
            for i in range(self.replicas)
        ]
        sites = sites_of(keys)
        roles = roles_of(keys, sites, self.pd, self.prefill_share)
        return [(sites[k].rack, roles[k].value) for k in keys]


@dataclass
class Fleet:
    spec: FleetSpec
    router_url: str = ""
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    replicas: list[dict[str, str]] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _ports: set[int] = field(default_factory=set)

    def _port(self) -> int:
        """A free loopback port not handed out before in this fleet (free_port alone can
        return the same port twice, since each probe socket is closed at once)."""
        while True:
            port = free_port()
            if port not in self._ports:
                self._ports.add(port)
                return port

    def _spawn(self, name: str, *args: str) -> None:
        self._spawn_cmd(name, [sys.executable, "-m", "router.cli", *args])

    def _spawn_cmd(self, name: str, cmd: list[str]) -> None:
        assert self._tmp is not None
        log = open(Path(self._tmp.name) / f"{name}.log", "wb")  # noqa: SIM115
        with held():
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            self.procs.append((name, proc))
        log.close()

    def port(self) -> int:
        """A free loopback port for a process the caller adds to the fleet."""
        return self._port()

    async def start_router(
        self, name: str, cmd: list[str], url: str, ready: str = "/health"
    ) -> None:
        """Start ``cmd`` (a router listening on ``url``) as part of the fleet; wait until
        ``ready`` answers 200. It is stopped with the rest."""
        self._spawn_cmd(name, cmd)
        await self._wait_healthy([url], path=ready, timeout_s=60)
        self.router_url = url

    def cpu_seconds(self, name: str) -> float | None:
        """CPU seconds (user + system) process ``name`` has used so far; None when it is not
        running or the platform has no /proc."""
        for proc_name, proc in self.procs:
            if proc_name == name and proc.poll() is None:
                try:
                    with open(f"/proc/{proc.pid}/stat") as fh:
                        fields = fh.read().rsplit(")", 1)[1].split()
                except OSError:
                    return None
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return None

    def log_tail(self, name: str, lines: int = 20) -> str:
        assert self._tmp is not None
        path = Path(self._tmp.name) / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    async def __aenter__(self) -> Fleet:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrouter-demo-")
        s = self.spec
        try:
            replicas = []
            placement = s.roles()
            for i in range(s.replicas):
                rack, role = placement[i]
                where = ["--rack", rack, "--region", "reg0"] if s.pd else []
                port, zmq, replay = self._port(), self._port(), self._port()
                name = f"replica-{i}"
                self._spawn(
                    name, "mock-replica", "--port", str(port), "--model", MODEL,
                    "--replica", name, "--profile", s.profile, "--block-size", str(s.block_size),
                    "--kv-blocks", str(s.kv_blocks), "--zmq", f"tcp://127.0.0.1:{zmq}",
                    "--replay", f"tcp://127.0.0.1:{replay}", "--log-level", "warning", *where,
                    "--time-scale", str(s.time_scale),
                    "--engine-block-size", str(s.engine_block_size),
                )  # fmt: skip
                rep = {"url": f"http://127.0.0.1:{port}", "model": MODEL, "name": name,
                       "rack": rack}  # fmt: skip
                if s.pd:
                    rep.update(region="reg0", role=role)
                if s.redis_url:
                    self._spawn(
                        f"publisher-{i}", "publish", "--replica", name, "--model", MODEL,
                        "--url", rep["url"], "--zmq", f"tcp://127.0.0.1:{zmq}",
                        "--replay", f"tcp://127.0.0.1:{replay}", "--block-size",
                        str(s.block_size), "--engine-metrics", f"{rep['url']}/metrics",
                        "--redis", s.redis_url, "--key-prefix", s.key_prefix,
                        "--log-level", "warning", "--role", role, "--rack", rack,
                    )  # fmt: skip
                else:
                    rep["zmq"] = f"tcp://127.0.0.1:{zmq}"
                    rep["zmq_replay"] = f"tcp://127.0.0.1:{replay}"
                replicas.append(rep)
                self.replicas.append(
                    {
                        **rep,
                        "zmq": f"tcp://127.0.0.1:{zmq}",
                        "zmq_replay": f"tcp://127.0.0.1:{replay}",
                    }
                )
            await self._wait_healthy([r["url"] for r in replicas])
            if s.policy is None:
                return self
            port = self._port()
            config = Path(self._tmp.name) / "router.toml"
            config.write_text(_router_toml(s, port, replicas))
            self._spawn("router", "serve", "--config", str(config))
            self.router_url = f"http://127.0.0.1:{port}"
            await self._wait_healthy([self.router_url], path="/ready")
        except BaseException:
            await self.stop()
            raise
        return self

    async def _wait_healthy(
        self, urls: list[str], path: str = "/health", timeout_s: float = 30.0
    ) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession() as session:
            for url in urls:
                while True:
                    self.check_alive()
                    try:
                        async with session.get(url + path) as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if asyncio.get_running_loop().time() > deadline:
                        raise RuntimeError(f"{url}{path} did not come up within {timeout_s:g} s")
                    await asyncio.sleep(0.1)

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {proc.returncode}:\n{self.log_tail(name)}"
                )

    async def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + 10
        for _, proc in self.procs:
            while proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _cost_table(policy: str | None, profile: str) -> list[str]:
    """The engine profile's timing model as the router's ``policy_params.cost`` for a policy
    that predicts timing: an operator calibrates the router to its engines; a router that
    underestimates their step time under-prices queueing."""
    from router.core.policies import POLICIES
    from sim.profiles import load_profile

    cls = POLICIES.get(policy or "")
    if cls is None or "cost" not in {f.name for f in dataclasses.fields(cls)}:
        return []
    cost = load_profile(profile).cost
    values = [f"{f.name} = {getattr(cost, f.name)!r}" for f in dataclasses.fields(cost)]
    return ["", f'[models."{MODEL}".policy_params.cost]', *values]


def _profile_eagle(profile: str) -> bool:
    """Whether the mocks' engine profile drops a block of every hit (EAGLE / MTP), which the
    router is told as an operator would tell it ([models.NAME] eagle), as the simulator's
    routers are (sim/cluster.py)."""
    from sim.profiles import load_profile

    return load_profile(profile).eagle


def _router_toml(s: FleetSpec, port: int, replicas: list[dict[str, str]]) -> str:
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "debug_header = true",
        'log_level = "warning"',
    ]
    if s.redis_url:
        lines += [f'redis_url = "{s.redis_url}"', f'redis_key_prefix = "{s.key_prefix}"']
    if s.record_path:
        lines += [f"record_path = {json.dumps(s.record_path)}"]
    lines += ["", f'[models."{MODEL}"]', f'policy = "{s.policy}"', f"block_size = {s.block_size}"]
    lines += [f"engine_block_size = {s.engine_block_size}"]  # the mocks' (FleetSpec)
    if _profile_eagle(s.profile):  # its engines give back a block of every hit: say so
        lines += ["eagle = true"]
    if s.speculative_ttl_s is not None:
        lines += [f"speculative_ttl_s = {float(s.speculative_ttl_s)}"]
    lines += _cost_table(s.policy, s.profile)
    if s.pd:
        lines += ["", f'[models."{MODEL}".pd]', f'mode = "{s.pd}"']
    for rep in replicas:
        lines += ["", "[[replicas]]"] + [f'{k} = "{v}"' for k, v in rep.items()]
    return "\n".join(lines) + "\n"
