"""A chunk's wait for its turn (wire-2 §3.3): whether it may wait, until
when — the reorder timer — and the error when the wait is over.

``Waiting`` is a collaborator of ``SessionTable``: it shares the table's
session dict, waiter registry, serial counter and the record of when a
chunk of each session last left the stage (the table writes that one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from ._claims import INDEX, unknown
from ._decisions import Wait
from ._errors import CapacityError, ErrorCode, SequencingError
from ._limits import Limits
from ._routing import Session
from ._waiters import Waiter, WaiterRegistry

__all__ = ["Waiting", "in_stage"]


def in_stage(s: Session) -> bool:
    """Whether a chunk of the session is in the stage (admitted, not yet done
    or failed): only its next index can be, and a record there is RUNNING —
    ``stage_done`` moves the next index on, ``stage_failed`` drops the record."""
    return s.next_index in s.records


class Waiting:
    """The waits of one table's chunks: admission to wait, timer, verdict."""

    def __init__(
        self,
        limits: Limits,
        max_pending_waiters: int,
        sessions: dict[str, Session],
        waiters: WaiterRegistry,
        left_stage: dict[str, float],
        serials: Iterator[int],
    ):
        self._limits = limits
        self._max_pending = max_pending_waiters
        self._sessions = sessions
        self._waiters = waiters
        # When a chunk of each known session last left the stage (done or
        # failed): a waiter's reorder timer counts from then (wire-2 §3.3).
        self._left_stage = left_stage
        self._serials = serials

    def wait(
        self, sid: str, index: int, now: float, waiter: Waiter | None, deadline: float | None
    ) -> Wait:
        """The ``Wait`` for a chunk ahead of its turn (a new waiter, or the
        returning ``waiter`` with its timer renewed); raises when it is over."""
        if waiter is None:  # a new waiter; a returning one was counted already
            self.check_room(sid, index)
            if deadline is None:
                # The core allows no deadline (a node always has one, its
                # --timeout); a wait must still end, progress or not: a
                # session whose short runs keep finishing while this chunk's
                # turn never comes would otherwise hold it for ever.
                limits = self._limits
                deadline = now + max(limits.session_ttl, limits.reorder_timeout)
            waiter = Waiter(
                session=sid,
                index=index,
                since=now,
                until=deadline,
                end=deadline,
                serial=next(self._serials),
            )
        until = self.until(waiter)
        if now >= until:
            raise self.over(waiter, now)
        waiter = replace(waiter, until=until)
        self._waiters.add(waiter, known=sid in self._sessions)
        return Wait(waiter, until)

    def until(self, waiter: Waiter) -> float:
        """When the wait is over unless the session progresses first (wire-2 §3.3).

        The reorder timeout is there to find a predecessor lost on its way;
        while a chunk of the session is in the stage (computing, or queued
        behind other sessions' work) none is lost, so the timer stops and only
        ``end`` bounds the wait. Otherwise it runs from the later of the wait's
        start and the last time a chunk of the session left the stage. A pure
        function of the table: a waiter woken for nothing gets the same
        ``until`` again, and one offered at ``until`` sees any change it was
        not woken for (an admission, say) — so the driver need not wake
        waiters when a chunk is admitted.
        """
        s = self._sessions.get(waiter.session)
        if s is not None and in_stage(s):
            return waiter.end
        return min(self._stall_start(waiter) + self._limits.reorder_timeout, waiter.end)

    def _stall_start(self, waiter: Waiter) -> float:
        return max(waiter.since, self._left_stage.get(waiter.session, waiter.since))

    def over(self, waiter: Waiter, now: float) -> SequencingError:
        """The error for a wait that ended at ``now`` (its waiter already forgotten)."""
        s = self._sessions.get(waiter.session)
        waited = f"{now - waiter.since:.3g} s"
        if s is None:
            return unknown(
                f"session {waiter.session} never started: chunk {waiter.index} "
                f"waited {waited} for chunk 0"
            )
        if now >= waiter.end:
            why = "until its deadline"
        elif in_stage(s):  # only a driver that gives up early gets here
            why = f"while chunk {s.next_index} was in the stage"
        else:
            why = f"the last {now - self._stall_start(waiter):.3g} s without progress"
        return SequencingError(
            f"session {waiter.session}: chunk {waiter.index} waited {waited} "
            f"for chunk {s.next_index}, {why}",
            code=ErrorCode.CHUNK_WAIT_TIMEOUT,
            header=INDEX,
        )

    def check_room(self, sid: str, index: int) -> None:
        """Whether one more chunk may wait: a session's reorder window, and
        the bound on chunks waiting for sessions not started yet."""
        window = self._limits.reorder_window
        if self._waiters.count(sid) >= window:
            raise SequencingError(
                f"session {sid}: chunk {index} cannot wait, {window} chunks already wait "
                f"(the reorder window)",
                code=ErrorCode.CHUNK_OUT_OF_WINDOW,
                header=INDEX,
            )
        pending = self._waiters.pending
        if sid not in self._sessions and pending >= self._max_pending:
            # Load, not a sequencing fault: such waits end within the reorder timeout.
            raise CapacityError(
                f"{pending} chunks already wait for sessions that have not started",
                code=ErrorCode.SESSIONS_FULL,
                retry_after=math.ceil(self._limits.reorder_timeout),
            )
