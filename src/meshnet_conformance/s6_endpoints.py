"""wire-2 §6: the control endpoints, and routing."""

from __future__ import annotations

import hashlib
import json

from meshnet_proto.lowlevel import StageIdentity

from ._case import Case, Context, expect_error, expect_status, new_session
from ._wire import CheckFailed

SECTION = "6"


def _health(ctx: Context) -> None:
    expect_status(ctx.send(ctx.request("GET", "/health")), 200)


def _info(ctx: Context) -> None:
    response = expect_status(ctx.send(ctx.request("GET", "/info")), 200)
    info = response.json()
    if not isinstance(info, dict) or info.get("wire") != 2:
        raise CheckFailed(f'/info must be a JSON object with "wire": 2, got {info!r:.120}')
    if info.get("role") not in ("node", "gateway"):
        raise CheckFailed(f"/info role must be node or gateway, got {info.get('role')!r}")
    if info["role"] == "node" and not isinstance(info.get("reorder_window"), int):
        raise CheckFailed("a node's /info must give its reorder_window (an integer)")


_IDENTITY_KEYS = {
    "fingerprint",
    "model",
    "weights",
    "tokenizer",
    "layers",
    "n_layers",
    "vocab",
    "hidden",
    "max_context",
    "engine",
    "dtype",
    "input",
    "output",
    "wire_dtype",
    "encoding",
}


def _info_identity(ctx: Context) -> None:
    info = expect_status(ctx.send(ctx.request("GET", "/info")), 200).json()
    if not isinstance(info, dict) or info.get("role") != "node":
        return  # wire-2 §6.1: a node's; a gateway shows its chain's in deep health
    identity = info.get("identity")
    if not isinstance(identity, dict) or set(identity) != _IDENTITY_KEYS:
        raise CheckFailed(f"a node's /info identity must have exactly {sorted(_IDENTITY_KEYS)}")
    try:
        StageIdentity.from_json(identity)
    except ValueError as exc:
        raise CheckFailed(f"/info identity: {exc}") from None
    rest = {k: v for k, v in identity.items() if k != "fingerprint"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    if hashlib.blake2b(canonical, digest_size=16).hexdigest() != identity["fingerprint"]:
        raise CheckFailed("identity.fingerprint is not blake2b-128 of the other fields' JSON")


def _metrics(ctx: Context) -> None:
    response = expect_status(ctx.send(ctx.request("GET", "/metrics")), 200)
    media = (response.header("content-type") or "").split(";")[0].strip()
    if media != "text/plain":
        raise CheckFailed(f"/metrics is Prometheus text (text/plain), got {media!r}")


def _not_found(ctx: Context) -> None:
    expect_error(ctx.send(ctx.request("GET", "/no-such-path")), 404, "not_found")


def _method(ctx: Context) -> None:
    expect_error(ctx.send(ctx.request("GET", "/forward")), 405, "method_not_allowed")
    expect_error(ctx.send(ctx.request("POST", "/health")), 405, "method_not_allowed")


def _delete_unknown(ctx: Context) -> None:
    response = ctx.send(ctx.request("DELETE", f"/sessions/{new_session()}"))
    expect_error(response, 404, "not_found")


CASES: list[Case] = [
    Case("6.health", SECTION, "GET /health is 200", _health),
    Case(
        "6.info",
        SECTION,
        "GET /info is a JSON object with wire 2, the role and (a node) the reorder window",
        _info,
    ),
    Case(
        "6.info.identity",
        SECTION,
        "a node's /info has an identity (§6.1) whose fingerprint covers its fields",
        _info_identity,
    ),
    Case("6.metrics", SECTION, "GET /metrics is 200 Prometheus text", _metrics),
    Case("6.not-found", SECTION, "an unknown path is 404 not_found", _not_found),
    Case(
        "6.method", SECTION, "a known path with another method is 405 method_not_allowed", _method
    ),
    Case(
        "6.delete-unknown",
        SECTION,
        "DELETE of an unknown session is 404 not_found",
        _delete_unknown,
    ),
]
