"""The gateway against web pages: which ``Host`` it serves, which ``Origin``
may use it, and the CORS headers it answers with (docs/openai-api.md,
"Browsers: Host, Origin, CORS").

A gateway listening on 127.0.0.1 is reachable by every web page its user
opens. Two things stop a page from using it:

* **Host** (DNS rebinding): a page at ``http://evil.example:8000`` whose
  name the attacker re-points at 127.0.0.1 is same-origin with the gateway
  and reads its answers, but its requests carry ``Host: evil.example:8000``.
  The gateway serves ``localhost``, any IP literal (a rebinding needs a
  *name*: a page at an address is served by whoever holds the address), the
  name it is bound to (``--host``) and ``--allowed-hosts``; else 403
  ``host_not_allowed``.
* **Origin** (cross-site requests): a browser names the page's origin on
  every cross-site POST and every CORS request. Only the gateway's own
  names (``localhost``, loopback addresses, ``--host``, ``--allowed-hosts``,
  any port, http or https) and ``--allowed-origins`` may; else 403
  ``origin_not_allowed``. A request without ``Origin`` (curl, the SDKs) is
  not a browser's cross-site request and is served as before.

Pure computation: `BrowserPolicy.check_head` is the wire-2 core's
``head_check`` (it runs on every head, before credentials and routing), the
rest builds header pairs for `meshnet_gateway.browser_guard`.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from meshnet_proto import ErrorCode, ProtocolError

__all__ = [
    "ANY",
    "PREFLIGHT_MAX_AGE",
    "BrowserPolicy",
    "HostPort",
    "Origin",
    "cors_headers",
    "header_values",
    "host_list",
    "is_json",
    "origin_list",
    "parse_host",
    "parse_origin",
    "preflight_headers",
    "with_preflight",
]

ANY = "*"  # --allowed-hosts '*' / --allowed-origins '*': no check
# Seconds a browser may keep a preflight's answer (Chrome caps it at 7200).
PREFLIGHT_MAX_AGE = 600
# What a browser client of the OpenAI API sends beyond the CORS-safelisted
# headers; a preflight asking for more is answered with those too (the
# origin is what is checked, not the header names: the openai-node SDK
# sends its own x-stainless-* ones).
ALLOWED_HEADERS = ("authorization", "content-type")

# A registered name, lowercased: letters, digits, '-', '_', dot-separated.
_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class HostPort(NamedTuple):
    """A ``Host`` value read: ``name`` lowercased, an IPv6 address without
    brackets (compressed), a trailing dot dropped; ``port`` None when absent."""

    name: str
    port: int | None


class Origin(NamedTuple):
    scheme: str
    host: HostPort

    def serialized(self) -> str:
        """As a browser writes it: lowercase, brackets, no default port."""
        name, port = self.host
        shown = f"[{name}]" if ":" in name else name
        if port is None or port == _DEFAULT_PORTS.get(self.scheme):
            return f"{self.scheme}://{shown}"
        return f"{self.scheme}://{shown}:{port}"


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def _port(text: str) -> int | None:
    """A port after ':' (RFC 3986 allows it empty: None); ValueError when unreadable."""
    if text == "":
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 5 or int(text) > 65535:
        raise ValueError(text)
    return int(text)


def _bracketed(text: str) -> tuple[str, str] | None:
    """``[ipv6]`` (compressed) and what follows its ``:``; None when it is not that."""
    end = text.find("]")
    if end < 0 or "%" in text[:end]:  # a zone id: no host a browser sends
        return None
    address, after = _ip(text[1:end]), text[end + 1 :]
    if not isinstance(address, ipaddress.IPv6Address) or after[:1] not in ("", ":"):
        return None
    return address.compressed, after[1:]


def parse_host(value: str) -> HostPort | None:
    """``name[:port]`` or ``[ipv6][:port]`` (a Host header, an origin's
    authority); None when it is neither."""
    text = value.lower()
    if text.startswith("["):
        parts = _bracketed(text)
        if parts is None:
            return None
        name, rest = parts
    else:
        name, colon, rest = text.partition(":")
        if colon and ":" in rest:
            return None  # an IPv6 address needs its brackets
        name = name[:-1] if name.endswith(".") else name
        if len(name) > 253 or _NAME.fullmatch(name) is None:
            return None
    try:
        return HostPort(name, _port(rest))
    except ValueError:
        return None


def parse_origin(value: str) -> Origin | None:
    """``scheme://host[:port]`` (RFC 6454); None for anything else, "null" included."""
    scheme, sep, authority = value.lower().partition("://")
    if not sep or _SCHEME.fullmatch(scheme) is None:
        return None
    host = parse_host(authority)
    return None if host is None else Origin(scheme, host)


def _is_loopback(name: str) -> bool:
    address = _ip(name)
    return name == "localhost" or (address is not None and address.is_loopback)


def header_values(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """Every value of the (lowercase) header ``name``, as text."""
    return [value.decode("latin-1") for key, value in headers if key == name]


def _host_refused(shown: str) -> ProtocolError:
    return ProtocolError(
        f"Host {shown[:100]!r} is not a name this gateway serves (a DNS-rebinding page "
        "would send one); an operator adds names with --allowed-hosts",
        code=ErrorCode.HOST_NOT_ALLOWED,
        header="host",
    )


def _origin_refused(shown: str) -> ProtocolError:
    return ProtocolError(
        f"Origin {shown[:100]!r} may not use this gateway (a cross-site request); "
        "an operator allows origins with --allowed-origins",
        code=ErrorCode.ORIGIN_NOT_ALLOWED,
        header="origin",
    )


def _one(headers: Sequence[tuple[bytes, bytes]], name: bytes) -> str | None:
    values = header_values(headers, name)
    if len(values) > 1:  # RFC 9112 §3.2: a second Host is a 400; so a second Origin
        shown = name.decode()
        raise ProtocolError(
            f"more than one {shown} header", code=ErrorCode.DUPLICATE_HEADER, header=shown
        )
    return values[0] if values else None


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """Which Hosts and Origins a gateway serves (the module's docstring).

    ``names``: the host names served beside ``localhost`` and IP literals,
    whose origins (any port) are the gateway's own; ``origins``: further
    origins allowed, serialized. ``any_host`` / ``any_origin``: ``'*'``.
    """

    names: frozenset[str] = frozenset()
    origins: frozenset[str] = frozenset()
    any_host: bool = False
    any_origin: bool = False

    @classmethod
    def build(
        cls,
        bound_host: str | None,
        allowed_hosts: Collection[str] = (),
        allowed_origins: Collection[str] = (),
    ) -> BrowserPolicy:
        """From the flags: ``--host`` (a wildcard address names nothing),
        ``--allowed-hosts`` and ``--allowed-origins`` (as `host_list` and
        `origin_list` read them)."""
        names = {h for h in allowed_hosts if h != ANY}
        address = _ip(bound_host.strip("[]")) if bound_host else None
        if address is not None:
            if not address.is_unspecified:  # 0.0.0.0 or :: is every address, no name
                names.add(address.compressed)
        elif bound_host and (bound := parse_host(bound_host)) is not None:
            names.add(bound.name)
        return cls(
            names=frozenset(names),
            origins=frozenset(o for o in allowed_origins if o != ANY),
            any_host=ANY in allowed_hosts,
            any_origin=ANY in allowed_origins,
        )

    def host_allowed(self, value: str) -> bool:
        if self.any_host:
            return True
        host = parse_host(value)
        if host is None:
            return False
        return host.name == "localhost" or _ip(host.name) is not None or host.name in self.names

    def origin_allowed(self, value: str) -> bool:
        if self.any_origin:
            return True
        origin = parse_origin(value)
        if origin is None:
            return False
        if origin.serialized() in self.origins:
            return True
        name = origin.host.name
        return origin.scheme in _DEFAULT_PORTS and (_is_loopback(name) or name in self.names)

    def check_head(
        self, method: str, path: str, query: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> None:
        """The core's ``head_check``: 403 ``host_not_allowed`` /
        ``origin_not_allowed`` (400 ``duplicate_header`` for two of either).

        A plain ``/health`` is open, as it is without credentials: a load
        balancer's probe names the gateway as it likes, and the answer says
        nothing. A request without ``Host`` (HTTP/1.0; h11 requires it of
        1.1) is served: every browser sends one.
        """
        if path == "/health" and not query:
            return
        host = _one(headers, b"host")
        if host is not None and not self.host_allowed(host):
            raise _host_refused(host)
        origin = _one(headers, b"origin")
        if origin is not None and not self.origin_allowed(origin):
            raise _origin_refused(origin)

    def cors_origin(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The Origin a request's answer grants (the request's own, when allowed)."""
        values = header_values(headers, b"origin")
        if len(values) == 1 and self.origin_allowed(values[0]):
            return values[0]
        return None


def cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    """What an answer to an allowed ``origin`` carries (a stream's head too).
    The origin itself, never ``*``: the answer differs by Origin, so caches
    keep them apart (``Vary``)."""
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def preflight_headers(
    origin: str | None, methods: Collection[str], requested: str | None
) -> list[tuple[bytes, bytes]]:
    """A 204 answer to ``OPTIONS`` on a route taking ``methods``: ``Allow``,
    and for an allowed ``origin`` the CORS preflight answer. ``requested``:
    its ``Access-Control-Request-Headers`` (each name is granted: the origin
    is what is checked; what is not a header name is left out)."""
    allow = ", ".join(sorted({*methods, "OPTIONS"}))
    pairs = [(b"allow", allow.encode())]
    if origin is None:
        return pairs
    names = list(ALLOWED_HEADERS)
    for name in (requested or "").lower().split(","):
        name = name.strip()
        if _TOKEN.fullmatch(name) and name not in names and len(names) < 64:
            names.append(name)
    return [
        *pairs,
        *cors_headers(origin),
        (b"access-control-allow-methods", allow.encode()),
        (b"access-control-allow-headers", ", ".join(names).encode()),
        (b"access-control-max-age", str(PREFLIGHT_MAX_AGE).encode()),
    ]


def with_preflight(routes: Mapping[str, Collection[str]]) -> dict[str, tuple[str, ...]]:
    """``routes`` taking ``OPTIONS`` too: the preflights the gateway answers."""
    return {pattern: (*methods, "OPTIONS") for pattern, methods in routes.items()}


def is_json(content_types: Sequence[str]) -> bool:
    """Exactly one ``Content-Type``, ``application/json`` (parameters such
    as ``; charset=utf-8`` allowed). A form or ``text/plain`` body is what a
    page may POST cross-site without a preflight; no Content-Type at all is
    what ``fetch`` sends for a Blob body: all refused."""
    if len(content_types) != 1:
        return False
    media = content_types[0].partition(";")[0].strip().lower()
    return media == "application/json"


# -- the flags (meshnet_gateway.config) ------------------------------------------------


def _entries(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def host_list(text: str) -> tuple[str, ...]:
    """``--allowed-hosts``: names (or ``*``), comma-separated; kept as read."""
    names: list[str] = []
    for entry in _entries(text):
        host = None if entry == ANY else parse_host(entry)
        if entry != ANY and (host is None or host.port is not None):
            raise argparse.ArgumentTypeError(f"not a host name (no port, no scheme): {entry!r}")
        names.append(ANY if host is None else host.name)
    return tuple(names)


def origin_list(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: ``scheme://host[:port]`` (or ``*``), comma-separated."""
    origins: list[str] = []
    for entry in _entries(text):
        origin = None if entry == ANY else parse_origin(entry.rstrip("/"))
        if entry != ANY and origin is None:
            raise argparse.ArgumentTypeError(
                f"not an origin like https://app.example.com[:port]: {entry!r}"
            )
        origins.append(ANY if origin is None else origin.serialized())
    return tuple(origins)
