"""``NodeControl``: what a node answers beside its stage's output.

A driver that holds a ``SessionTable`` and runs a stage still owes wire 2
the rest of a node: the checks of a chunk's head that are not the table's
(a spent deadline, a chunk meant for another stage), the answer's headers
(the session's position, nothing request-only, a window's accepted count)
and the control endpoints (``/info`` with the node's identity, ``/metrics``,
``DELETE /sessions/{id}``, ``GET /kv/{id}``, ``GET /drawn/{id}``). None of it
depends on the stage or the transport, so it is written once here; the
driver keeps its sockets, its clock and its waiting (docs/embedding.md).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from ._body import Body
from ._decisions import Ticket
from ._errors import ErrorCode, MeshnetError, ProtocolError
from ._events import EndpointRequest
from ._headers import WireHeaders, parse_session_key
from ._limits import Limits
from ._sequencer import SessionTable

__all__ = ["Answer", "NodeControl", "answer_headers", "stub_identity"]

# An endpoint's answer: status, header pairs, body (``ServerConnection.send_response``'s).
Answer = tuple[int, list[tuple[str, str]], Body]

_POSITION = re.compile(r"position=(0|[1-9][0-9]{0,18})")
# Drawn answers kept per session: a poll a few steps late still finds its own.
_KEPT_DRAWN = 4


def stub_identity(name: str) -> dict[str, Any]:
    """The wire-2 §6.1 identity fields of a stage with no model and no
    layers, taking and making any tensor (an echo, a toy layer)."""
    fields: dict[str, Any] = dict.fromkeys(
        (
            "weights",
            "tokenizer",
            "layers",
            "n_layers",
            "vocab",
            "hidden",
            "max_context",
            "engine",
            "dtype",
        ),
    )
    return {**fields, "model": f"stub-{name}", "input": "any", "output": "any"}


def answer_headers(
    request: WireHeaders, shape: tuple[int, ...], dtype: str, encoding: str, position: int
) -> WireHeaders:
    """The headers of the last stage's answer to ``request``: the output's
    shape, dtype and encoding, the chunk's ``position`` (wire-2 §3.1: a 200
    always says where the chunk started), none of the request-only fields
    (§3.2, §3.9, §3.10, §3.13, §3.15, §3.16) and, for a verify window, how
    many drafts the answer accepted (§3.16: ``n - 1`` of its ``n`` tokens)."""
    accepted = None
    if request.draft is not None and request.sample is not None and len(shape) == 2:
        accepted = (shape[1] if dtype == "int32" else shape[0]) - 1
    return request.replace(
        shape=tuple(shape),
        dtype=dtype,
        encoding=encoding,
        position=position,
        deadline_ms=None,
        stage=None,
        session_key=None,
        prefix=None,
        prefix_blocks=(),
        sample=None,
        client=None,
        cache_salt=None,
        draft=None,
        after=None,
        accepted=accepted,
    )


def _not_found(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.NOT_FOUND)


class NodeControl:
    """A node's sessions (``table``, a ``SessionTable``) and everything it
    answers about them; ``identity``: the stage's §6.1 fields (without the
    fingerprint, which is worked out here)."""

    def __init__(self, identity: Mapping[str, Any], limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        fields = {k: v for k, v in identity.items() if k != "fingerprint"}
        fields.setdefault("wire_dtype", "keep")
        fields.setdefault("encoding", "mirror")
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.blake2b(canonical, digest_size=16).hexdigest()
        self.identity: dict[str, Any] = {"fingerprint": digest, **fields}
        layers = fields.get("layers")
        # What X-Meshnet-Stage must name to enter here (wire-2 §3.2 step 0).
        self.stage = None if layers is None else f"{fields['model']}/{layers[0]}"
        self.table = SessionTable(self.limits, on_forget=self._forget)
        self.chunks = 0
        self._drawn: dict[str, dict[int, tuple[WireHeaders, Body]]] = {}

    def check_head(
        self, headers: WireHeaders, now: float, *, replay: bool = False, client: str | None = None
    ) -> None:
        """A chunk's head checks, in wire-2 §2's order: a deadline already
        spent (504), a chunk meant for another stage (409 ``stage_mismatch``,
        before anything changes), then the table's (``SessionTable.check_head``)."""
        if headers.deadline_ms == 0:
            raise MeshnetError(
                "x-meshnet-deadline-ms: 0, the request's time is spent",
                code=ErrorCode.DEADLINE_EXCEEDED,
            )
        if headers.stage is not None and headers.stage != self.stage:
            raise MeshnetError(
                f"x-meshnet-stage: the sender expects stage {headers.stage}, "
                f"this node is {self.stage or 'a stage without layers'}",
                code=ErrorCode.STAGE_MISMATCH,
                header="x-meshnet-stage",
            )
        self.table.check_head(headers, now, replay=replay, client=client)

    def answered(
        self, ticket: Ticket, headers: WireHeaders, body: Body, now: float, *, drawn: bool
    ) -> None:
        """The last stage answered ``ticket``'s chunk with ``headers`` and
        ``body``: kept for a retransmission (``response_ready``: a ``Replay``
        hands back ``(headers, body)``) and, when it ``drawn`` a token (a
        sampled chunk), for ``GET /drawn`` at the chunk's position (§3.14)."""
        self.chunks += 1
        self.table.response_ready(ticket, (headers, body), now, nbytes=memoryview(body).nbytes)
        if drawn:
            kept = self._drawn.setdefault(ticket.session, {})
            for position in [p for p in kept if p >= ticket.position]:
                del kept[position]  # a rewind's line replaces the old one's
            kept[ticket.position] = (headers, body)
            for position in sorted(kept)[:-_KEPT_DRAWN]:
                del kept[position]

    def _forget(self, session: str) -> None:
        self._drawn.pop(session, None)

    def info(self) -> dict[str, Any]:
        """``GET /info`` (wire-2 §6.1); ``handoff`` null: no KV to hand off (§3.12)."""
        return {
            "role": "node",
            "wire": 2,
            "reorder_window": self.limits.reorder_window,
            "sessions": len(self.table),
            "identity": self.identity,
            "handoff": None,
        }

    def endpoint(self, event: EndpointRequest) -> Answer:
        """The answer to a control endpoint of ``DEFAULT_ROUTES``; raises the
        ``MeshnetError`` to answer with ``send_error`` instead."""
        if event.route == "/health":
            return 200, [("Content-Type", "text/plain")], b"ok"
        if event.route == "/info":
            return 200, [("Content-Type", "application/json")], json.dumps(self.info()).encode()
        if event.route == "/metrics":
            text = f"meshnet_sessions {len(self.table)}\nmeshnet_chunks_total {self.chunks}\n"
            return 200, [("Content-Type", "text/plain; version=0.0.4")], text.encode()
        session = event.path.rsplit("/", 1)[1]
        key = parse_session_key(event.headers)
        if event.route == "/sessions/*":
            self.table.check_owner(session, key)  # 403 session_forbidden (§3.9)
            if not self.table.end_session(session):
                raise _not_found(f"no session {session} here")
            return 204, [], b""
        if event.route == "/kv/*":
            if session not in self.table:
                raise _not_found(f"no session {session} here")
            self.table.check_owner(session, key)
            raise MeshnetError(
                "this node's stage keeps no state to export", code=ErrorCode.KV_UNSUPPORTED
            )
        return self._drawn_answer(session, key, event.query)

    def _drawn_answer(self, session: str, key: str | None, query: str) -> Answer:
        """``GET /drawn/{id}?position=P`` (§3.14), as the chunk was answered.
        A poll for a token not drawn yet is 404 at once: this helper keeps no
        waiting poll (the sender falls back to the relayed answer)."""
        match = _POSITION.fullmatch(query)
        if match is None:
            raise ProtocolError(
                f"/drawn: query {query!r} is not position=<int>", code=ErrorCode.BAD_REQUEST
            )
        if session not in self.table:
            raise _not_found(f"no session {session} here")
        self.table.check_owner(session, key)
        position = int(match.group(1))
        kept = self._drawn.get(session, {}).get(position)
        if kept is None:
            raise _not_found(f"no answer drawn at position {position} of session {session}")
        headers, body = kept
        return 200, [(n.decode(), v.decode()) for n, v in headers.to_pairs()], body
