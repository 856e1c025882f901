"""wire-2 §3.11: the KV hand-off message — where its headers may go, what an
import must look like, and the export's answers.

Every import case is refused from the head by rules any server applies (a
gateway and a stage without KV too), so the checker never moves a session.
"""

from __future__ import annotations

import math

import xxhash

from ._case import BOTH, GATEWAY, NODE, Case, Context, expect_error, float32_body, new_session
from ._session_chunks import _chunk, _expect_at
from ._wire import CheckFailed, Response

SECTION = "3"
CHECKSUM = "X-Meshnet-KV-Checksum"
FINGERPRINT = "X-Meshnet-KV-Fingerprint"
# A KV tensor [layers, 2, batch, kv_heads, positions, head_dim] of this size.
POSITIONS = 4
KV_SHAPE = (1, 2, 1, 1, POSITIONS, 2)
# Nobody's identity: a case that got past the head's shape checks would meet
# 409 stage_mismatch, never an import.
FOREIGN = "0" * 32


def _import(
    ctx: Context,
    *,
    shape: tuple[int, ...] = KV_SHAPE,
    position: int = POSITIONS,
    total: int = 1,
    checksum: str | None = None,
    fingerprint: str | None = FOREIGN,
) -> bytes:
    headers = [
        ("Content-Type", "application/octet-stream"),
        ("X-Meshnet-Wire", "2"),
        ("X-Meshnet-Shape", ",".join(map(str, shape))),
        ("X-Meshnet-Dtype", "float32"),
        ("X-Meshnet-Session", new_session()),
        ("X-Meshnet-Chunk-Index", "0"),
        ("X-Meshnet-Chunk-Total", str(total)),
        ("X-Meshnet-Position", str(position)),
    ]
    body = bytes(4 * math.prod(shape))
    if checksum is None:
        checksum = xxhash.xxh3_64_hexdigest(body)
    if checksum:
        headers.append((CHECKSUM, checksum))
    if fingerprint is not None:
        headers.append((FINGERPRINT, fingerprint))
    return ctx.request("POST", "/forward?kv=1", headers, body)


def _refused(ctx: Context, request: bytes, header: str) -> None:
    expect_error(ctx.send(request), 400, "bad_kv", header=header)


def _kv_header_on_a_chunk(name: str, value: str) -> Case:
    def check(ctx: Context) -> None:
        session = new_session() if ctx.role == "node" else None
        headers = [*ctx.forward_headers(2, session=session, position=0), (name, value)]
        _refused(ctx, ctx.forward(headers, float32_body(2)), name.lower())
        if session is not None:  # refused from the head: the session starts afresh at 0
            _expect_at(ctx.send(_chunk(ctx, session, position=0, seed=1)), 0)

    return Case(
        f"3.kv.{name.lower().removeprefix('x-meshnet-kv-')}-on-a-chunk",
        SECTION,
        f"{name} on a message that is not a KV import (a plain chunk) is 400 bad_kv "
        "naming it, and changes nothing",
        check,
    )


def _import_case(
    id: str, description: str, header: str, *, roles: frozenset[str] = BOTH, **spoil: object
) -> Case:
    def check(ctx: Context) -> None:
        _refused(ctx, _import(ctx, **spoil), header)  # type: ignore[arg-type]

    return Case(id, SECTION, description, check, roles)


def _export_unknown(ctx: Context) -> None:
    response = ctx.send(ctx.request("GET", f"/kv/{new_session()}"))
    expect_error(response, 404, "not_found")


def _export_held(ctx: Context) -> None:
    session = new_session()
    headers = ctx.forward_headers(2, session=session, position=0)
    first = ctx.send(ctx.forward(headers, float32_body(2)))
    if first.status != 200:
        raise CheckFailed(f"the session's first chunk: {first.summary()}")
    response = ctx.send(ctx.request("GET", f"/kv/{session}"))
    if response.status == 409:  # a stage that keeps no state
        expect_error(response, 409, "kv_unsupported")
        return
    _expect_kv_message(response, session)


def _expect_kv_message(response: Response, session: str) -> None:
    if response.status != 200:
        raise CheckFailed(
            f"expected 200 with the KV message or 409 kv_unsupported, got {response.summary()}"
        )
    shape = (response.header("x-meshnet-shape") or "").split(",")
    if len(shape) != 6 or shape[1] != "2":
        raise CheckFailed(f"a KV message's shape is rank 6 with axis 1 of 2, got {shape}")
    if response.header("x-meshnet-position") != shape[4]:
        raise CheckFailed("a KV message's X-Meshnet-Position is its positions (axis 4)")
    if response.header("x-meshnet-session") != session:
        raise CheckFailed("the KV message names another session")
    body = response.body
    if response.header("x-meshnet-encoding") not in (None, "identity"):
        return  # the checksum is of the decoded bytes; identity is what is checked here
    if response.header("x-meshnet-kv-checksum") != xxhash.xxh3_64_hexdigest(body):
        raise CheckFailed("X-Meshnet-KV-Checksum is not the XXH3-64 of the tensor's bytes")
    fingerprint = response.header("x-meshnet-kv-fingerprint") or ""
    if len(fingerprint) != 32:
        raise CheckFailed(f"X-Meshnet-KV-Fingerprint {fingerprint!r} is not 32 hex digits")


def _registration(ctx: Context) -> None:
    """wire-2 §3.12: ``/info``'s ``handoff`` is null (no KV to hand off) or
    the registration a replica set reads."""
    response = ctx.send(ctx.request("GET", "/info"))
    document = response.json() if response.status == 200 else None
    if not isinstance(document, dict):
        raise CheckFailed(f"GET /info: {response.summary()}")
    handoff = document.get("handoff")
    if handoff is None:
        return
    if not isinstance(handoff, dict):
        raise CheckFailed(f"/info handoff is neither null nor an object: {handoff!r}")
    if handoff.get("role") not in ("any", "prefill", "decode"):
        raise CheckFailed(f"/info handoff.role {handoff.get('role')!r} is not any, prefill, decode")
    if handoff.get("kv_dtype") not in ("float32", "float16", "bfloat16"):
        raise CheckFailed(f"/info handoff.kv_dtype {handoff.get('kv_dtype')!r} is not a KV dtype")
    for key in ("bytes_per_position", "kv_free_bytes"):
        value = handoff.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckFailed(f"/info handoff.{key} {value!r} is not a count")


def _gateway_holds_no_kv(ctx: Context) -> None:
    expect_error(ctx.send(ctx.request("GET", f"/kv/{new_session()}")), 404, "not_found")
    expect_error(ctx.send(_import(ctx)), 400, "bad_kv")


CASES: list[Case] = [
    _kv_header_on_a_chunk(CHECKSUM, "0" * 16),
    _kv_header_on_a_chunk(FINGERPRINT, "0" * 32),
    _import_case(
        "3.kv.checksum-grammar",
        "a KV import's X-Meshnet-KV-Checksum that is not 16 lowercase hex digits is 400 bad_kv",
        CHECKSUM.lower(),
        checksum="ABC",
    ),
    _import_case(
        "3.kv.checksum-missing",
        "a KV import without X-Meshnet-KV-Checksum is 400 bad_kv",
        CHECKSUM.lower(),
        checksum="",
    ),
    _import_case(
        "3.kv.fingerprint-missing",
        "a KV import without X-Meshnet-KV-Fingerprint is 400 bad_kv",
        FINGERPRINT.lower(),
        fingerprint=None,
    ),
    _import_case(
        "3.kv.not-rank-6",
        "a KV import whose tensor is not [layers, 2, batch, "
        "kv_heads, positions, head_dim] ([1, 2, 4]) is 400 bad_kv",
        "x-meshnet-shape",
        shape=(1, 2, 4),
        position=2,
    ),
    _import_case(
        "3.kv.position",
        "a KV import whose X-Meshnet-Position is not its positions is 400 bad_kv",
        "x-meshnet-position",
        position=POSITIONS + 1,
    ),
    # To a gateway, total 2 is 400 bad_chunk_index first (2.gateway-one-sequence).
    _import_case(
        "3.kv.one-chunk",
        "to a node, a KV import is a one-chunk run: total 2 is 400 bad_kv",
        "x-meshnet-chunk-index",
        total=2,
        roles=NODE,
    ),
    Case(
        "3.kv.export-unknown",
        SECTION,
        "GET /kv/{id} of a session the node does not hold is 404 not_found",
        _export_unknown,
        NODE,
    ),
    Case(
        "3.kv.export",
        SECTION,
        "GET /kv/{id} of a session the node holds is 200 with its "
        "KV message (rank 6, position, checksum, fingerprint), or 409 kv_unsupported from a "
        "stage that keeps no state",
        _export_held,
        NODE,
    ),
    Case(
        "3.kv.registration",
        SECTION,
        "/info's handoff is null, or names the node's role "
        "(any, prefill, decode), KV dtype, bytes per position and free KV bytes (§3.12)",
        _registration,
        NODE,
    ),
    Case(
        "3.kv.gateway",
        SECTION,
        "a gateway holds no KV: GET /kv/{id} is 404 not_found, an import is 400 bad_kv",
        _gateway_holds_no_kv,
        GATEWAY,
    ),
]
