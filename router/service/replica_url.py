"""A replica's base URL, parsed once: the one place that knows what the router accepts as
one (configured replicas, replicas publishers register, the proxy's Host header and the
upstream client's address all come from :class:`ReplicaUrl`)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from router.service.security import redact


@dataclass(frozen=True, slots=True)
class ReplicaUrl:
    """``http://host[:port]``: the proxy's client speaks plain HTTP/1.1 and sends every
    request to the host's root (``/v1/...``), so no TLS, path, query, fragment or
    credentials. ``netloc`` is the URL's ``host[:port]`` as given (the Host header);
    ``host`` (lower-case, no IPv6 brackets) and ``port`` (80 when not given) are where to
    connect, and what two URLs of the same replica share."""

    netloc: str
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> ReplicaUrl:
        """The URL's parts; ValueError saying why the proxy could not use it otherwise (the
        URL shown with any password masked: the message reaches logs and stderr)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{redact(url)!r} has a bad port ({exc})") from None
        if parts.scheme == "https":
            raise ValueError(
                f"{redact(url)!r}: https is not supported: replicas are reached over plain http "
                "on the cluster network; terminate TLS in front of the router or use a sidecar"
            )
        if parts.scheme != "http" or not parts.netloc:
            raise ValueError(f"{redact(url)!r} is not an http URL (http://host:port)")
        if not parts.hostname:
            raise ValueError(f"{redact(url)!r} has no host")
        if port == 0:
            raise ValueError(f"{redact(url)!r}: port 0 is not a port to connect to")
        if parts.username is not None or parts.password is not None:
            raise ValueError(
                f"{redact(url)!r} carries credentials, which the router does not send; remove them"
            )
        if parts.path not in ("", "/"):
            raise ValueError(
                f"{redact(url)!r} has a path ({parts.path!r}), which the router would not use: "
                "requests go to the replica's root (/v1/...); give http://host:port"
            )
        if parts.query:
            raise ValueError(
                f"{redact(url)!r} has a query ({parts.query!r}); give http://host:port"
            )
        if parts.fragment:
            raise ValueError(
                f"{redact(url)!r} has a fragment ({parts.fragment!r}); give http://host:port"
            )
        return cls(parts.netloc, parts.hostname.lower(), port or 80)

    @property
    def base(self) -> str:
        """``http://netloc``: the form the router stores and shows."""
        return f"http://{self.netloc}"

    @property
    def address(self) -> tuple[str, int]:
        """(host, port): equal for two spellings of one replica's address."""
        return self.host, self.port


def replica_url_problem(url: str) -> str | None:
    """Why the proxy could not use ``url`` as a replica's base URL; None when it can."""
    try:
        ReplicaUrl.parse(url)
    except ValueError as exc:
        return str(exc)
    return None
