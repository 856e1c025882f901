"""What a node changes in a chunk's headers on the way out: down the chain
or back as the answer."""

from __future__ import annotations

from typing import Any

from meshnet_proto import WireHeaders

__all__ = ["outgoing_changes"]


def outgoing_changes(
    headers: WireHeaders,
    shape: tuple[int, ...],
    dtype: str,
    encoding: str,
    position: int,
    *,
    answer: bool,
) -> dict[str, Any]:
    """The fields of a request's ``headers`` that what leaves the node for
    it changes — its output's shape, dtype and encoding, the session's
    position; no deadline and no stage (X-Meshnet-Stage is request-only:
    what goes down names the next stage itself) — and, for an ``answer``,
    none of the request-only session key and prefix (wire-2 §3.9, §3.10).

    Only the fields that differ: a decode step's usually none, so that
    ``headers.replace(**changes)`` is the request's own headers, without
    comparing a dozen keyword arguments field by field (section decode).
    """
    changes: dict[str, Any] = {}
    if shape != headers.shape:
        changes["shape"] = tuple(shape)
    if dtype != headers.dtype:
        changes["dtype"] = dtype
    if encoding != headers.encoding:
        changes["encoding"] = encoding
    if position != headers.position:
        changes["position"] = position
    if headers.deadline_ms is not None:
        changes["deadline_ms"] = None
    if headers.stage is not None:
        changes["stage"] = None
    if answer:
        if headers.session_key is not None:
            changes["session_key"] = None
        if headers.prefix is not None:
            changes["prefix"] = None
        if headers.prefix_blocks:
            changes["prefix_blocks"] = ()
    return changes
