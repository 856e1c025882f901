"""Sending a session's chunk to one replica, and moving the session when it fails.

``Failover.attempt`` is one forward that gives up as soon as the replica is
known down; ``recover`` moves a session to a replica that holds its state
(discovery) or is given it (a replay of this hop's history, sent as
``POST /forward?replay=1``), then sends the chunk there (docs/failover.md,
"Failover with replay", "Discovery").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import anyio

from meshnet_proto import (
    ActivationResponse,
    DownstreamError,
    ErrorCode,
    ErrorResponse,
    MeshnetError,
    WireHeaders,
)

from ..deadlines import Deadline
from ..downstream import key_headers
from ..history import HistoryStore, Order, SentChunk
from .handoff import HandoffCounts, hand_off
from .monitor import HealthMonitor
from .placement import Placement
from .replica import Replica

__all__ = ["REPLAY_PATH", "Failover", "Lost", "lost_session"]

log = logging.getLogger("meshnet.replicas")

REPLAY_PATH = "/forward?replay=1"

Body = bytes | bytearray | memoryview
Answer = ActivationResponse | ErrorResponse


class Lost(Exception):
    """The replica failed (down, hung, gone): try another.

    ``hung``: no forward failed; its probes stopped answering (it may only
    be slow), so it stays a last resort."""

    def __init__(self, *, hung: bool = False) -> None:
        super().__init__()
        self.hung = hung


def _own_error(response: Answer, code: str) -> bool:
    """The replica itself (not a node below it) answered the error ``code``."""
    return (
        isinstance(response, ErrorResponse)
        and response.error.get("code") == code
        and response.error.get("hop") is None
    )


def lost_session(response: Answer) -> bool:
    """The replica itself (not a node below it) does not hold the session."""
    return _own_error(response, "session_unknown")


def _stale_copy(response: Answer, headers: WireHeaders) -> bool:
    """The replica answered a replay's first chunk that it holds the session."""
    return _own_error(response, "session_exists") and headers.starts_session


class Failover:
    """The forwards and failovers of one hop (``stage``: its URL list)."""

    def __init__(
        self,
        stage: str,
        placement: Placement[Replica],
        history: HistoryStore,
        monitor: HealthMonitor,
        probe_timeout: float,
    ) -> None:
        self.stage = stage
        self.placement = placement
        self.history = history
        self.monitor = monitor
        self.probe_timeout = probe_timeout
        self.locks: dict[str, anyio.Lock] = {}
        self.failovers = 0
        self.replayed_chunks = 0
        self.replayed_tokens = 0
        self.replayed_bytes = 0
        self.handoffs = HandoffCounts()

    # ------------------------------------------------------------ one forward

    async def attempt(
        self,
        replica: Replica,
        headers: WireHeaders,
        body: Body,
        deadline: Deadline,
        path: str = "/forward",
    ) -> Answer:
        """One forward to one replica; ``Lost`` if it is down, hangs or goes."""
        replica.inflight += 1
        try:
            result = await self._send_watched(replica, headers, body, deadline, path)
        except MeshnetError as exc:
            if exc.code == "downstream_unreachable" and exc.hop == replica.pool.url:
                self.placement.mark_down(replica, anyio.current_time())
                if deadline.remaining() > 0:
                    raise Lost() from exc
            # A timeout is not marked down here: the request's own deadline
            # may simply be short; a replica that hangs fails its probes.
            raise
        finally:
            replica.inflight -= 1
        if result is None:  # cancelled: its probes say it hangs
            raise Lost(hung=True)
        if _own_error(result, "stage_mismatch"):
            # It came back as another stage between two probes: take it out
            # now (if its identity says so) and fail the session over.
            replica.identity_read = False
            await self.monitor.read_identity(replica)
            if replica.mismatch:
                raise Lost()
        if _own_error(result, "shutting_down") and result.status == 503:
            replica.draining = True  # its sessions move by KV (wire-2 §3.11)
            self.placement.mark_down(replica, anyio.current_time())
            raise Lost()
        return result

    async def _send_watched(
        self, replica: Replica, headers: WireHeaders, body: Body, deadline: Deadline, path: str
    ) -> Answer | None:
        """The forward's answer, or None when the replica went down first.

        Stop waiting when the replica goes down (its probes time out: it
        hangs). One already down (tried as a last resort) gets two probe
        timeouts instead."""
        went_down = replica.went_down() if replica.up else None
        result: list[Answer] = []
        failure: list[MeshnetError] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                if went_down is not None:
                    await went_down.wait()
                else:
                    await anyio.sleep(2 * self.probe_timeout)
                tg.cancel_scope.cancel()  # it hangs: do not wait for it

            async def send() -> None:
                try:
                    result.append(await replica.pool.forward(headers, body, deadline, path))
                except MeshnetError as exc:
                    failure.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            tg.start_soon(send)
        if failure:
            raise failure[0]
        return result[0] if result else None

    def keep(self, session: str, headers: WireHeaders, body: Body, response: Answer) -> None:
        """An answered chunk joins the session's history (the material of a replay)."""
        if not isinstance(response, ErrorResponse):
            self.history.add(session, headers, body, anyio.current_time())

    def lock(self, session: str) -> anyio.Lock:
        return self.locks.setdefault(session, anyio.Lock())

    def forget(self, session: str) -> None:
        lock = self.locks.get(session)
        if lock is not None and not lock.locked():
            del self.locks[session]

    # ------------------------------------------------------------ moving a session

    async def recover(
        self,
        session: str,
        headers: WireHeaders,
        body: Body,
        deadline: Deadline,
        failed: Replica | None,
        *,
        alive: bool,
    ) -> Answer:
        """Move ``session`` to a replica that has (or is given) its state, then
        send the chunk there; again, elsewhere, if that replica fails too.

        ``alive``: ``failed`` did not fail a forward (it lost the session, or
        only its probes fail): it may be tried again when nothing else is left."""
        excluded: list[Replica] = [] if failed is None or alive else [failed]
        for _ in range(len(self.placement.replicas) + 1):
            async with self.lock(session):
                target, answered = await self._relocate(
                    session, headers, body, deadline, failed, excluded, alive
                )
            if answered is not None:  # discovery: the chunk already went there
                return answered
            # Sent outside the session's lock: with several chunks in flight,
            # this one may wait at the replica for an earlier one, whose own
            # recovery must not wait for us.
            try:
                response = await self.attempt(target, headers, body, deadline)
            except Lost as lost:
                failed, alive = target, lost.hung
                if not lost.hung:
                    excluded.append(target)
                continue
            if lost_session(response):
                failed, alive = target, True
                continue
            self.keep(session, headers, body, response)
            return response
        raise self.none_left(session)

    async def _relocate(
        self,
        session: str,
        headers: WireHeaders,
        body: Body,
        deadline: Deadline,
        failed: Replica | None,
        excluded: list[Replica],
        alive: bool = False,
    ) -> tuple[Replica, Answer | None]:
        """Under the session's lock: the replica to send to, its state moved
        by its KV (a draining replica still answers) or rebuilt by a replay."""
        moved = self.placement.moved(session, failed)
        if moved is not None:
            return moved, None  # another chunk of the session moved it meanwhile
        if self.history.evicted(session):
            raise self.unrecoverable(session, "its history here was evicted (memory budget)")
        if session not in self.placement.sticky and failed is None:
            found = await self._discover(session, headers, body, deadline, excluded)
            if found is not None:
                return found
        # A replica that failed a forward may still be there to export: it
        # drains (503 shutting_down, or it closed our idle connection), or
        # it restarts. One that only hangs is not asked (the ask would hang).
        if failed is not None and headers.position and (failed.draining or not alive):
            moved = await self._hand_off(session, headers, deadline, failed, excluded)
            if moved is not None:
                return moved, None
        before = self.history.order_of(session, headers)
        past = self.history.chunks(session, before=before)
        if not past and not headers.starts_session:
            raise self.unrecoverable(session, "no history of it is kept at this hop")
        # Ranked again after each loss: with no healthy replica left, the
        # down ones become candidates (see ``Placement.ranked``).
        while candidates := self.placement.ranked(exclude=excluded):
            candidate = candidates[0]
            try:
                await self._replay_up_to(candidate, session, past, before, deadline)
            except Lost:
                excluded.append(candidate)
                continue
            self.failovers += 1
            self.placement.sticky[session] = candidate
            log.warning(
                "session %s: failed over from %s to %s (%d chunks replayed)",
                session,
                failed.url if failed else "?",
                candidate.url,
                len(past),
            )
            return candidate, None
        raise self.none_left(session)

    async def _hand_off(
        self,
        session: str,
        headers: WireHeaders,
        deadline: Deadline,
        failed: Replica,
        excluded: list[Replica],
    ) -> Replica | None:
        """The session's KV from the draining ``failed`` to the best ranked
        healthy replica, no replay (wire-2 §3.11); None when it did not move."""
        candidates = self.placement.ranked(exclude=[*excluded, failed], fallback=False)
        if not candidates:
            return None
        target = candidates[0]
        # Asking one that is gone costs at most a probe's time, then it replays.
        ask = Deadline(min(deadline.at, anyio.current_time() + self.probe_timeout))
        if not await hand_off(
            failed, target, session, headers.session_key, deadline, self.handoffs, ask=ask
        ):
            return None
        self.placement.sticky[session] = target
        return target

    async def _discover(
        self,
        session: str,
        headers: WireHeaders,
        body: Body,
        deadline: Deadline,
        excluded: list[Replica],
    ) -> tuple[Replica, Answer] | None:
        """Rebuilt by a replay ourselves, or never routed here: one of the
        replicas may hold the session already. Ask, cheapest first.

        Ranked again after each loss, as a replay's candidates are: when the
        only replica thought healthy turns out dead, the ones marked down
        (perhaps only because they started after this node) are asked too,
        so a live holder is found instead of being rebuilt by a replay."""
        asked: list[Replica] = []
        while candidates := self.placement.ranked(exclude=[*excluded, *asked]):
            candidate = candidates[0]
            try:
                response = await self.attempt(candidate, headers, body, deadline)
            except Lost:
                excluded.append(candidate)
                continue
            if lost_session(response):
                asked.append(candidate)
                continue
            self.placement.sticky[session] = candidate
            self.keep(session, headers, body, response)
            return candidate, response
        return None

    async def _replay_up_to(
        self,
        replica: Replica,
        session: str,
        past: Sequence[SentChunk],
        before: Order,
        deadline: Deadline,
    ) -> None:
        """Replay ``past``, then the chunks answered meanwhile below ``before``.

        With chunks in flight, the replica the session leaves may answer an
        earlier one while this replay runs (a draining node finishes what it
        has): its answer joins the history after ``past`` was read, and
        before the move is made, so no catch-up sends it. Read the history
        again until nothing new came: the move is made (with no await
        between) only once the new replica has every chunk answered before
        this one, or later chunks would wait there for it."""
        sent: set[tuple[int, int, int]] = set()
        while pending := [c for c in past if c.key not in sent]:
            await self.replay(replica, session, pending, deadline)
            sent.update(c.key for c in pending)
            past = self.history.chunks(session, before=before)

    async def replay(
        self, replica: Replica, session: str, past: Sequence[SentChunk], deadline: Deadline
    ) -> None:
        """Send ``past`` to ``replica`` as replays, in order."""
        for chunk in past:
            response = await self.attempt(replica, chunk.headers, chunk.body, deadline, REPLAY_PATH)
            if _stale_copy(response, chunk.headers):
                # The replica still holds an older copy of the session (it came
                # back after the failover away from it): a replay never rewrites
                # a live session (wire-2 §3.9), so end it there — there only:
                # the stages below keep theirs (?replay=1) — then once more.
                with contextlib.suppress(MeshnetError):  # the replay again says how it went
                    await replica.pool.request(
                        "DELETE",
                        f"/sessions/{session}?replay=1",
                        deadline,
                        key_headers(chunk.headers.session_key),
                    )
                response = await self.attempt(
                    replica, chunk.headers, chunk.body, deadline, REPLAY_PATH
                )
            if isinstance(response, ErrorResponse):
                inner = response.error
                raise DownstreamError(
                    f"stage {self.stage}: session {session}: replay to {replica.url} failed: "
                    f"{response.status} {inner.get('code')}: {inner.get('message')}",
                    code=ErrorCode.REPLAY_FAILED,
                    hop=replica.url,
                )
            self.replayed_chunks += 1
            self.replayed_tokens += chunk.headers.tokens
            self.replayed_bytes += memoryview(chunk.body).nbytes

    async def catch_up(
        self, replica: Replica, session: str, headers: WireHeaders, body: Body, deadline: Deadline
    ) -> None:
        """Replay one chunk the replica the session left answered after the
        move: the new one must get it too, or later chunks wait for it."""
        chunk = SentChunk(headers.replace(deadline_ms=None), body)
        async with self.lock(session):
            try:
                await self.replay(replica, session, [chunk], deadline)
            except (Lost, MeshnetError) as exc:  # its next chunk fails over again
                log.warning("session %s: catching %s up failed: %r", session, replica.url, exc)

    # ------------------------------------------------------------ errors

    def none_left(self, session: str) -> DownstreamError:
        down = ", ".join(r.url for r in self.placement.replicas if not r.up) or "none"
        return DownstreamError(
            f"stage {self.stage}: no replica left for session {session} (down: {down})",
            code=ErrorCode.NO_REPLICA,
            hop=self.stage,
        )

    def unrecoverable(self, session: str, why: str) -> DownstreamError:
        return DownstreamError(
            f"stage {self.stage}: session {session} cannot be recovered: {why}",
            code=ErrorCode.SESSION_LOST,
            hop=self.stage,
        )
