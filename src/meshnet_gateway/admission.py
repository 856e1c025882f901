"""Admission control: how many generations the gateway takes on, and how much
prefill it has in flight on the chain, decided before the work.

Issue 19: with nothing bounding what the gateway admits, a burst of long
prompts reached the nodes all at once and most failed *during* the work
(409 ``chunk_wait_timeout``, 504) after costing every node compute. Here a
request is either admitted, queued, or refused at once with a status and a
``Retry-After`` — before a single chunk goes down the chain.

Two budgets, because decode and prefill cost different things:

* ``max_running`` generations at once (a decode stream is one small chunk
  per token: many can share the chain; the throughput bench runs 64). A
  generation takes a ``Ticket`` for its whole life (``admit``).
* ``max_prefill_tokens``: prompt tokens in flight on the chain at once.
  This is what floods the nodes' queues: 12 prompts of 1,200 tokens are
  14,400 tokens of compute queued at the entry at once. A prefill is not
  granted this budget whole (issue 37: one prompt over the budget used to
  be admitted alone and held every other admission for its whole prefill —
  a 5-token prompt of another client waited 21-36 s for its first token).
  It takes a ``Grant`` for each piece it sends (a window of chunks,
  ``Ticket.prefill``), given back as that piece is answered; so other
  requests' pieces are granted between its pieces, and a short prompt
  waits for at most the pieces in flight, not for a whole long prefill. A
  piece larger than the whole budget is granted alone when nothing else is
  in flight: never refused for its size, only made to wait its turn.

Both wait queues are fair across clients (``FairQueue``: round-robin
between clients, FIFO within one), and strict at their head: the next
waiter in that order must fit before anyone behind it is served, so a
stream of small pieces cannot overtake a large one forever. The start queue
is ``max_queued`` long: beyond it, ``AdmissionRefused`` ``queue_full`` (the
API answers 429); waiting longer than the queue timeout, for a start or for
a piece: ``queue_timeout`` (503). Both carry a ``Retry-After`` estimate: the
recent wait to start. The prefill queue needs no bound of its own: each
running generation waits for at most one piece at a time.

The bookkeeping is synchronous (``request``, ``request_prefill``,
``Ticket.release``, ``Grant.release``, ``cancel``) so it can be tested as
plain logic; only ``admit`` and ``Ticket.prefill`` await. Everything runs on
the event loop thread, so there is no lock. Every way out of a wait —
granted, refused, timed out, cancelled because the client left — leaves
the counts exact (no leaked budget).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

import anyio

from .fair_queue import FairQueue

__all__ = ["Admission", "AdmissionRefused", "Grant", "Ticket"]

RefusalReason = Literal["queue_full", "queue_timeout"]

# Retry-After is an estimate of the queue wait, smoothed over recent waits;
# this much weight on the newest. Kept within [1, 60] s: a client is told
# to come back at least a second later, and never told to give up for long.
_WAIT_SMOOTHING = 0.2
_RETRY_AFTER_MIN = 1
_RETRY_AFTER_MAX = 60


class AdmissionRefused(Exception):
    """Not admitted: the queue is full, or the wait in it ran out."""

    def __init__(self, reason: RefusalReason, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False, slots=True)
class Grant:
    """A piece of prefill's hold on the prefill budget; release it once the
    piece is answered (further calls are no-ops)."""

    tokens: int
    _admission: Admission = field(repr=False)
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._admission._end_grant(self)
        self._admission._pump()


@dataclass(eq=False, slots=True)
class Ticket:
    """One admitted generation's place in the running budget; release it
    exactly once (further calls are no-ops, so every ``finally`` may call it).

    ``tokens``: its prompt's length, as asked; ``client``: whom the fair
    queues count its pieces of prefill for."""

    tokens: int
    _admission: Admission = field(repr=False)
    client: str | None = None
    released: bool = False

    def release(self) -> None:
        """The generation ended (any way): its running place back."""
        if self.released:
            return
        self.released = True
        self._admission.running -= 1
        self._admission._pump()

    async def prefill(self, tokens: int, *, timeout: float | None = None) -> Grant:
        """Wait (fairly among clients) until ``tokens`` more prompt tokens may
        go down the chain; ``AdmissionRefused`` after the queue timeout."""
        return await self._admission.prefill(tokens, client=self.client, timeout=timeout)

    @asynccontextmanager
    async def prefilling(self, tokens: int, *, timeout: float | None = None) -> AsyncIterator[None]:
        """``prefill``'s grant held for the block (a piece on the chain), then given back."""
        grant = await self.prefill(tokens, timeout=timeout)
        try:
            yield
        finally:
            grant.release()


@dataclass(eq=False, slots=True)
class _Waiter:
    tokens: int
    since: float
    client: str | None
    prefill: bool  # waits for a Grant (else for a Ticket)
    granted: Ticket | Grant | None = None
    wake: Callable[[], None] | None = None

    @property
    def ticket(self) -> Ticket | None:
        return self.granted if isinstance(self.granted, Ticket) else None

    @property
    def grant(self) -> Grant | None:
        return self.granted if isinstance(self.granted, Grant) else None


class Admission:
    """The gateway's admission budgets and their fair wait queues."""

    def __init__(
        self,
        *,
        max_running: int,
        max_prefill_tokens: int,
        max_queued: int,
        queue_timeout: float,
        clock: Callable[[], float] = anyio.current_time,
        on_refused: Callable[[RefusalReason], None] | None = None,
        on_waited: Callable[[float], None] | None = None,
    ) -> None:
        if max_running < 1 or max_prefill_tokens < 1 or max_queued < 0 or queue_timeout <= 0:
            raise ValueError("admission budgets must be positive (the queue may be 0 long)")
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.clock = clock
        self.on_refused = on_refused
        self.on_waited = on_waited
        self.running = 0  # admitted tickets not yet released
        self.prefill_tokens = 0  # tokens of the grants not yet released
        self.prefill_grants = 0  # how many (a piece may count 0 tokens)
        self._queue: FairQueue[_Waiter] = FairQueue()  # waiting to start
        self._prefill_queue: FairQueue[_Waiter] = FairQueue()  # pieces waiting for budget
        self._wait_estimate = float(_RETRY_AFTER_MIN)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def prefill_waiting(self) -> int:
        return len(self._prefill_queue)

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the smoothed recent queue wait."""
        return max(_RETRY_AFTER_MIN, min(_RETRY_AFTER_MAX, math.ceil(self._wait_estimate)))

    def describe(self) -> dict[str, int | float]:
        """Budgets and their use, for ``/info``."""
        return {
            "max_running": self.max_running,
            "running": self.running,
            "max_prefill_tokens": self.max_prefill_tokens,
            "prefill_tokens": self.prefill_tokens,
            "prefill_waiting": self.prefill_waiting,
            "max_queued": self.max_queued,
            "queued": self.queued,
            "queued_clients": self._queue.clients,
            "queue_timeout_s": self.queue_timeout,
        }

    # ------------------------------------------------------------ logic

    def fits(self, tokens: int) -> bool:
        """Whether a piece of ``tokens`` prompt tokens may go now (ignoring
        the queue: ``request_prefill`` keeps its order). Oversize alone: a
        piece over the whole budget waits until nothing else is in flight,
        then goes, so it is never starved for its size."""
        return self.prefill_grants == 0 or self.prefill_tokens + tokens <= self.max_prefill_tokens

    def request(self, tokens: int, client: str | None = None) -> Ticket | _Waiter:
        """A ticket now, or a place in the queue; ``AdmissionRefused`` if it is full."""
        if not self._queue and self.running < self.max_running:
            return self._ticket(tokens, client)
        mine = self._queue.waiting(client)
        full = len(self._queue) >= self.max_queued
        # Half the queue per client, as half the sessions (wire-2 §3.9): one
        # client's burst cannot take every other client's place.
        if full or mine >= max(1, self.max_queued // 2):
            self._refused("queue_full")
            why = (
                f"the gateway is at capacity ({self.running} generations running, "
                f"{self.queued} waiting, --max-queued {self.max_queued})"
                if full
                else f"this client has {mine} requests waiting already (half of --max-queued "
                f"{self.max_queued})"
            )
            raise AdmissionRefused("queue_full", f"{why}; retry later", self.retry_after())
        waiter = _Waiter(tokens, self.clock(), client, prefill=False)
        self._queue.push(client, waiter)
        return waiter

    def request_prefill(self, tokens: int, client: str | None = None) -> Grant | _Waiter:
        """A grant for a piece of prefill now, or a place in the prefill queue."""
        if not self._prefill_queue and self.fits(tokens):
            return self._grant(tokens)
        waiter = _Waiter(tokens, self.clock(), client, prefill=True)
        self._prefill_queue.push(client, waiter)
        return waiter

    def cancel(self, waiter: _Waiter) -> None:
        """The waiter gave up (timeout, client gone): out of its queue, or, if
        it was served meanwhile, what it was granted back."""
        if waiter.granted is not None:
            waiter.granted.release()
            return
        queue = self._prefill_queue if waiter.prefill else self._queue
        # It may have been the head that did not fit: the next one may.
        if queue.remove(waiter.client, waiter):
            self._pump()

    def _ticket(self, tokens: int, client: str | None) -> Ticket:
        self.running += 1
        return Ticket(tokens, self, client)

    def _grant(self, tokens: int) -> Grant:
        self.prefill_grants += 1
        self.prefill_tokens += tokens
        return Grant(tokens, self)

    def _end_grant(self, grant: Grant) -> None:
        self.prefill_grants -= 1
        self.prefill_tokens -= grant.tokens

    def _pump(self) -> None:
        """Serve each queue in its fair order while its next waiter fits
        (strict: never past that waiter)."""
        while self._queue and self.running < self.max_running:
            waiter = self._queue.pop()
            waiter.granted = self._ticket(waiter.tokens, waiter.client)
            self._observe_wait(self.clock() - waiter.since)
            if waiter.wake is not None:
                waiter.wake()
        while self._prefill_queue and self.fits(self._prefill_queue.head().tokens):
            waiter = self._prefill_queue.pop()
            waiter.granted = self._grant(waiter.tokens)
            if waiter.wake is not None:
                waiter.wake()

    def _observe_wait(self, seconds: float) -> None:
        self._wait_estimate += _WAIT_SMOOTHING * (seconds - self._wait_estimate)
        if self.on_waited is not None:
            self.on_waited(seconds)

    def _refused(self, reason: RefusalReason) -> None:
        if self.on_refused is not None:
            self.on_refused(reason)

    # ------------------------------------------------------------ waiting

    async def admit(
        self, tokens: int, *, timeout: float | None = None, client: str | None = None
    ) -> Ticket:
        """Wait (fairly among clients) until a generation of ``tokens`` prompt
        tokens may start.

        ``timeout``: the caller's own bound, if shorter than the queue timeout.
        Raises ``AdmissionRefused``; when cancelled (the client left), it
        leaves the queue, or gives back a ticket granted in the meantime.
        """
        granted = self.request(tokens, client)
        if isinstance(granted, Ticket):
            return granted
        ticket = await self._wait(granted, timeout)
        assert isinstance(ticket, Ticket)
        return ticket

    async def prefill(
        self, tokens: int, *, client: str | None = None, timeout: float | None = None
    ) -> Grant:
        """Wait (fairly among clients) for a grant of ``tokens`` prefill tokens;
        as ``admit`` for timeouts and cancellation."""
        granted = self.request_prefill(tokens, client)
        if isinstance(granted, Grant):
            return granted
        grant = await self._wait(granted, timeout)
        assert isinstance(grant, Grant)
        return grant

    async def _wait(self, waiter: _Waiter, timeout: float | None) -> Ticket | Grant:
        event = anyio.Event()
        waiter.wake = event.set
        limit = self.queue_timeout if timeout is None else min(timeout, self.queue_timeout)
        try:
            with anyio.move_on_after(limit):
                await event.wait()
        except BaseException:
            self.cancel(waiter)
            raise
        if waiter.granted is not None:
            return waiter.granted  # served, even if the timer ran out in the same tick
        waited = self.clock() - waiter.since
        self.cancel(waiter)
        if not waiter.prefill:
            # A timed-out wait is a lower bound of the real one: it counts too.
            self._observe_wait(waited)
        self._refused("queue_timeout")
        what = "prefill budget" if waiter.prefill else "capacity"
        raise AdmissionRefused(
            "queue_timeout",
            f"waited {waited:.1f} s for {what} (--queue-timeout {self.queue_timeout:g}); "
            "the gateway is overloaded, retry later",
            self.retry_after(),
        )
