"""``meshnet status URL``: a gateway's chain in one table.

Reads the gateway's ``GET /info`` (its ``stages``: the chain walked from its
entry, docs/gateway.md "The chain in one view") and prints one row per
replica of each stage, in order::

    gateway  model SmolLM2-135M-Instruct  entry http://127.0.0.1:40411  running 0  queued 0
    STAGE  URL                     LAYERS  ENGINE  DTYPE    WEIGHTS   HEALTH  SESSIONS  INFLIGHT
    0      http://127.0.0.1:40411  0:15    torch   float32  int4pack  ok      1         -
    1      http://127.0.0.1:40123  15:30   torch   float32  int4pack  ok      1         -

Plain aligned text (greppable, the same on a terminal and in a pipe);
``--json`` prints the ``/info`` document itself. Exit 0 when every stage
answered, 1 when the table shows a replica not ``ok`` or a walk that
stopped short, 2 with one line when the URL cannot be read or is not a
gateway.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from meshnet_runtime.config import positive_seconds

from .client_env import GATEWAY_ENV, add_gateway, add_token, unauthorized_hint

if TYPE_CHECKING:
    from meshnet_runtime.config import OneLineParser

    _Commands = argparse._SubParsersAction[OneLineParser]

__all__ = ["add_parser", "main", "render"]

COLUMNS = (
    "STAGE",
    "URL",
    "LAYERS",
    "ENGINE",
    "DTYPE",
    "WEIGHTS",
    "HEALTH",
    "SESSIONS",
    "INFLIGHT",
)


def add_parser(commands: _Commands) -> None:
    status = commands.add_parser(
        "status",
        help="a gateway's chain: every stage, its replicas, health and load",
        description="Print the chain behind a gateway (its /info), one row per replica.",
    )
    add_gateway(status, positional=True)
    status.add_argument("--json", action="store_true", help="print the /info document")
    add_token(status, "bearer token, if the gateway needs one")
    status.add_argument("--tls-ca", default=None, help="CA bundle for an https gateway")
    status.add_argument("--timeout", type=positive_seconds, default=30.0, help="seconds [30]")


class StatusError(Exception):
    """The URL cannot be read, or is not a gateway: one line, exit 2."""


def main(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    if args.url is None:
        print(f"meshnet status: give the gateway's URL (or set {GATEWAY_ENV})", file=sys.stderr)
        return 2
    try:
        document = anyio.run(_read, args.url, args.token, args.tls_ca, args.timeout)
    except StatusError as exc:
        print(f"meshnet status: {args.url}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out.write(json.dumps(document, indent=2) + "\n")
    else:
        out.write(render(document))
    return 0 if _healthy(document) else 1


async def _read(url: str, token: str | None, tls_ca: str | None, timeout: float) -> dict[str, Any]:
    from meshnet_gateway import Client
    from meshnet_proto import MeshnetError

    try:
        client = Client(url, token=token, tls_ca=tls_ca, max_connections=1)
    except (ValueError, OSError) as exc:
        raise StatusError(f"not a URL meshnet can reach ({exc}); give http://host:port") from None
    try:
        with anyio.fail_after(timeout):
            document = await client.info(timeout=timeout)
    except TimeoutError:
        raise StatusError(f"no answer within {timeout:g} s; is the gateway up?") from None
    except MeshnetError as exc:
        if exc.status == 401:  # someone answered: a gateway asking for a token
            raise StatusError(f"401 on /info: {unauthorized_hint(token)}") from None
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        first = first.removeprefix(f"{url}: ")  # the line names the URL already
        raise StatusError(f"cannot read /info: {first}; is a gateway listening there?") from None
    except (OSError, ValueError) as exc:
        raise StatusError(f"cannot read /info: {exc}; is a gateway listening there?") from None
    finally:
        with anyio.CancelScope(shield=True):
            await client.aclose()
    if document.get("role") != "gateway" or not isinstance(document.get("stages"), list):
        role = document.get("role")
        raise StatusError(
            f"not a gateway (its /info says role {role!r}); give the gateway's URL, not a node's"
        )
    return document


def render(document: dict[str, Any]) -> str:
    """The table of a gateway's ``/info``."""
    head = ["gateway"]
    if document.get("model"):
        head.append(f"model {document['model']}")
    head.append(f"entry {document.get('entry')}")
    admission = document.get("admission")
    if isinstance(admission, dict):
        head.append(f"running {admission.get('running')}  queued {admission.get('queued')}")
    rows: list[Sequence[str]] = [COLUMNS]
    for stage in document.get("stages") or []:
        for replica in stage.get("replicas") or []:
            rows.append(_row(stage.get("stage"), replica))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(head)]
    for row in rows:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    for stage in document.get("stages") or []:
        for replica in stage.get("replicas") or []:
            if replica.get("error"):
                lines.append(f"stage {stage.get('stage')} {replica['url']}: {replica['error']}")
    walk = document.get("walk") or {}
    if walk.get("stopped"):
        lines.append(f"the walk stopped: {walk['stopped']}")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def _row(stage: Any, replica: dict[str, Any]) -> Sequence[str]:
    layers = replica.get("layers")
    span = f"{layers[0]}:{layers[1]}" if isinstance(layers, list) and len(layers) == 2 else None
    return tuple(
        "-" if value is None else str(value)
        for value in (
            stage,
            replica.get("url"),
            span or replica.get("backend"),  # a stub: its backend (echo, …)
            replica.get("engine"),
            replica.get("dtype"),
            replica.get("weights"),
            replica.get("health"),
            replica.get("sessions"),
            replica.get("inflight"),
        )
    )


def _healthy(document: dict[str, Any]) -> bool:
    walk = document.get("walk") or {}
    replicas = [r for s in document.get("stages") or [] for r in s.get("replicas") or []]
    return bool(walk.get("complete")) and all(r.get("health") == "ok" for r in replicas)
