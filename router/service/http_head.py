"""What the router's HTTP server (router.service.http_connection) checks of a request's
head beyond what llhttp refuses, and how it reads its target: a ``Host`` value (a URI
authority, RFC 9112 3.2), the HTTP version (505 for a major version other than 1, which
llhttp takes for 2.0 and 0.9), a target without a fragment (RFC 9112 3.2, RFC 3986 3.5),
and a target's origin form."""

from __future__ import annotations

import re

# RFC 9112 3.2, RFC 3986 3.2.2: a Host field is uri-host [":" port], uri-host an IP-literal
# in brackets or a reg-name (an IPv4 address is one): unreserved, sub-delims, pct-encoded
# (its "%" followed by two hex digits, checked apart: rare)
_HOST = re.compile(
    rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=%]*|\[[A-Za-z0-9\-._~!$&'()*+,;=:]+\])(?::[0-9]*)?"
)
_BAD_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")
HASH = ord("#")  # (an int: "b'#' in url" costs several times "HASH in url")


def host_ok(value: bytes) -> bool:
    """Whether a ``Host`` field's value is a URI authority without userinfo (RFC 9112 3.2;
    llhttp keeps a value's trailing whitespace, which is not part of it)."""
    value = value.rstrip(b" \t")
    if _HOST.fullmatch(value) is None:
        return False
    return b"%" not in value or _BAD_PERCENT.search(value) is None


def version_refusal(version: str) -> str | None:
    """Why a request naming HTTP ``version`` is answered 505, if it is: a major version
    other than 1 (RFC 9112 2.3, RFC 9110 15.6.6), which llhttp takes for ``HTTP/2.0`` and
    ``HTTP/0.9`` (a 0.9 request line, without a version, too): the router speaks HTTP/1.x."""
    if version[:2] == "1.":
        return None
    return f"HTTP/{version} is not supported: this server speaks HTTP/1.1"


def origin_form(target: bytes) -> bytes:
    """An absolute-form request target as its origin-form (``http://host/p?q`` -> ``/p?q``,
    RFC 9112 3.2.2: a server must accept it); any other (``*``, ``host:port``) as it is."""
    scheme, sep, rest = target.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return target
    slash, query = rest.find(b"/"), rest.find(b"?")
    if query >= 0 and (slash < 0 or query < slash):
        return b"/" + rest[query:]
    return rest[slash:] if slash >= 0 else b"/"
