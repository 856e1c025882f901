"""Who the gateway's clients are (docs/security.md, tenants): the
credentials its server accepts, its API key file kept current, and the
`Tenancy` each request is served under (wire-2 §3.15)."""

from __future__ import annotations

from meshnet_runtime.application import RequestContext
from meshnet_runtime.credentials import ApiKeyFile, chain_credentials, watch_key_file

from .config import GatewayConfig
from .tenancy import Tenancy, tenancy_of

__all__ = ["GatewayClients"]


class GatewayClients:
    """The chain's token and, with ``--api-keys``, clients' keys (re-read
    while the gateway runs: ``watch``)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.credentials = chain_credentials(config)
        self.api_keys = (
            None if config.api_keys is None else ApiKeyFile(config.api_keys, self.credentials)
        )

    async def watch(self) -> None:
        """Keep the keys as the file says, until cancelled (no file: return)."""
        if self.api_keys is not None:
            await watch_key_file(self.api_keys)

    def tenancy(self, ctx: RequestContext) -> Tenancy:
        """Whom a request serves, as the chain is told (wire-2 §3.15)."""
        groups = self.api_keys.cache_groups if self.api_keys is not None else {}
        return tenancy_of(ctx.tenant, ctx.peer, groups.get(ctx.tenant or ""))
