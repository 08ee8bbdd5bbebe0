"""The HTTP admin endpoints' credentials (router/service/admin.py ``authorised``): a real
router on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from router.service.config import build_settings
from tests.backends import kimi_model_table, start_router

ADMIN = "admin-secret"
KEY = "client-key"


async def _router(admin_token: str | None) -> AsyncIterator[str]:
    server = {"admin_token": admin_token} if admin_token else {}
    settings = build_settings(
        {
            "server": {**server, "api_keys": KEY},
            "replicas": [{"url": "http://127.0.0.1:9", "model": "kimi", "name": "a"}],
            "models": {"kimi": kimi_model_table()},
        }
    )
    running, url = await start_router(settings)
    try:
        yield url
    finally:
        await running.cleanup()


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async for u in _router(ADMIN):
        yield u


@pytest.fixture
async def unset_url() -> AsyncIterator[str]:
    async for u in _router(None):
        yield u


CALLS = (
    ("GET", "/admin/replicas"),
    ("GET", "/admin/decisions"),
    ("GET", "/admin/pd"),
    ("POST", "/admin/replicas/a/drain"),
    ("POST", "/admin/replicas/a/undrain"),
)


async def _status(url: str, method: str, path: str, headers: dict[str, str]) -> int:
    async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=headers) as r:
        await r.read()
        return r.status


async def test_every_admin_path_refuses_a_missing_or_wrong_token(url: str) -> None:
    for method, path in CALLS:
        assert await _status(url, method, path, {}) == 401, path
        assert await _status(url, method, path, {"X-Admin-Token": "wrong"}) == 401, path
        assert await _status(url, method, path, {"Authorization": "Bearer wrong"}) == 401, path
        assert await _status(url, method, path, {"Authorization": f"Bearer {KEY}"}) == 401, path
        assert await _status(url, method, path, {"Authorization": f"Bearer {ADMIN}"}) == 200


async def test_every_admin_path_is_403_without_a_configured_token(unset_url: str) -> None:
    for method, path in CALLS:
        assert await _status(unset_url, method, path, {"X-Admin-Token": ""}) == 403, path
        assert await _status(unset_url, method, path, {"Authorization": "Bearer "}) == 403


async def test_x_admin_token_counts_beside_a_client_key_in_authorization(url: str) -> None:
    # a gateway that sends every request with the client's key (Authorization) and adds
    # the admin token as X-Admin-Token, as documented: either header carries it
    both = {"Authorization": f"Bearer {KEY}", "X-Admin-Token": ADMIN}
    for method, path in CALLS:
        assert await _status(url, method, path, both) == 200, path


async def test_a_non_ascii_token_matches_as_a_client_sends_it() -> None:
    """Header bytes are read as latin-1; the token was compared as their UTF-8 re-encoding,
    so a token with any non-ASCII character could never match."""
    token = "sécret-ü-管理"
    async for url in _router(token):
        sent = token.encode()  # as clients send it: UTF-8 bytes
        for header in (b"X-Admin-Token: " + sent, b"Authorization: Bearer " + sent):
            reader, writer = await asyncio.open_connection(*url[7:].split(":"))
            writer.write(b"GET /admin/replicas HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
            status = (await reader.readline()).split()[1]
            writer.close()
            assert status == b"200", header


def test_an_admin_token_that_is_also_a_client_key_is_refused(tmp_path: Path) -> None:
    """The admin routes take the token in ``Authorization: Bearer``, where clients send their
    key: an admin token equal to a client key (inline or in api_keys_file) let every client
    holding that key drain the fleet. Refused when the app is built, as a grpc_token equal to
    a client key is; the message does not show the key."""
    from router.core.errors import ConfigError
    from router.service.app import create_app

    keys = tmp_path / "keys.txt"
    keys.write_text(f"{KEY}  # a client\n")
    for server in ({"api_keys": f"other,{KEY}"}, {"api_keys_file": str(keys)}):
        settings = build_settings(
            {
                "server": {**server, "admin_token": KEY},
                "replicas": [{"url": "http://127.0.0.1:9", "model": "kimi", "name": "a"}],
                "models": {"kimi": kimi_model_table()},
            }
        )
        with pytest.raises(ConfigError, match="admin_token: must differ from every client key"):
            create_app(settings)
        try:
            create_app(settings)
        except ConfigError as exc:
            assert KEY not in str(exc)


async def test_a_drain_of_a_malformed_rank_is_404_not_500(url: str) -> None:
    """``name#dpN`` names one rank; a rank that ``str.isdigit`` takes but ``int`` refuses (a
    superscript digit, more than 4300 digits) crashed the handler with a 500."""
    admin = {"X-Admin-Token": ADMIN}
    for rank in ("\u00b2", "\u0663", "9" * 5000, "x", "-1"):
        for verb in ("drain", "undrain"):
            path = f"/admin/replicas/a%23dp{rank}/{verb}"
            assert await _status(url, "POST", path, admin) == 404, (rank[:8], verb)
    assert await _status(url, "POST", "/admin/replicas/a%23dp0/drain", admin) == 200
