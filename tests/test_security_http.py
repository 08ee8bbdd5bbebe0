"""Front-door security with real processes: client API keys, per-key concurrency limits (429
with Retry-After), header-size limit, admin token, and logs free of secrets and prompt text.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.service.gate import ApiKeys
from router.service.security import RedactingFilter, redact
from tests.procs import Fleet, token_prompt
from tests.waiting import eventually

KEY_A = "sk-alpha-0123456789abcdef"
KEY_B = "sk-bravo-fedcba9876543210"
ADMIN = "adm-7f3c9a1b2d4e"
REDIS_PASSWORD = "redis-pw-5e6f7a8b"
MARKER = "PROMPT-MARKER-zq8x"


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    with Fleet(tmp_path) as f:
        yield f


def _body(seed: int, tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "prompt": token_prompt(seed, 32), "max_tokens": tokens, "stream": stream}


async def _status(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, Any], Any]:
    async with session.post(url + "/v1/completions", json=body or _body(1), headers=headers) as r:
        data = await r.read()
        try:
            parsed = await r.json(content_type=None)
        except ValueError:
            parsed = data
        return r.status, dict(r.headers), parsed


async def test_api_keys_and_per_key_concurrency(fleet: Fleet) -> None:
    mock = fleet.mock("a")
    router = fleet.router(
        "router",
        [("a", mock.url)],
        server={
            "api_keys": f"{KEY_A},{KEY_B}",
            "max_concurrent_per_key": 2,
            "max_header_kb": 4.0,
            "retry_after_s": 2,
        },
    )
    async with aiohttp.ClientSession() as s:
        url = router.url
        # missing / wrong / right key
        code, _, body = await _status(s, url, {})
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "authentication_error"
        code, _, _ = await _status(s, url, {"Authorization": "Bearer sk-alpha-0123456789abcdeX"})
        assert code == 401
        code, _, _ = await _status(s, url, {"Authorization": f"Bearer {KEY_A}"})
        assert code == 200
        code, _, _ = await _status(s, url, {"api-key": KEY_B})
        assert code == 200
        async with s.get(url + "/v1/models") as r:
            assert r.status == 401
        async with s.get(url + "/health") as r:  # probes need no key
            assert r.status == 200

        # per-key concurrency: two long streams (250 tokens: ~1.5 s) hold key A's slots
        started = asyncio.Event()
        count = 0

        async def hold() -> int:
            nonlocal count
            hdr = {"Authorization": f"Bearer {KEY_A}"}
            async with s.post(url + "/v1/completions", json=_body(7, 250, True), headers=hdr) as r:
                await r.content.readline()
                count += 1
                if count == 2:
                    started.set()
                await r.read()
                return r.status

        holders = [asyncio.create_task(hold()) for _ in range(2)]
        await asyncio.wait_for(started.wait(), 10)
        code, headers, body = await _status(s, url, {"Authorization": f"Bearer {KEY_A}"})
        assert code == 429, body
        assert headers.get("Retry-After") == "2"
        assert body["error"]["code"] == "too_many_concurrent_requests"
        assert body["error"]["type"] == "rate_limit_error"
        code, _, _ = await _status(s, url, {"Authorization": f"Bearer {KEY_B}"})
        assert code == 200  # another key is not affected
        assert await asyncio.gather(*holders) == [200, 200]
        code, _, _ = await _status(s, url, {"Authorization": f"Bearer {KEY_A}"})
        assert code == 200  # slots are released when the streams end

        # header block limit
        big = {"Authorization": f"Bearer {KEY_A}", "X-A": "a" * 3000, "X-B": "b" * 3000}
        code, _, body = await _status(s, url, big)
        assert code == 431 and body["error"]["code"] == "request_header_fields_too_large"


async def test_logs_hold_no_secrets_or_prompt_text(fleet: Fleet, tmp_path: Path) -> None:
    mock = fleet.mock("a")
    # an unreachable Redis with a password makes the index follower log warnings that
    # carry its URL; the admin token and API key are in the config; the prompt is marked
    redis_url = f"redis://kv:{REDIS_PASSWORD}@127.0.0.1:1/0"
    router = fleet.router(
        "router",
        [("a", mock.url)],
        server={
            "api_keys": KEY_A,
            "admin_token": ADMIN,
            "redis_url": redis_url,
            "log_level": "debug",
        },
    )
    async with aiohttp.ClientSession() as s:
        hdr = {"Authorization": f"Bearer {KEY_A}"}
        body = {"model": "m", "prompt": f"{MARKER} tell me a secret", "max_tokens": 2}
        assert (await _status(s, router.url, hdr, body))[0] == 200
        chat = {"model": "m", "messages": [{"role": "user", "content": MARKER}], "max_tokens": 2}
        async with s.post(router.url + "/v1/chat/completions", json=chat, headers=hdr) as r:
            assert r.status == 200
        bad = {"Authorization": f"Bearer {KEY_A}x"}
        assert (await _status(s, router.url, bad, body))[0] == 401
        async with s.get(router.url + "/admin/replicas", headers={"X-Admin-Token": ADMIN}) as r:
            assert r.status == 200
        # let the Redis follower fail and log a few times
        await eventually(lambda: router.log().count("index sync:") >= 2)
    router.stop()
    log = router.log()
    # the URL is logged (start-up line, follower warnings), with its password masked
    assert "following redis://kv:***@127.0.0.1:1/0" in log, log[-2000:]
    for secret in (KEY_A, ADMIN, REDIS_PASSWORD, MARKER):
        assert secret not in log, secret


async def test_a_password_holding_an_at_sign_is_masked_whole(fleet: Fleet) -> None:
    """A Redis URL's password may hold an ``@`` (the URL's host is after the last one, as
    redis-py and urllib read it): the log filter masked only up to the first ``@`` and the
    configured secret taken from the URL was cut there too, so the rest of the password
    reached the log."""
    password = "pw-head@pw-tail-9c1d"
    router = fleet.router(
        "router",
        [("a", fleet.mock("a").url)],
        server={"redis_url": f"redis://kv:{password}@127.0.0.1:1/0", "log_level": "debug"},
    )
    await eventually(lambda: router.log().count("index sync:") >= 2)
    router.stop()
    log = router.log()
    assert "redis://kv:***@127.0.0.1:1/0" in log, log[-2000:]
    for part in password.split("@"):
        assert part not in log, part


def test_redaction_patterns() -> None:
    assert (
        redact("connect redis://u:hunter2@h:6379/0 failed")
        == "connect redis://u:***@h:6379/0 failed"
    )
    assert redact("at redis://u:p@ss@h:6379/0 x@y") == "at redis://u:***@h:6379/0 x@y"
    assert redact("http://h:8000/a@b") == "http://h:8000/a@b"  # no password: unchanged
    assert redact("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    # Basic carries user:password, base64-encoded: as good as the password
    assert redact("Authorization: Basic dXNlcjpodW50ZXIy") == "Authorization: Basic ***"
    assert redact("{'authorization': 'Basic dXNlcjpw'}") == "{'authorization': 'Basic ***'}"
    assert redact("a basic question") == "a basic question"
    assert redact("api_key=zzz9 next") == "api_key=*** next"
    assert redact("password: 'p@ss'") == "password: '***'"
    assert "tok3n-value" not in redact("x tok3n-value y", ["tok3n-value"])
    rec = logging.LogRecord("t", logging.INFO, __file__, 1, "url %s", ("rediss://:pw99@h",), None)
    RedactingFilter().filter(rec)
    assert rec.getMessage() == "url rediss://:***@h"


def test_api_key_check_compares_every_key() -> None:
    keys = ApiKeys(["k1-aaaa", "k2-bbbb", "k3-cccc"])
    assert keys.check("k2-bbbb") == 1
    assert keys.check("k3-cccc") == 2
    assert keys.check("k2-bbb") is None
    assert keys.check("") is None
    assert not ApiKeys([])


def test_a_configuration_error_shows_no_password(tmp_path: Path) -> None:
    """A replica URL with credentials is refused at start-up; the refusal, printed to stderr
    before log redaction is installed, names the URL with its password masked, as does a
    KVROUTER_REPLICAS item that is not MODEL=URL."""
    from tests.inprocess import kvrouter

    config = tmp_path / "router.toml"
    config.write_text(
        f'[[replicas]]\nurl = "http://bob:{REDIS_PASSWORD}@127.0.0.1:8000"\nmodel = "m"\n'
    )
    done = kvrouter("serve", "--config", str(config), "--check")
    assert done.returncode == 2, done
    assert "carries credentials" in done.stderr and "http://bob:***@127.0.0.1:8000" in done.stderr
    assert REDIS_PASSWORD not in done.stderr + done.stdout
    done = kvrouter("serve", "--replica", f"http://bob:{REDIS_PASSWORD}@127.0.0.1:8000", "--check")
    assert done.returncode == 2, done
    assert REDIS_PASSWORD not in done.stderr + done.stdout, done.stderr


async def test_the_publishers_log_shows_no_part_of_a_redis_password(
    fleet: Fleet, tmp_path: Path
) -> None:
    # a password holding "@" (the host follows the last one, as redis-py reads the URL):
    # the publisher's start-up line must mask it whole, as the router's log filter does
    from router.bench.redis_server import LocalRedis

    with LocalRedis(tmp_path / "redis", password="s3cret@tail-of-pw") as server:
        mock = fleet.mock("a", events=True)
        pub = fleet.publisher("a", mock, server.url)
        await eventually(lambda: "publishing a" in pub.log() or not pub.alive())
        log = pub.log()
        assert "publishing a" in log, log[-2000:]
        assert "tail-of-pw" not in log and "s3cret" not in log, log[-2000:]
        pub.stop()


def test_redaction_keeps_the_routers_own_messages() -> None:
    """A configuration error names its key and problem ("server.grpc_token: empty; ..."): the
    key=value pattern leaves the problem after a setting's name and ``: `` alone (the router
    never shows a secret setting's value), as a literal secret never masks a setting's name;
    a blank or short secret masks nothing; ``token=VALUE`` outside such a name stays masked."""
    empty = "server.grpc_token: empty; remove the setting or give a value"
    assert redact(empty) == empty
    env = "KVROUTER_SERVER__ADMIN_TOKEN: empty; unset it to leave server.admin_token as configured"
    assert redact(env) == env
    model = "models.org/m-1.5.render_api_key: empty; remove the setting or give a value"
    assert redact(model) == model
    bearer = "server.admin_token: the admin routes take it as a bearer token, where clients"
    assert redact(bearer) == bearer
    # admin_token = "token", grpc_token = "    ": the names and the indentation stay
    traceback = "server.grpc_token: must differ\n    line 1"
    assert redact(traceback, ["token", "    ", " "]) == traceback
    assert redact("x token y", ["token"]) == "x *** y"
    assert redact("server.admin_token=abc9 grpc_token: xyz8") == (
        "server.admin_token=*** grpc_token: ***"
    )
    assert redact("Authorization: Bearer token9x") == "Authorization: Bearer ***"


def test_serve_prints_a_configuration_error_whole(tmp_path: Path) -> None:
    """``serve`` redacts its configuration error (a URL's password) without masking the
    problem it names."""
    from tests.inprocess import kvrouter

    config = tmp_path / "router.toml"
    config.write_text('[server]\ngrpc_token = ""\n')
    done = kvrouter("serve", "--config", str(config), "--check")
    assert done.returncode == 2, done
    assert "server.grpc_token: empty; remove the setting" in done.stderr, done.stderr
