"""Endpoint URLs: ``http://host:port``, ``https://host:port``, ``unix:/path.sock``.

These are the only forms ``--next`` and ``--entry`` accept (wire-2 §8). Parsing is
strict and every rejection says what was expected, because a typo in a chain's
``--next`` otherwise surfaces much later as a confusing 502.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

__all__ = ["Endpoint", "parse_endpoint", "format_url"]

Scheme = Literal["http", "https", "unix"]

_EXPECTED = "expected http://host:port, https://host:port or unix:/path/to.sock"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed endpoint; ``url`` is the text as configured (used as ``hop``)."""

    url: str
    scheme: Scheme
    host: str | None = None  # IPv6 literals without brackets
    port: int | None = None
    path: str | None = None  # unix socket path

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def authority(self) -> str:
        """The value for an HTTP ``Host`` header."""
        if self.scheme == "unix":
            return "localhost"
        assert self.host is not None
        return f"{_bracket(self.host)}:{self.port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def format_url(
    scheme: Scheme, host: str | None = None, port: int | None = None, path: str | None = None
) -> str:
    """The inverse of :func:`parse_endpoint` (brackets IPv6 hosts)."""
    if scheme == "unix":
        return f"unix:{path}"
    return f"{scheme}://{_bracket(host or '')}:{port}"


def parse_endpoint(url: str) -> Endpoint:
    """Parse ``url``; raise ``ValueError`` naming the problem."""
    if not isinstance(url, str) or not url or url != url.strip():
        raise ValueError(f"bad endpoint {url!r}: {_EXPECTED}")
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if path.startswith("//"):
            # unix:///run/x.sock is a common habit from other tools; accept it.
            path = path[2:]
        if not path.startswith("/") and not path.startswith("."):
            raise ValueError(f"bad endpoint {url!r}: unix socket path must be absolute or ./rel")
        if "\x00" in path:
            raise ValueError(f"bad endpoint {url!r}: NUL in socket path")
        return Endpoint(url=url, scheme="unix", path=path)
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("http", "https"):
        raise ValueError(f"bad endpoint {url!r}: {_EXPECTED}")
    if rest.endswith("/"):
        rest = rest[:-1]  # tolerate a trailing slash, nothing more
    if "/" in rest or "?" in rest or "#" in rest or "@" in rest:
        raise ValueError(f"bad endpoint {url!r}: no path, query or userinfo allowed; {_EXPECTED}")
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise ValueError(f"bad endpoint {url!r}: unclosed '[' in IPv6 host")
        host = rest[1:close]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"bad endpoint {url!r}: {host!r} is not an IPv6 address") from None
        after = rest[close + 1 :]
        if not after.startswith(":"):
            raise ValueError(f"bad endpoint {url!r}: port required ({_EXPECTED})")
        port_text = after[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise ValueError(f"bad endpoint {url!r}: port required ({_EXPECTED})")
        if not host or ":" in host:
            raise ValueError(f"bad endpoint {url!r}: bad host (IPv6 needs [brackets])")
    if not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5:
        raise ValueError(f"bad endpoint {url!r}: port must be 1-65535")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"bad endpoint {url!r}: port must be 1-65535")
    return Endpoint(url=url, scheme=scheme, host=host, port=port)  # type: ignore[arg-type]
