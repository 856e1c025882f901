"""Whom a request serves, and what the chain is told of it (wire-2 §3.15).

A gateway's clients share one chain. The nodes cannot tell them apart: every
chunk comes from the gateway. So each chunk of a new session carries

* ``X-Meshnet-Client`` — a hash of the client (its tenant with API keys, its
  address without): the nodes count the per-client session quota by it,
  so one client filling its quota leaves the others theirs;
* ``X-Meshnet-Cache-Salt`` — a hash of the tenant's cache group (its own
  name unless its key file line says ``cache=GROUP``) and of the request's
  ``cache_salt``: the first stage starts the session's block keys from it,
  so a prefix is shared only within a group (wire-2 §3.10).

Hashes, not names: a tenant's name never reaches a node's logs or memory,
and both headers have one fixed, checkable form.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from meshnet_proto import WireHeaders

__all__ = ["Tenancy", "tenancy_of"]


def _digest(kind: bytes, *parts: str) -> str:
    # Length-prefixed parts: ("ab", "c") and ("a", "bc") hash apart.
    data = b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
    return hashlib.blake2b(data, digest_size=16, person=b"meshnet-" + kind).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenancy:
    """One request's client: ``name`` (the tenant, or the peer's address:
    what fair queues and logs use), ``client`` and ``cache_salt`` (the two
    headers' values; a None salt is the chain's shared cache)."""

    name: str
    client: str
    cache_salt: str | None
    group: str | None = None  # the cache group the salt names (None: shared)

    def salted(self, request_salt: str | None) -> Tenancy:
        """With a request's own ``cache_salt`` (vLLM's field): a prefix is
        then shared only with requests that give the same salt."""
        if request_salt is None:
            return self
        salt = _digest(b"cache", self.group or "", request_salt)
        return replace(self, cache_salt=salt)

    def mark(self, headers: WireHeaders) -> WireHeaders:
        """``headers`` carrying both, for a chunk of a new session's run."""
        if headers.client == self.client and headers.cache_salt == self.cache_salt:
            return headers
        return headers.replace(client=self.client, cache_salt=self.cache_salt)


def tenancy_of(tenant: str | None, peer: str | None, cache_group: str | None) -> Tenancy:
    """A request's `Tenancy`: by its API key's ``tenant`` (whose prefixes
    are shared within ``cache_group``), else by its ``peer`` address, whose
    prefixes are the gateway's shared cache (no keys: one tenant)."""
    if tenant is not None:
        group = cache_group or tenant
        client = _digest(b"client", "tenant", tenant)
        return Tenancy(tenant, client, _digest(b"cache", group), group)
    name = peer or "-"
    return Tenancy(name, _digest(b"client", "peer", name), None)
