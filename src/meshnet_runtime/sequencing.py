"""The waiting around ``SessionTable``: wait, wake, give up, join (wire-2 §3).

``SessionTable`` (the core) decides and never waits: ``offer`` answers
``Wait`` for a chunk that came before its predecessor, and the embedder
sleeps until the session moves on or the reorder timer runs out, then
offers again. A retransmission of a chunk still computing is answered
``Join``: it waits for the original's answer. ``SequencedTable`` is that
loop, once, for any anyio embedder (trio or asyncio)::

    seq = SequencedTable(SessionTable(limits))
    decision = await seq.admit(headers, fingerprint, deadline, replay=False)
    if isinstance(decision, Process):
        reply = await seq.run(decision.ticket, compute_and_forward)
    elif isinstance(decision, Join):
        reply = await seq.join(decision.ticket, deadline)
    ...

and its ``stage_done``, ``stage_failed``, ``end_session`` and ``expire``
are the table's, waking the session's waiters after each (a session's
next chunk may go; an ended one's waiters find it gone).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

import anyio

from meshnet_proto import (
    ErrorCode,
    Join,
    MeshnetError,
    Process,
    Reforward,
    Replay,
    SessionTable,
    Wait,
    WireHeaders,
)
from meshnet_proto.lowlevel import Ticket

from .deadlines import Deadline

__all__ = ["Admitted", "Decision", "Outcome", "SequencedTable", "gone"]

R = TypeVar("R")

# What ``admit`` hands back: every decision but ``Wait``, which it waits out.
Admitted = Process | Reforward | Replay | Join
# What one offer may answer.
Decision = Admitted | Wait


def gone() -> MeshnetError:
    """What a joined retransmission gets when the original ended without an answer."""
    return MeshnetError(
        "the original request for this chunk ended without an answer",
        code=ErrorCode.INTERNAL_ERROR,
    )


@dataclass(eq=False, slots=True)
class Outcome(Generic[R]):
    """The answer of one in-flight run, for retransmissions that ``Join`` it.

    The event a joiner waits on is made by the first joiner: almost every
    run has none, and an ``anyio.Event`` per run was a measurable part of a
    decode step (section decode)."""

    finished: bool = False
    reply: R | None = None
    error: MeshnetError | None = None
    _done: anyio.Event | None = None

    def finish(self, reply: R | None, error: MeshnetError | None) -> None:
        if not self.finished:
            self.reply, self.error, self.finished = reply, error, True
            if self._done is not None:
                self._done.set()

    async def wait(self) -> None:
        """Until ``finish`` (at once if it was called)."""
        if not self.finished:
            if self._done is None:
                self._done = anyio.Event()
            await self._done.wait()


class SequencedTable(Generic[R]):
    """A ``SessionTable`` with the waiting its decisions ask for.

    ``R`` is what a run answers (the embedder's reply), handed to the
    retransmissions that join it. ``on_wait_timeout`` is told each time a
    chunk's wait ended in the table's error (wire-2 §3.3: the reorder timer
    ran out), e.g. to count it.
    """

    def __init__(
        self,
        table: SessionTable,
        *,
        on_wait_timeout: Callable[[], None] | None = None,
        clock: Callable[[], float] = anyio.current_time,
    ) -> None:
        self.table = table
        self.on_wait_timeout = on_wait_timeout
        # The time the table is told (the loop's clock): an embedder that has
        # looked the loop's clock up (deadlines.loop_clock) saves
        # anyio.current_time()'s search for the backend, twice a chunk.
        self.clock = clock
        # One wake-up event per session with waiters: set (and dropped) when
        # the session may have moved on; its waiters then offer again.
        self._wakeups: dict[str, anyio.Event] = {}
        # The run of each ticket in flight, by serial: what a Join waits on.
        self._outcomes: dict[int, Outcome[R]] = {}

    @property
    def sessions_with_waiters(self) -> int:
        """Sessions whose chunks sleep until woken (each holds one wake-up event)."""
        return len(self._wakeups)

    def offer(
        self,
        headers: WireHeaders,
        fingerprint: bytes,
        deadline: Deadline,
        *,
        replay: bool = False,
        client: str | None = None,
        after: Wait | None = None,
        timed_out: bool = False,
    ) -> Decision:
        """One offer to the table, now: ``admit``'s step. A chunk that need not
        wait (a decode step's) is decided here at once, without a coroutine;
        a ``Wait`` goes to ``admit(..., first=...)``. ``after``: the ``Wait``
        this offers again after; ``timed_out``: that wait ran out."""
        try:
            return self.table.offer(
                headers,
                fingerprint,
                self.clock(),
                waiter=None if after is None else after.waiter,
                deadline=deadline.at,
                replay=replay,
                client=client,
            )
        except MeshnetError:
            if timed_out:  # the table ended the wait (wire-2 §3.3)
                if self.on_wait_timeout is not None:
                    self.on_wait_timeout()
                # Wake the session's other waiters (they re-offer and wait
                # again on a fresh event) so its wake-up event is not left
                # behind: for a session that never starts, nothing else
                # would ever pop it, and those would pile up.
                assert headers.session is not None
                self.wake(headers.session)
            raise

    async def admit(
        self,
        headers: WireHeaders,
        fingerprint: bytes,
        deadline: Deadline,
        *,
        replay: bool = False,
        client: str | None = None,
        first: Decision | None = None,
    ) -> Admitted:
        """Offer the chunk until the table answers anything but ``Wait``.

        ``first``: the answer of an ``offer`` already made for it. Raises what
        the table raises (a ``SequencingError``: out of window, timed out
        waiting, session gone …). Cancelled while waiting, the table's place
        for the chunk is given up before the cancel goes on. A ``Process`` or
        ``Reforward`` must go to ``run`` (or ``begin``) with no ``await`` in
        between: a retransmission told ``Join`` meanwhile would find no run
        to join (``gone()``).
        """
        offer = partial(self.offer, headers, fingerprint, deadline, replay=replay, client=client)
        decision = first if first is not None else offer()
        while isinstance(decision, Wait):
            assert headers.session is not None
            wake = self._wakeups.setdefault(headers.session, anyio.Event())
            try:
                with anyio.move_on_after(decision.until - self.clock()) as timer:
                    await wake.wait()
            except anyio.get_cancelled_exc_class():
                # Cancelled from outside (shutdown, a caller's scope): the
                # table must not keep a place for a chunk nobody will offer.
                self.table.give_up(decision.waiter, self.clock())
                raise
            # At until, offer again rather than give up: the table knows
            # whether the session progressed meanwhile (its predecessor may
            # be in the stage now), which stops the reorder timer.
            decision = offer(after=decision, timed_out=timer.cancelled_caught)
        return decision

    def begin(self, ticket: Ticket) -> Outcome[R]:
        """An admitted ticket's run starts (``Process``, ``Reforward``): what
        retransmissions told ``Join`` meanwhile wait on. ``finish`` it with the
        answer or the ``MeshnetError``, and ``end`` it however it ended.
        ``run`` is this around one awaitable; the node does it inline."""
        outcome: Outcome[R] = Outcome()
        self._outcomes[ticket.serial] = outcome
        return outcome

    def end(self, ticket: Ticket, outcome: Outcome[R]) -> None:
        """The run is over: unfinished (a cancel, a bug), its joiners get ``gone()``."""
        if not outcome.finished:  # cancelled: joined retransmissions must not hang
            outcome.finish(None, gone())
        del self._outcomes[ticket.serial]

    async def run(self, ticket: Ticket, work: Callable[[], Awaitable[R]]) -> R:
        """``work()`` for an admitted ticket (``Process``, ``Reforward``): its
        answer or its ``MeshnetError`` goes to every retransmission joined
        meanwhile; any other end (a cancel, a bug) tells them ``gone()``."""
        outcome = self.begin(ticket)
        try:
            reply = await work()
            outcome.finish(reply, None)
            return reply
        except MeshnetError as err:
            outcome.finish(None, err)
            raise
        finally:
            self.end(ticket, outcome)

    async def join(self, ticket: Ticket, deadline: Deadline) -> R:
        """A ``Join``: the answer of the ticket's run in flight (its error
        raised), or the deadline's 504 if it does not come in time."""
        outcome = self._outcomes.get(ticket.serial)
        if outcome is None:  # cannot happen: a ticket in flight has its outcome
            raise gone()
        with anyio.move_on_after(max(deadline.remaining(), 0)):
            await outcome.wait()
        if not outcome.finished:
            deadline.check()
        if outcome.error is not None:
            raise outcome.error
        assert outcome.reply is not None
        return outcome.reply

    def wake(self, session: str) -> None:
        """Let the session's waiting chunks offer again."""
        event = self._wakeups.pop(session, None)
        if event is not None:
            event.set()

    # The table's steps that may let a waiting chunk go, each with its wake-up.

    def stage_done(self, ticket: Ticket, stage_output: Any) -> None:
        """The stage ran the ticket's chunk: the session's next may start."""
        self.table.stage_done(ticket, stage_output, self.clock())
        self.wake(ticket.session)

    def stage_failed(self, ticket: Ticket) -> None:
        """The stage failed on it: the chunk may come again, its successors wait on."""
        self.table.stage_failed(ticket, self.clock())
        self.wake(ticket.session)

    def end_session(self, session: str) -> bool:
        """Forget the session (a DELETE); its waiters find it gone. Whether it was known."""
        known = self.table.end_session(session)
        self.wake(session)
        return known

    def expire(self) -> list[str]:
        """Forget the sessions idle past their TTL, waking their waiters."""
        expired = self.table.expire(self.clock())
        for session in expired:
            self.wake(session)
        return expired
