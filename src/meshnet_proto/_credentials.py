"""Who may use a server (wire-2 §7): the chain's token and clients' API keys.

Two kinds of credential, never one for both:

* **the chain's token** — the secret every node, the gateway and a replica
  set share. It opens every path; a node accepts nothing else.
* **API keys** — one per client of a gateway, each naming a *tenant*. A key
  opens only the client paths (``/v1/*``, ``/forward``, ``/sessions/*``);
  elsewhere (``/info``, ``/metrics``, ``/health?deep=1``) it is 403
  ``key_not_allowed``, so a client never reads what other tenants did.

Keys are held as SHA-256 digests, never as themselves: what the server
holds (its memory, its key file) does not give a key away. A presented key
is hashed and looked up by its digest; a timing difference in that lookup
can at most tell something of a digest, which says nothing of any key
(SHA-256 is preimage resistant). The chain's tokens are compared with
``hmac.compare_digest``, every one of them every time.

Pure computation: the driver reads the key file and hands the digests in
(``replace_keys``, which takes effect on the next request of every
connection that shares the object, so a revoked key stops at once).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ._errors import ErrorCode, ProtocolError
from ._topology import is_deep_health

__all__ = ["CLIENT_PATHS", "Credentials", "HeadCheck", "Principal", "key_digest"]

# A server's own check of a request head, before its credentials:
# (method, path, query, header pairs with lowercase names) → None, or raise
# a MeshnetError to answer it (a gateway's Host and Origin checks).
HeadCheck = Callable[[str, str, str, Sequence[tuple[bytes, bytes]]], None]

# Where an API key is a credential: what a gateway's clients use.
CLIENT_PATHS = ("/v1/*", "/forward", "/sessions/*")

# A tenant's name: what logs, quotas and the prefix cache know a client by.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Principal:
    """Whom a request comes from. ``tenant`` is the API key's tenant, or
    None: the chain (its token), or anyone where no credential is set."""

    tenant: str | None = None

    @property
    def chain(self) -> bool:
        return self.tenant is None


CHAIN = Principal()


def key_digest(key: str | bytes) -> str:
    """The SHA-256 hex digest a key is held as."""
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


def _unauthorized() -> ProtocolError:
    # A fixed message: never a hint of a credential, nor of what was sent.
    return ProtocolError(
        "missing or wrong Authorization: Bearer credentials",
        code=ErrorCode.UNAUTHORIZED,
        header="authorization",
    )


def _client_path(path: str, patterns: Collection[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith("/*"):
            if path.startswith(pattern[:-1]) and len(path) > len(pattern) - 1:
                return True
        elif path == pattern:
            return True
    return False


class Credentials:
    """The credentials one server accepts (wire-2 §7).

    ``chain_tokens``: the chain's token, and during a rotation the one
    before it (every one opens every path). ``api_keys``: SHA-256 hex digest
    → tenant name (`key_digest`). With neither, nothing is asked.
    ``client_paths``: route patterns an API key opens (``"/v1/*"`` matches
    any path under ``/v1/``).
    """

    def __init__(
        self,
        chain_tokens: Iterable[str] = (),
        api_keys: Mapping[str, str] | None = None,
        *,
        client_paths: Collection[str] = CLIENT_PATHS,
    ) -> None:
        tokens = tuple(chain_tokens)
        if any(not isinstance(t, str) or not t for t in tokens):
            raise ValueError("a chain token must be a non-empty str")
        self._tokens = tuple(t.encode() for t in tokens)
        self._client_paths = tuple(client_paths)
        self._keys: dict[bytes, str] = {}
        self.replace_keys(api_keys or {})

    @property
    def required(self) -> bool:
        """True when a request must present a credential."""
        return bool(self._tokens or self._keys)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(self._keys.values())

    def replace_keys(self, api_keys: Mapping[str, str]) -> None:
        """Accept exactly ``api_keys`` from now on (a rotation, a revocation)."""
        keys: dict[bytes, str] = {}
        for digest, tenant in api_keys.items():
            if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
                raise ValueError("an API key is held as its SHA-256 hex digest (64 lowercase hex)")
            if not isinstance(tenant, str) or TENANT_NAME.fullmatch(tenant) is None:
                raise ValueError(f"a tenant name is 1-64 of [A-Za-z0-9._-], got {tenant!r}")
            keys[bytes.fromhex(digest)] = tenant
        self._keys = keys

    def identify(self, headers: Iterable[tuple[bytes, bytes]], path: str, query: str) -> Principal:
        """Whom a request with these (lowercase-named) headers comes from,
        or 401 ``unauthorized`` / 403 ``key_not_allowed``."""
        if not self.required or (path == "/health" and not is_deep_health(query)):
            # /health stays open (a load balancer's probe); ?deep=1 shows
            # the chain's URLs and costs every hop: it needs a credential.
            return CHAIN
        values = [value for name, value in headers if name == b"authorization"]
        if len(values) != 1:
            raise _unauthorized()
        scheme, _, presented = values[0].partition(b" ")
        presented = presented.strip()
        # Every token compared every time: the time does not tell which (or
        # whether one) matched, nor where the bytes differ.
        chain = False
        for token in self._tokens:
            chain |= hmac.compare_digest(presented, token)
        # A node holds no keys: no digest on its every request (a decode step's).
        tenant = self._keys.get(hashlib.sha256(presented).digest()) if self._keys else None
        if scheme.lower() != b"bearer" or not (chain or tenant is not None):
            raise _unauthorized()
        if chain:
            return CHAIN
        assert tenant is not None
        if not _client_path(path, self._client_paths):
            raise ProtocolError(
                f"{path}: an API key opens the client paths only; this one needs the chain's token",
                code=ErrorCode.KEY_NOT_ALLOWED,
                header="authorization",
            )
        return Principal(tenant)
