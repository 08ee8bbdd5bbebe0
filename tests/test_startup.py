"""Start-up of ``kvrouter serve`` and ``kvrouter mock-replica``: the collector is off while a
process imports and builds, and on (with what it built frozen) once it has (router/startup.py);
a process imports the libraries of what it is configured to do, at start-up, and not those
of what it is not (Jinja2 without a chat template, ZMQ without KV-event endpoints)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from router.startup import building
from tests.ports import free_port

SERVE_PROBE = """
import json, sys
from router.cli import build_parser
from router.service.app import create_app
from router.service.cli import settings_from_args

create_app(settings_from_args(build_parser("serve").parse_args(["serve", *sys.argv[1:]])))
print(json.dumps(sorted(m for m in ("jinja2", "zmq") if m in sys.modules)))
"""

# the mock's app built and started (its cleanup contexts: the KV-event publisher), then stopped
MOCK_PROBE = """
import asyncio, json, sys
from aiohttp import web
from router.cli import build_parser
from router.mock.cli import _build

app = _build(build_parser("mock-replica").parse_args(["mock-replica", *sys.argv[1:]]))

async def start_and_stop():
    runner = web.AppRunner(app)
    await runner.setup()
    await runner.cleanup()

asyncio.run(start_and_stop())
print(json.dumps(sorted(m for m in ("jinja2", "zmq") if m in sys.modules)))
"""


def _loaded(probe: str, *argv: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_a_router_without_template_or_events_loads_neither_jinja2_nor_zmq() -> None:
    assert _loaded(SERVE_PROBE, "--replica", "m=http://127.0.0.1:9") == []


def test_a_router_with_a_chat_template_loads_jinja2_as_it_builds(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    config = tmp_path / "router.toml"
    config.write_text(
        '[[replicas]]\nname = "a"\nurl = "http://127.0.0.1:9"\nmodel = "m"\n'
        f"[models.m]\nchat_template = {json.dumps(str(template))}\n"
    )
    assert _loaded(SERVE_PROBE, "--config", str(config)) == ["jinja2"]


def test_a_mock_replica_without_events_loads_neither_jinja2_nor_zmq() -> None:
    assert _loaded(MOCK_PROBE, "--port", "0") == []


def test_a_mock_replica_publishing_events_loads_zmq_as_it_starts() -> None:
    zmq = f"tcp://127.0.0.1:{free_port()}"
    assert _loaded(MOCK_PROBE, "--port", "0", "--zmq", zmq) == ["zmq"]


def test_building_turns_the_collector_off_then_on_with_its_objects_frozen() -> None:
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with building():
        assert not gc.isenabled()
        kept = [[i] for i in range(1000)]  # what start-up builds: it lives on
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(kept)


def test_building_turns_the_collector_back_on_when_start_up_fails() -> None:
    with pytest.raises(ValueError), building():
        raise ValueError("refused setting")
    assert gc.isenabled()


def test_building_leaves_a_collector_that_was_off_off() -> None:
    gc.disable()
    try:
        with building():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
