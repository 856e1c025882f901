"""The credentials a server accepts (wire-2 §7), from its flags and files.

``chain_credentials``: the chain's token (``--token``) and, during a
rotation, a second one (``--accept-token``). ``ApiKeyFile``: a gateway's
client API keys (``--api-keys FILE``), re-read when the file changes, so an
operator adds, rotates or revokes a key without a restart.

The key file holds one key per line, as its SHA-256 digest, never the key::

    # tenant   key digest                                   options
    acme       sha256:9f86d081884c7d659a2feaa0c55ad015a3...
    widgets    sha256:60303ae22b998861bce3b28f33eec1be75...  cache=public

``cache=GROUP`` puts the tenant's prompts in a prefix-cache group shared
with every tenant that names the same group (a public system prompt); by
default a tenant's cache is its own. ``meshnet keys new TENANT --file F``
writes such a line and prints the key once.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import anyio

from meshnet_proto.lowlevel import TENANT_NAME, Credentials

from .config import ServerConfig

__all__ = [
    "ApiKeyFile",
    "KeyFileError",
    "KeyLine",
    "chain_credentials",
    "parse_key_file",
    "watch_key_file",
]

# How often a key file is looked at for changes: a revoked key stops
# within this long, and a stat a second costs nothing.
KEY_FILE_POLL_S = 1.0

log = logging.getLogger("meshnet.credentials")

# A key file is a list of lines, not a database: bounded, so a wrong path
# (a disk image, /dev/zero) is refused instead of read.
MAX_KEY_FILE_BYTES = 4 * 1024 * 1024
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_CACHE = re.compile(r"cache=([A-Za-z0-9][A-Za-z0-9._-]{0,63})")


class KeyFileError(ValueError):
    """A key file that cannot be used: its path and line say why."""


@dataclass(frozen=True, slots=True)
class KeyLine:
    tenant: str
    digest: str  # SHA-256 hex of the key
    cache_group: str | None = None


def chain_credentials(config: ServerConfig) -> Credentials:
    """What a node accepts: the chain's token(s) only."""
    return Credentials(t for t in (config.token, config.accept_token) if t is not None)


def parse_key_file(text: str, path: str = "<keys>") -> list[KeyLine]:
    """Every key line of a key file's ``text``; `KeyFileError` names the
    first bad line (never quoting it: it might hold a key by mistake)."""
    lines: list[KeyLine] = []
    digests: set[str] = set()
    groups: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) not in (2, 3):
            raise KeyFileError(f"{where}: expected 'TENANT sha256:DIGEST [cache=GROUP]'")
        tenant, digest, *options = fields
        if TENANT_NAME.fullmatch(tenant) is None:
            raise KeyFileError(f"{where}: a tenant name is 1-64 of A-Z a-z 0-9 . _ -")
        match = _DIGEST.fullmatch(digest)
        if match is None:
            raise KeyFileError(
                f"{where}: a key is written as sha256:<64 lowercase hex digits> of the key "
                "(meshnet keys new writes the line)"
            )
        group = None
        if options:
            cache = _CACHE.fullmatch(options[0])
            if cache is None:
                raise KeyFileError(f"{where}: the only option is cache=GROUP")
            group = cache.group(1)
        if match.group(1) in digests:
            raise KeyFileError(f"{where}: this key is listed already")
        if groups.setdefault(tenant, group) != group:
            raise KeyFileError(f"{where}: tenant {tenant} is in another cache group above")
        digests.add(match.group(1))
        lines.append(KeyLine(tenant, match.group(1), group))
    return lines


class ApiKeyFile:
    """A gateway's API key file, loaded into ``credentials`` and re-read
    when it changes (``refresh``, which the gateway calls every second).

    A file that turns bad, or goes away, keeps the keys last loaded (a
    half-written file must not lock every client out) and logs why once.
    """

    def __init__(self, path: str, credentials: Credentials) -> None:
        self.path = path
        self.credentials = credentials
        self.cache_groups: dict[str, str | None] = {}
        self._seen: tuple[int, int, int] | None = None
        self._complained: str | None = None
        self.load()

    def load(self) -> None:
        """Read the file now; `KeyFileError` if it cannot be used."""
        stamp, text = self._read()
        lines = parse_key_file(text, self.path)
        self.credentials.replace_keys({line.digest: line.tenant for line in lines})
        self.cache_groups = {line.tenant: line.cache_group for line in lines}
        self._seen = stamp

    def refresh(self) -> bool:
        """Re-read the file if it changed since the last load; True if the keys changed."""
        try:
            stat = os.stat(self.path)
            if (stat.st_mtime_ns, stat.st_size, stat.st_ino) == self._seen:
                return False
            self.load()
        except (OSError, KeyFileError) as exc:
            message = str(exc)
            if message != self._complained:
                log.error("API keys not reloaded, the last ones stay: %s", message)
                self._complained = message
            return False
        self._complained = None
        log.info("API keys reloaded from %s: %d tenants", self.path, len(self.credentials.tenants))
        return True

    def _read(self) -> tuple[tuple[int, int, int], str]:
        path = Path(self.path)
        try:
            with path.open("rb") as file:
                stat = os.fstat(file.fileno())
                data = file.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            raise KeyFileError(f"{self.path}: {exc.strerror or exc}") from None
        if len(data) > MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"{self.path}: larger than {MAX_KEY_FILE_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise KeyFileError(f"{self.path}: not UTF-8 text") from None
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino), text


async def watch_key_file(keys: ApiKeyFile, interval: float = KEY_FILE_POLL_S) -> None:
    """Re-read ``keys``' file whenever it changes, until cancelled."""
    while True:
        await anyio.sleep(interval)
        keys.refresh()
