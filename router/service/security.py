"""Front-door protections: client API keys, per-key concurrency limits, header-size limit
(:class:`Limits`, enforced by the gate of router/service/gate.py, which
router.service.handling.handle runs for every request of the public port), prompt-token
limit and log redaction.

All of it is off unless configured (``[server]`` keys, see docs/operations.md):

* ``api_keys`` (comma-separated) and/or ``api_keys_file`` (one key per line, ``#`` comments
  at a line's start or after a space):
  every request but the probes', ``/metrics``' and the admin routes' (router.service.gate
  ``protected``: the ``/v1/`` API, vLLM's ``/tokenize``, pooling and ``/v2/`` routes, unknown
  paths) must carry ``Authorization: Bearer KEY`` (or ``api-key: KEY``).
  Keys are compared in constant time: the given key is hashed (SHA-256) and compared with
  ``hmac.compare_digest`` against *every* configured digest, so neither the position of a
  match nor a common prefix shows in the timing. Missing or wrong key -> 401
  ``invalid_api_key``.
* ``max_concurrent_per_key``: requests in flight (streams count until their last byte) per
  API key, or per client address when no keys are configured; one more -> 429
  ``too_many_concurrent_requests`` with ``Retry-After``.
* ``max_header_kb``: total size of the request's header block, on every path; larger -> 431.
* ``max_prompt_tokens``: prompts with more tokens -> 400 ``context_length_exceeded``
  (checked after tokenization; ``models.NAME.context_length`` is the per-model limit).
* :class:`RedactingFilter`: log records never show bearer tokens, API keys, admin tokens or
  passwords in URLs (``redis://user:PASSWORD@...``); installed on the root logger's handlers
  by ``kvrouter serve``. The router itself never logs prompt text or request bodies.

Health, readiness and metrics stay open (probes and scrapers carry no key); admin endpoints
keep their own token (router.service.admin). The gRPC Router service (Pick / Report) takes
the same client keys and counts a Pick against the same per-key limit until its decision
ends (router/rpc/server.py, docs/grpc.md); gRPC index publishing and admin calls never
accept a client key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from router.core.errors import BadRequest, ConfigError

if TYPE_CHECKING:
    from router.service.settings import ServerSettings


def read_api_keys(inline: str | None, path: str | None) -> tuple[str, ...]:
    """Keys from the comma-separated ``inline`` string and the file at ``path`` (one key a
    line; ``#`` starts a comment at the start of a line or after a space)."""
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"server.api_keys_file: cannot read {path}: {exc.strerror}") from None
        for line in text.splitlines():
            line = _COMMENT.sub("", line).strip()
            if line:
                keys.append(line)
    return tuple(dict.fromkeys(keys))


# a comment of the keys file: ``#`` at the start of a line or after a space; a ``#`` inside a
# key is part of it (cut there, the key's prefix would be let in)
_COMMENT = re.compile(r"(?:^|\s)#.*")


@dataclass(slots=True, frozen=True)
class Limits:
    api_keys: tuple[str, ...] = ()
    max_concurrent_per_key: int = 0  # 0: unlimited
    max_header_bytes: int = 0  # 0: unlimited
    retry_after_s: int = 1

    @classmethod
    def from_server(cls, server: ServerSettings) -> Limits:
        keys = read_api_keys(server.api_keys, server.api_keys_file)
        if not keys and (server.api_keys is not None or server.api_keys_file):
            # (a secret mounted empty, say: without a key the router would be open to all)
            raise ConfigError(
                "server.api_keys / api_keys_file: set, but they hold no client key (the file "
                "is empty or only comments?); give a key, or remove the setting to run open"
            )
        per_key = server.max_concurrent_per_key
        header_kb = server.max_header_kb
        if per_key < 0 or header_kb < 0:
            raise ConfigError("server: max_concurrent_per_key and max_header_kb must be >= 0")
        return cls(keys, per_key, int(header_kb * 1024), int(server.retry_after_s))


def check_grpc_token(server: ServerSettings, limits: Limits) -> None:
    """ConfigError when ``server.grpc_token`` is also a client key: the gRPC port takes the
    token for the trusted gateway's (not counted against per-key limits, and it authorises
    index publishing), so a client holding that key would get both."""
    token = server.grpc_token
    if server.grpc_port is not None and token and token in limits.api_keys:
        raise ConfigError(
            "server.grpc_token: must differ from every client key (api_keys / api_keys_file): "
            "the gRPC token also authorises index publishing and is not held to per-key "
            "limits (docs/grpc.md)"
        )


def check_admin_token(server: ServerSettings, limits: Limits) -> None:
    """ConfigError when ``server.admin_token`` is also a client key: the admin routes take
    the token in ``Authorization: Bearer``, where clients send their keys, so every client
    holding that key could drain the fleet (router.service.admin)."""
    token = server.admin_token
    if token and token in limits.api_keys:
        raise ConfigError(
            "server.admin_token: must differ from every client key (api_keys / api_keys_file): "
            "the admin routes take it as a bearer token, where clients send their keys"
        )


def check_prompt_tokens(server: ServerSettings, prompt_tokens: int) -> None:
    """Raise BadRequest when ``server.max_prompt_tokens`` is set and exceeded."""
    limit = server.max_prompt_tokens
    if limit and prompt_tokens > limit:
        raise BadRequest(
            f"This router accepts at most {limit} prompt tokens (server.max_prompt_tokens); "
            f"your request has {prompt_tokens}."
        )


# ---------------------------------------------------------------------------- logging

_PATTERNS = (
    # scheme://user:password@host -> scheme://user:***@host; the host follows the last "@"
    # (as urllib and redis-py read a URL): a password may hold one
    (re.compile(r"([a-z][a-z0-9+.-]*://[^:/@\s]*:)[^\s/]+@", re.I), r"\1***@"),
    # (not the word after "bearer" in prose: "a bearer token")
    (re.compile(r"(bearer\s+)(?!tokens?\b)[^\s,;'\"]+", re.I), r"\1***"),
    # an Authorization field's Basic credential (user:password in base64): as good as the
    # password; the word alone ("a basic setup") is left
    (
        re.compile(r"(authorization['\"]?\s*[:=]\s*['\"]?basic\s+)[^\s,;'\"]+", re.I),
        r"\1***",
    ),
)
# ``key=value`` / ``key: value`` pairs named like secrets
_KEY_VALUE = re.compile(
    r"((?:api[-_]?key|x-admin-token|admin[-_]token|password|requirepass|token)"
    r"['\"]?\s*[:=]\s*['\"]?)[^\s,;'\"}]+",
    re.I,
)
# A setting's name as the router's messages start a problem with it ("server.grpc_token:
# empty; ...", "models.NAME.render_api_key: ...", "KVROUTER_SERVER__ADMIN_TOKEN: ..."): what
# follows its ": " is the router's own text, never a secret setting's value (those are never
# shown: router/service/config_tables.py checked), and the name itself is never masked
_SETTING_NAME = re.compile(
    r"(?<![\w.\[\]/-])"
    r"(?:(?:server|replicas\[\d+\]|models\.[^\s:]+?)\.[a-z_]\w*|KVROUTER_\w+)(?=:)"
)
# a literal secret shorter than this (blanks aside) is not masked: it would garble the text
# around it (a one-letter token, a token of spaces masking indentation) and hides little
_MIN_SECRET = 4


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with credentials masked: URL passwords, Bearer and Basic credentials,
    ``key=value`` pairs named like secrets, and any literal in ``secrets`` (at least
    ``_MIN_SECRET`` characters besides blanks) - but never a setting's name, nor the problem
    the router's message gives after it (:data:`_SETTING_NAME`)."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    names = [m.span() for m in _SETTING_NAME.finditer(text)]
    # a pair whose key is the end of a setting's name: the router's "name: problem"
    text = _KEY_VALUE.sub(
        lambda m: m.group(0) if _within(names, m.start(), m.start() + 1) else m.group(1) + "***",
        text,
    )
    literal = sorted({s for s in secrets if len(s.strip()) >= _MIN_SECRET}, key=len, reverse=True)
    if literal:
        names = [m.span() for m in _SETTING_NAME.finditer(text)]
        text = re.sub(
            "|".join(map(re.escape, literal)),
            lambda m: m.group(0) if _within(names, *m.span()) else "***",
            text,
        )
    return text


def _within(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` lies inside one of ``spans``."""
    return any(a <= start and end <= b for a, b in spans)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message with :func:`redact` (after %-formatting)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it to the handler
            return True
        clean = redact(message, self.secrets)
        if record.exc_info and record.exc_text is None and record.exc_info[1] is not None:
            record.exc_text = redact(
                logging.Formatter().formatException(record.exc_info), self.secrets
            )
        if clean != message or record.args:
            record.msg, record.args = clean, None
        return True


def install_log_redaction(secrets: Iterable[str] = ()) -> RedactingFilter:
    """Attach a :class:`RedactingFilter` to every handler of the root logger."""
    filt = RedactingFilter(secrets)
    root = logging.getLogger()
    for handler in root.handlers:
        handler.addFilter(filt)
    return filt


def server_secrets(server: ServerSettings) -> list[str]:
    """Literal secrets of a server configuration (admin token, API keys, Redis password)."""
    out = [
        server.admin_token or "",
        server.grpc_token or "",
        server.redis_signing_master or "",
        server.record_key or "",
    ]
    out += list(read_api_keys(server.api_keys, server.api_keys_file))
    try:  # (the password as redis-py reads it: the host after the last "@")
        password = urlsplit(server.redis_url or "").password
    except ValueError:
        password = None
    if password:
        out.append(password)
    return [s for s in out if s]
