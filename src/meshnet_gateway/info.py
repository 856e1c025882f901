"""What the gateway's ``GET /info`` says about it (wire-2 §6): its settings,
what it learnt of its entry and its chain, and what it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshnet_proto import WIRE_VERSION

if TYPE_CHECKING:
    from .app import GatewayApp

__all__ = ["gateway_info"]


def _speculate(app: GatewayApp) -> dict[str, Any] | None:
    """Speculative decoding's settings and drafter (None: off, or no /v1)."""
    speculate = None if app.openai is None else app.openai.chain_settings().speculate
    return None if speculate is None else speculate.describe()


def gateway_info(app: GatewayApp) -> dict[str, Any]:
    """The gateway's ``/info`` document."""
    config = app.config
    return {
        "role": "gateway",
        "wire": WIRE_VERSION,
        "entry": app.pool.url,
        "replicas": app.pool.describe(),
        "chunk_tokens": config.chunk_tokens,
        "inflight": {
            "configured": config.inflight,
            "entry_reorder_window": app.entry_window,
            "effective": app.inflight,
        },
        "encoding": config.encoding,
        "auto_encoding": None
        if app.to_entry.auto is None
        else {"to_entry": app.to_entry.describe(), "to_clients": app.to_clients.describe()},
        "wire_dtype": config.wire_dtype,
        "zstd_level": config.zstd_level,
        "timeout_s": config.timeout,
        "retries": {"max": config.retries, "backoff_ms": config.retry_backoff_ms},
        "sessions": {
            "held": len(app.sessions),
            "max": config.max_sessions,
            "ttl_s": config.session_ttl,
        },
        "limits": config.limits_info(),
        "auth": config.token is not None,
        "model": app.openai.model.name if app.openai is not None else None,
        "admission": app.admission.describe() if app.openai is not None else None,
        "sample_at": config.sample_at,
        "direct_return": app.direct.describe() if app.direct is not None else None,
        "speculate": _speculate(app),
        "chain": {
            "checked": app.chain_problems is not None,
            "problems": [p.to_json() for p in app.chain_problems or []],
            "expected_entry": app.expected_entry,
        },
    }
