"""The environment every client command reads, in one place: ``meshnet
send``, ``generate``, ``status`` and ``conformance`` all take the chain's
bearer token from ``MESHNET_TOKEN`` and the gateway from ``MESHNET_GATEWAY``
(a flag beats the variable), so a shell that exported them once can run any
of them without a 401 from one and not the other."""

from __future__ import annotations

import argparse
import os

__all__ = ["GATEWAY_ENV", "TOKEN_ENV", "add_gateway", "add_token", "unauthorized_hint"]

TOKEN_ENV = "MESHNET_TOKEN"
GATEWAY_ENV = "MESHNET_GATEWAY"


def add_token(parser: argparse.ArgumentParser, what: str = "bearer token") -> None:
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"{what} [env {TOKEN_ENV}]"
    )


def add_gateway(
    parser: argparse.ArgumentParser, default: str | None = None, *, positional: bool = False
) -> None:
    """``--gateway URL`` (or, ``positional``, an optional ``URL`` argument)."""
    value = os.environ.get(GATEWAY_ENV, default)
    shown = f"env {GATEWAY_ENV}" + (f", default {default}" if default else "")
    if positional:
        where = "the gateway: http://host:port, https://…, unix:/path.sock"
        parser.add_argument(
            "url", nargs="?", default=value, metavar="URL", help=f"{where} [{shown}]"
        )
        return
    parser.add_argument(
        "--gateway", default=value, help=f"gateway URL, e.g. http://127.0.0.1:8000 [{shown}]"
    )


def unauthorized_hint(token: str | None) -> str:
    """What to do about a 401: the token is missing, or it is not the server's."""
    if token is None:
        return f"the server requires a bearer token: give --token or set {TOKEN_ENV}"
    return f"the token given (--token or {TOKEN_ENV}) is not the server's"
