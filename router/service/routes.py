"""A table of routes answered with a whole :class:`~router.service.http_types.Reply`: every
path of the public port but the two hot endpoints (models, health, readiness, metrics,
admin), and the internal paths of a worker's control socket.

A path is literal, or has one ``{name}`` segment (``/admin/replicas/{name}/drain``), which
the handler gets percent-decoded; ``{name:path}`` matches slashes too. A GET route answers
HEAD too. An unknown path is a 404, a known path with another method a 405 with ``Allow``;
both with OpenAI-style bodies (Anthropic-style on the Messages API's paths, as the router's
other errors there: router.service.errors ``messages_path``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.service.errors import ErrorReply, messages_path
from router.service.http_types import HttpRequest, Reply, path_segment

# a handler gets the request and the value of the path's {name} segment ('' if none)
Handler = Callable[[HttpRequest, str], Awaitable[Reply]]


@dataclass(slots=True, frozen=True)
class _Pattern:
    prefix: bytes
    suffix: bytes
    handlers: dict[bytes, Handler]
    slashes: bool = False

    def match(self, path: bytes) -> bytes | None:
        if not (path.startswith(self.prefix) and path.endswith(self.suffix)):
            return None
        middle = path[len(self.prefix) : len(path) - len(self.suffix)]
        return middle if middle and (self.slashes or b"/" not in middle) else None


class Routes:
    def __init__(self) -> None:
        self._literal: dict[bytes, dict[bytes, Handler]] = {}
        self._patterns: list[_Pattern] = []
        self._elsewhere: dict[bytes, set[bytes]] = {}

    def served_elsewhere(self, method: str, path: str) -> None:
        """``method path`` is answered before this table is asked (the hot endpoints): known
        here only so that another method on that path is a 405, not a 404."""
        self._elsewhere.setdefault(path.encode(), set()).add(method.encode())

    def add(self, method: str, path: str, handler: Handler) -> None:
        verb = method.encode()
        raw = path.encode()
        if b"{" not in raw:
            self._literal.setdefault(raw, {})[verb] = handler
            return
        prefix, _, rest = raw.partition(b"{")
        name, _, suffix = rest.partition(b"}")
        for pattern in self._patterns:
            if pattern.prefix == prefix and pattern.suffix == suffix:
                pattern.handlers[verb] = handler
                return
        self._patterns.append(_Pattern(prefix, suffix, {verb: handler}, name.endswith(b":path")))

    def get(self, path: str, handler: Handler) -> None:
        self.add("GET", path, handler)

    def post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    def _find(self, path: bytes) -> tuple[dict[bytes, Handler], str] | None:
        handlers = self._literal.get(path)
        if handlers is not None:
            return handlers, ""
        for pattern in self._patterns:
            middle = pattern.match(path)
            if middle is not None:
                return pattern.handlers, path_segment(middle)
        return None

    async def answer(self, req: HttpRequest) -> Reply:
        """The answer of the route ``req`` names (404 / 405 when none)."""
        path = req.path
        found = self._find(path)
        method = req.method
        if found is None and path in self._elsewhere:
            found = {}, ""
        if found is None:
            text = f"no route for {method.decode('latin-1')} {path.decode('latin-1')}"
            return error(ErrorReply(404, text, "not_found"), messages_path(path))
        handlers, param = found
        handler = handlers.get(b"GET" if method == b"HEAD" else method)
        if handler is None:
            methods = {*handlers, *self._elsewhere.get(path, ())}
            allow = ", ".join(sorted(m.decode() for m in methods))
            reply = ErrorReply(405, "Method Not Allowed", "http_405", headers=(("Allow", allow),))
            return error(reply, messages_path(path))
        return await handler(req, param)


def error(reply: ErrorReply, anthropic: bool = False) -> Reply:
    """An :class:`ErrorReply` as a :class:`Reply` (``anthropic``: in the Messages API's
    error shape)."""
    headers = ((b"Content-Type", b"application/json"),) + tuple(
        (k.encode(), v.encode()) for k, v in reply.headers
    )
    return Reply(reply.status, reply.body(anthropic), headers)
