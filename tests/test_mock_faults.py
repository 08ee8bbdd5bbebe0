"""The mock replica's fault mode (router/mock/faults.py) on a real ``kvrouter mock-replica``
process: chosen by flag, switched at run time by ``POST /admin/fault``, each mode seen by a
plain HTTP client as the router would see it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.procs import FAST, Fleet

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 2}


async def _set(session: aiohttp.ClientSession, url: str, mode: str) -> None:
    async with session.post(url + "/admin/fault", json={"mode": mode}) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["mode"] == mode


async def test_fault_modes_by_flag_and_at_run_time(tmp_path: Path) -> None:
    with Fleet(tmp_path) as fleet:
        mock = fleet.mock("bad", time_scale=FAST, extra=["--fault", "429"])
        url = mock.url + "/v1/completions"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=BODY) as r:  # by flag
                assert r.status == 429
                assert r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == 429
            async with s.get(mock.url + "/health") as r:  # the rest answers
                assert r.status == 200

            await _set(s, mock.url, "500")
            async with s.post(url, json=BODY) as r:
                assert r.status == 500

            short = aiohttp.ClientTimeout(total=0.5)
            await _set(s, mock.url, "hang")
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url, json=BODY, timeout=short) as r:
                    pass

            await _set(s, mock.url, "head-only")
            async with s.post(url, json=BODY) as r:
                assert r.status == 200
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(r.read(), 0.5)

            await _set(s, mock.url, "short-body")
            async with s.post(url, json=BODY) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()

            await _set(s, mock.url, "slow:0.2")
            async with s.post(url, json=BODY) as r:
                assert r.status == 200
                assert (await r.json())["usage"]["prompt_tokens"] > 0

            await _set(s, mock.url, "none")
            async with s.post(url, json=BODY) as r:
                assert r.status == 200
            async with s.post(mock.url + "/admin/fault", json={"mode": "sometimes"}) as r:
                assert r.status == 400
            async with s.get(mock.url + "/admin/fault") as r:
                got = await r.json()
                assert got["mode"] == "none" and got["injected"] == 6
