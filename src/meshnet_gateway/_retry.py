"""When and how soon the gateway sends a chunk again (``--retries``, ``--retry-backoff-ms``).

A retransmission is safe because of wire-2 §3's replay rule: every chunk
carries its session, index and position, so a node that already ran the
stage on it replays its stored answer (or forwards its stored output again,
or joins the original still in flight) instead of running the stage twice.
What is *not* safe to retry is anything the chain refused on purpose: a 4xx
says the chunk itself is wrong, and sending it again cannot change that.

Retried, while the request's deadline leaves room for the wait:

* the connection to the entry node failed — refused, reset, or closed before
  the whole answer came back (502 ``downstream_unreachable`` raised by the
  pool): the request may or may not have arrived, and either is fine;
* an answer of 502, 503 or 504 from the chain: a node below could not reach
  its own downstream, was full or shutting down, or ran out of time on a hop
  that may answer now. A 503's ``Retry-After`` is honoured when it fits.

Not retried: 4xx answers, a garbled answer (``downstream_bad_response`` of
our own pool: the peer is not speaking wire 2), a spent deadline.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from meshnet_proto import ActivationResponse, ErrorResponse, MeshnetError, WireHeaders
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import Downstream

__all__ = ["MIN_ATTEMPT_SECONDS", "RETRYABLE_STATUSES", "RetryPolicy", "send_with_retries"]

log = logging.getLogger("meshnet.gateway")

RETRYABLE_STATUSES = frozenset({502, 503, 504})
# A downstream's Retry-After may ask for a long pause; a chunk never waits
# longer than this for one retry (the deadline bounds it further).
MAX_SINGLE_WAIT = 5.0
# A retry is worth sending only with this much of the deadline left after the
# wait: each hop keeps a margin (0.1 s) for its own answer, so less than this
# could only end in a 504 that says less than the failure we already have.
MIN_ATTEMPT_SECONDS = 0.25


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``retries`` extra attempts after the first; exponential backoff with jitter.

    The wait before retry ``n`` (1-based) is drawn from
    ``[b·2^(n-1)/2, b·2^(n-1)]`` with ``b = backoff`` seconds ("equal jitter":
    many sessions failing at once do not come back in lockstep), raised to a
    503's ``Retry-After`` when one was sent, and capped at ``MAX_SINGLE_WAIT``.
    """

    retries: int = 2
    backoff: float = 0.05

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.backoff < 0:
            raise ValueError(f"backoff must be >= 0, got {self.backoff}")

    def delay(self, attempt: int, retry_after: int | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1 = the first retry)."""
        base = self.backoff * 2 ** (attempt - 1)
        wait = random.uniform(base / 2, base) if base > 0 else 0.0
        if retry_after is not None:
            wait = max(wait, float(retry_after))
        return min(wait, MAX_SINGLE_WAIT)

    @staticmethod
    def retryable(failure: MeshnetError | ErrorResponse) -> bool:
        """Whether sending the identical chunk again is both safe and useful."""
        if isinstance(failure, ErrorResponse):
            return failure.status in RETRYABLE_STATUSES
        # Raised by our own pool: only a lost connection. A 504 of the pool
        # means the deadline is spent; bad_response means a peer that does
        # not speak wire 2, which a second try will not fix.
        return failure.code == "downstream_unreachable"


async def send_with_retries(
    pool: Downstream,
    headers: WireHeaders,
    body: bytes | bytearray | memoryview,
    deadline: Deadline,
    retry: RetryPolicy | None,
    *,
    as_error: Callable[[ErrorResponse], MeshnetError] | None = None,
    on_retry: Callable[[int, MeshnetError], None] | None = None,
) -> ActivationResponse:
    """Forward one chunk; send it again, identical, while ``retry`` allows.

    Returns the chain's activation answer; raises the failure as
    ``MeshnetError`` (``as_error`` turns an error answer into it; default:
    wire-2 §4's relay, ``response.to_error(hop=pool.url)``). A retry never
    outlives ``deadline``; ``on_retry(chunk index, error)`` is told of each.
    Both the wire-2 pipeline and the OpenAI generation loop send through here.
    """
    if as_error is None:

        def as_error(response: ErrorResponse) -> MeshnetError:
            return response.to_error(hop=pool.url)

    index = headers.chunk_index if headers.chunk_index is not None else 0
    attempt = 0
    first: MeshnetError | None = None  # what made us retry, if we did
    while True:
        try:
            response = await pool.forward(headers, body, deadline)
        except MeshnetError as exc:
            if retry is None or not retry.retryable(exc):
                raise
            error, retry_after = exc, None
        else:
            if not isinstance(response, ErrorResponse):
                return response
            if retry is None or not retry.retryable(response):
                raise as_error(response)
            error, retry_after = as_error(response), response.retry_after
        if first is not None and error.status == 504:
            # A retry cut short by what was left of the deadline must not
            # hide the failure that caused it (which names the hop).
            raise first
        attempt += 1
        if retry is None or attempt > retry.retries:
            raise error
        wait = retry.delay(attempt, retry_after)
        if wait + MIN_ATTEMPT_SECONDS >= deadline.remaining():
            raise error  # no time left for a useful attempt: the failure as it is
        first = first or error
        log.info(
            "session %s chunk %d: %s %s (hop %s); retry %d of %d in %.0f ms",
            headers.session,
            index,
            error.status,
            error.code,
            error.hop,
            attempt,
            retry.retries,
            wait * 1000,
        )
        if on_retry is not None:
            on_retry(index, error)
        await anyio.sleep(wait)
