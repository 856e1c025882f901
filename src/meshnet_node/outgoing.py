"""What a node changes in a chunk's headers on the way out: down the chain
or back as the answer."""

from __future__ import annotations

from typing import Any

from meshnet_proto import WireHeaders

from .windows import window_accepted

__all__ = ["REQUEST_ONLY", "outgoing_changes", "relayed_headers"]

# What a request carries and an answer never does: the session's key
# (wire-2 §3.9), the prefix cache's keys (§3.10), the sampling parameters
# (§3.13), the stage expected (§3.2), whom the session serves (§3.15) and a
# window's drafts and place (§3.16).
REQUEST_ONLY: dict[str, Any] = {
    "session_key": None,
    "prefix": None,
    "prefix_blocks": (),
    "sample": None,
    "stage": None,
    "client": None,
    "cache_salt": None,
    "draft": None,
    "after": None,
}


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
    none of the request-only session key, prefix and sampling
    parameters (wire-2 §3.9, §3.10, §3.13), and a window's count of
    accepted drafts (answer-only, §3.16: never sent down).

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
        if headers.sample is not None:
            changes["sample"] = None
        if headers.client is not None:
            changes["client"] = None
        if headers.cache_salt is not None:
            changes["cache_salt"] = None
        if headers.draft is not None:
            changes["draft"] = None
        if headers.after is not None:
            changes["after"] = None
    accepted = window_accepted(headers, shape, dtype) if answer else None
    if accepted != headers.accepted:
        changes["accepted"] = accepted
    return changes


def relayed_headers(answer: WireHeaders) -> WireHeaders:
    """A downstream's answer as this node relays it: unchanged (a window's
    ``accepted`` count included: the sender needs it, wire-2 §3.16), less
    any request-only field a careless downstream sent back."""
    if (
        answer.stage is None
        and answer.session_key is None
        and answer.sample is None
        and answer.client is None
        and answer.cache_salt is None
        and answer.draft is None
        and answer.after is None
    ):
        return answer
    return answer.replace(
        stage=None,
        session_key=None,
        sample=None,
        client=None,
        cache_salt=None,
        draft=None,
        after=None,
    )
