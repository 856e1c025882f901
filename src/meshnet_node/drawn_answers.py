"""The direct return (wire-2 §3.14): ``GET /drawn/{session}?position=P``.

A relayed answer crosses every hop back: with S stages a token waits for
2 x S one-way delays. The gateway that reaches the last stage directly asks
it, at the moment it sends a decode step down the chain, for the token that
step will draw; the last stage answers that poll as soon as it has drawn —
S + 1 delays in all. The relayed answer still comes, and stays the
authority: the gateway checks it against the token it took early, and falls
back to it whenever a poll cannot be answered (another replica holds the
session, the session moved, a timeout).

What a peer can make this node hold is bounded: a poll is for a session
the poller owns (its key, §3.9) and that exists here; per session at most
``MAX_KEPT`` drawn answers are kept (4-byte bodies, and their headers) and
at most ``MAX_WAITED`` positions waited on, each wait at most the node's
``--timeout``. A forgotten session's answers go with it, and its pollers
are woken (404). A rewind (wire-2 §3.16) drops the answers at and past
its position: the direct return keeps one answer per position, the line's.
"""

from __future__ import annotations

import re

import anyio

from meshnet_proto import EndpointRequest, ErrorCode, ProtocolError, SessionTable
from meshnet_proto.lowlevel import Ticket, parse_session_key
from meshnet_runtime.http_server import ActivationReply, RequestContext

__all__ = ["MAX_KEPT", "MAX_WAITED", "DrawnAnswers"]

MAX_KEPT = 4  # drawn answers kept per session: a poll a few steps late still finds its own
MAX_WAITED = 2  # positions a session's polls may wait on at once
_QUERY = re.compile(r"position=(0|[1-9][0-9]{0,18})")


def _not_here(session: str, position: int) -> ProtocolError:
    return ProtocolError(
        f"no answer drawn at position {position} of session {session} here "
        "(not drawn yet within the wait, long gone, or held by another replica)",
        code=ErrorCode.NOT_FOUND,
    )


class DrawnAnswers:
    """The answers this last stage drew, by session and chunk position, and
    the polls waiting for them."""

    def __init__(self, table: SessionTable, timeout: float) -> None:
        self.table = table
        self.timeout = timeout
        self._answers: dict[str, dict[int, ActivationReply]] = {}
        self._waits: dict[str, dict[int, anyio.Event]] = {}

    def publish(self, session: str, position: int, reply: ActivationReply) -> None:
        """The answer to the sampled chunk at ``position`` is ready."""
        kept = self._answers.setdefault(session, {})
        kept[position] = reply
        while len(kept) > MAX_KEPT:
            del kept[min(kept)]
        waiting = self._waits.get(session)
        if waiting is not None and position in waiting:
            waiting.pop(position).set()

    def rewound(self, ticket: Ticket) -> None:
        """The chunk of ``ticket`` runs: if it is a rewind (wire-2 §3.16), the
        answers kept at its position and past it were drawn in the line the
        session leaves, so a poll no longer finds them (it waits for the new
        line's instead)."""
        kept = self._answers.get(ticket.session)
        if ticket.rewind_from is not None and kept:
            for stale in [p for p in kept if p >= ticket.position]:
                del kept[stale]

    def forget(self, session: str) -> None:
        """The session ended here: its answers go, its pollers wake (404)."""
        self._answers.pop(session, None)
        for event in self._waits.pop(session, {}).values():
            event.set()

    @property
    def waiting(self) -> int:
        return sum(len(positions) for positions in self._waits.values())

    async def endpoint(self, event: EndpointRequest, ctx: RequestContext) -> ActivationReply:
        """``GET /drawn/{session}?position=P``: the answer to the session's
        sampled chunk at position ``P``, as the chunk itself was answered."""
        session = event.path.removeprefix("/drawn/")
        match = _QUERY.fullmatch(event.query)
        if match is None:
            raise ProtocolError(
                "GET /drawn/{session} takes one query parameter: position=N",
                code=ErrorCode.BAD_REQUEST,
            )
        position = int(match.group(1))
        # Ownership first (403), then existence: a stranger learns nothing.
        self.table.check_owner(session, parse_session_key(event.headers))
        if session not in self.table:
            raise ProtocolError(f"session {session} is unknown here", code=ErrorCode.NOT_FOUND)
        answer = self._answers.get(session, {}).get(position)
        if answer is not None:
            return answer
        kept = self._answers.get(session)
        if kept and position < min(kept):
            raise _not_here(session, position)
        waiting = self._waits.setdefault(session, {})
        if position not in waiting and len(waiting) >= MAX_WAITED:
            raise _not_here(session, position)
        drawn = waiting.setdefault(position, anyio.Event())
        with anyio.move_on_after(self.timeout):
            await drawn.wait()
        if not drawn.is_set() and self._waits.get(session, {}).get(position) is drawn:
            del self._waits[session][position]  # nobody drew it in time: nothing left behind
            if not self._waits[session]:
                del self._waits[session]
        answer = self._answers.get(session, {}).get(position)
        if answer is None:
            raise _not_here(session, position)
        return answer
