"""``meshnet keys``: a gateway's client API keys (docs/security.md, tenants).

``meshnet keys new TENANT --file F`` makes a key, appends its line
(``TENANT sha256:DIGEST``) to the key file a gateway reads (``--api-keys``)
and prints the key once: the file holds only its digest. The gateway picks
the new line up within a second, without a restart; a revoked key is a
deleted line. ``meshnet keys digest`` prints the line for a key made
elsewhere (read from standard input, never from the command line, which
other local users can read).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from typing import TYPE_CHECKING, TextIO

from meshnet_proto.lowlevel import TENANT_NAME, Credentials, key_digest
from meshnet_runtime.credentials import ApiKeyFile, KeyFileError, parse_key_file

if TYPE_CHECKING:
    from .__main__ import _Commands

__all__ = ["add_parser", "main", "new_key"]

# A key names what it is (and a leak scanner can find one): "mk-" and 256
# random bits.
KEY_PREFIX = "mk-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _tenant(text: str) -> str:
    if TENANT_NAME.fullmatch(text) is None:
        raise argparse.ArgumentTypeError("a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
    return text


def _group(text: str) -> str:
    return f"cache={_tenant(text)}"


def add_parser(commands: _Commands) -> None:
    keys = commands.add_parser(
        "keys",
        help="clients' API keys for a gateway's --api-keys file",
        description="Make a client's API key; the key file holds only its SHA-256 digest.",
    )
    actions = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    new = actions.add_parser("new", help="make a key for TENANT, append its line, print the key")
    new.add_argument("tenant", type=_tenant, help="the tenant the key names")
    new.add_argument("--file", required=True, help="the gateway's --api-keys file (appended to)")
    new.add_argument(
        "--cache-group",
        type=_group,
        default=None,
        help="share prefix caches with the tenants of this group",
    )
    digest = actions.add_parser("digest", help="the key file line of a key read from stdin")
    digest.add_argument("tenant", type=_tenant, help="the tenant the key names")


def main(args: argparse.Namespace, out: TextIO | None = None, stdin: TextIO | None = None) -> int:
    out = out or sys.stdout
    if args.keys_command == "digest":
        stdin = stdin or sys.stdin
        key = stdin.readline().strip()
        if not key:
            print("meshnet keys digest: no key on standard input", file=sys.stderr)
            return 2
        out.write(f"{args.tenant} sha256:{key_digest(key)}\n")
        return 0
    key = new_key()
    line = " ".join(filter(None, (args.tenant, f"sha256:{key_digest(key)}", args.cache_group)))
    try:
        _append(args.file, line)
    except (OSError, KeyFileError) as exc:
        print(f"meshnet keys new: {args.file}: {exc}", file=sys.stderr)
        return 2
    out.write(key + "\n")
    return 0


def _append(path: str, line: str) -> None:
    """Append ``line``, the file checked as the gateway will read it (a
    file the gateway would refuse is not made worse)."""
    exists = os.path.exists(path)
    if exists:
        ApiKeyFile(path, Credentials())
    parse_key_file(line, path)
    # Owner-only, like an SSH key: digests are not keys, but say who is a client.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as file:
        if exists and os.path.getsize(path) and not _ends_with_newline(path):
            file.write("\n")
        file.write(line + "\n")


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as file:
        file.seek(-1, os.SEEK_END)
        return file.read(1) == b"\n"
