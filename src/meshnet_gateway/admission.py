"""Admission control: how many generations the gateway takes on, before any work.

Issue 19: with nothing bounding what the gateway admits, a burst of long
prompts reached the nodes all at once and most failed *during* the work
(409 ``chunk_wait_timeout``, 504) after costing every node compute. Here a
request is either admitted, queued, or refused at once with a status and a
``Retry-After`` — before a single chunk goes down the chain.

Two budgets, because decode and prefill cost different things:

* ``max_running`` generations at once (a decode stream is one small chunk
  per token: many can share the chain; the throughput bench runs 64);
* ``max_prefill_tokens``: prompt tokens of admitted generations whose
  prefill has not finished. This is what floods the nodes' queues: 12
  prompts of 1,200 tokens are 14,400 tokens of compute queued at the entry
  at once. A generation leaves this budget when its prompt's last chunk is
  answered (``Ticket.prefilled``). A prompt larger than the whole budget is
  admitted alone when nothing else is prefilling, so no prompt the context
  allows is refused for its size, only made to wait its turn.

Waiting requests form one strict FIFO queue (``max_queued`` long): only
the head may be admitted, so a stream of small prompts cannot overtake a
large one forever. Beyond the queue's length: ``AdmissionRefused``
``queue_full`` (the API answers 429); waiting longer than the queue
timeout: ``queue_timeout`` (503). Both carry a ``Retry-After`` estimate:
the recent queue wait.

The bookkeeping is synchronous (``request``, ``Ticket.prefilled``,
``Ticket.release``, ``cancel``) so it can be tested as plain logic; only
``admit`` awaits. Everything runs on the event loop thread, so there is no
lock. Every way out of ``admit`` — admitted, refused, timed out, cancelled
because the client left — leaves the counts exact (no leaked budget).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio

__all__ = ["Admission", "AdmissionRefused", "Ticket"]

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
class Ticket:
    """One admitted generation's hold on the budgets; release it exactly once
    (further calls are no-ops, so every ``finally`` may call it)."""

    tokens: int
    _admission: Admission = field(repr=False)
    prefilling: bool = True
    released: bool = False

    def prefilled(self) -> None:
        """Its prompt is through the chain: its tokens leave the prefill budget."""
        if self.prefilling and not self.released:
            self.prefilling = False
            self._admission._end_prefill(self)
            self._admission._pump()

    def release(self) -> None:
        """The generation ended (any way): both budgets get its share back."""
        if self.released:
            return
        if self.prefilling:
            self.prefilling = False
            self._admission._end_prefill(self)
        self.released = True
        self._admission.running -= 1
        self._admission._pump()


@dataclass(eq=False, slots=True)
class _Waiter:
    tokens: int
    since: float
    ticket: Ticket | None = None
    wake: Callable[[], None] | None = None


class Admission:
    """The gateway's admission budgets and its FIFO wait queue."""

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
        self.prefill_tokens = 0  # their prompt tokens, while prefilling
        self.prefilling = 0  # how many are prefilling (a prompt may count 0 tokens)
        self._queue: deque[_Waiter] = deque()
        self._wait_estimate = float(_RETRY_AFTER_MIN)

    @property
    def queued(self) -> int:
        return len(self._queue)

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
            "max_queued": self.max_queued,
            "queued": self.queued,
            "queue_timeout_s": self.queue_timeout,
        }

    # ------------------------------------------------------------ logic

    def fits(self, tokens: int) -> bool:
        """Whether a generation of ``tokens`` prompt tokens may start now
        (ignoring the queue: ``request`` keeps strict FIFO)."""
        if self.running >= self.max_running:
            return False
        # Oversize alone: a prompt over the whole budget waits until nothing
        # else prefills, then goes, so it is never starved for its size.
        return self.prefilling == 0 or self.prefill_tokens + tokens <= self.max_prefill_tokens

    def request(self, tokens: int) -> Ticket | _Waiter:
        """A ticket now, or a place in the queue; ``AdmissionRefused`` if it is full."""
        if not self._queue and self.fits(tokens):
            return self._grant(tokens)
        if len(self._queue) >= self.max_queued:
            self._refused("queue_full")
            raise AdmissionRefused(
                "queue_full",
                f"the gateway is at capacity ({self.running} generations running, "
                f"{self.queued} waiting, --max-queued {self.max_queued}); retry later",
                self.retry_after(),
            )
        waiter = _Waiter(tokens, self.clock())
        self._queue.append(waiter)
        return waiter

    def cancel(self, waiter: _Waiter) -> None:
        """The waiter gave up (timeout, client gone): out of the queue, or, if
        it was admitted meanwhile, its ticket back."""
        if waiter.ticket is not None:
            waiter.ticket.release()
            return
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        # It may have been the head that did not fit: the next one may.
        self._pump()

    def _grant(self, tokens: int) -> Ticket:
        self.running += 1
        self.prefilling += 1
        self.prefill_tokens += tokens
        return Ticket(tokens, self)

    def _end_prefill(self, ticket: Ticket) -> None:
        self.prefilling -= 1
        self.prefill_tokens -= ticket.tokens

    def _pump(self) -> None:
        """Admit from the head while it fits (strict FIFO: never past the head)."""
        while self._queue and self.fits(self._queue[0].tokens):
            waiter = self._queue.popleft()
            waiter.ticket = self._grant(waiter.tokens)
            self._observe_wait(self.clock() - waiter.since)
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

    async def admit(self, tokens: int, *, timeout: float | None = None) -> Ticket:
        """Wait (FIFO) until a generation of ``tokens`` prompt tokens may start.

        ``timeout``: the caller's own bound, if shorter than the queue timeout.
        Raises ``AdmissionRefused``; when cancelled (the client left), it
        leaves the queue, or gives back a ticket granted in the meantime.
        """
        granted = self.request(tokens)
        if isinstance(granted, Ticket):
            return granted
        waiter = granted
        event = anyio.Event()
        waiter.wake = event.set
        limit = self.queue_timeout if timeout is None else min(timeout, self.queue_timeout)
        try:
            with anyio.move_on_after(limit):
                await event.wait()
        except BaseException:
            self.cancel(waiter)
            raise
        if waiter.ticket is not None:
            return waiter.ticket  # admitted, even if the timer ran out in the same tick
        waited = self.clock() - waiter.since
        self.cancel(waiter)
        # A timed-out wait is a lower bound of the real one: it counts too.
        self._observe_wait(waited)
        self._refused("queue_timeout")
        raise AdmissionRefused(
            "queue_timeout",
            f"waited {waited:.1f} s for capacity (--queue-timeout {self.queue_timeout:g}); "
            "the gateway is overloaded, retry later",
            self.retry_after(),
        )
