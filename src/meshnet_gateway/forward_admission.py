"""``/forward`` through the gateway's admission, as ``/v1`` is (issue 37).

A wire-2 client's run takes a running place and its prompt's prefill
budget like a generation, in the same queue fair across clients: so a client
that opens hundreds of one-token sessions through ``/forward`` waits its
turn (or is refused) instead of pinning the nodes' KV and sessions past
every ``/v1`` client. A refusal is wire 2's: 503 ``gateway_busy`` with
``Retry-After``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from meshnet_proto import CapacityError, ErrorCode
from meshnet_runtime.deadlines import Deadline

from .admission import Admission, AdmissionRefused

__all__ = ["admitted"]


@asynccontextmanager
async def admitted(
    admission: Admission, tokens: int, client: str | None, deadline: Deadline
) -> AsyncIterator[None]:
    """Hold a running place and ``tokens`` of prefill budget for the block;
    wait at most until ``deadline`` (or the queue's timeout) for them."""
    try:
        ticket = await admission.admit(tokens, client=client, timeout=deadline.remaining())
        try:
            async with ticket.prefilling(tokens, timeout=deadline.remaining()):
                yield  # the run down the chain: it asks admission nothing
        finally:
            ticket.release()
    except AdmissionRefused as exc:
        raise CapacityError(
            f"the gateway's admission: {exc.message}",
            code=ErrorCode.GATEWAY_BUSY,
            retry_after=exc.retry_after,
        ) from None
