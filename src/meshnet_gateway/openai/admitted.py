"""The OpenAI surface's side of the gateway's admission control
(``meshnet_gateway.admission``): a generation admitted, fairly by its
client, and its prompt's pieces granted prefill budget one by one
(issue 37); each refusal in the shape the client is answered with."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from meshnet_proto import MeshnetError

from ..admission import Admission, AdmissionRefused, Ticket
from .errors import OpenAIError
from .pieces import PrefillGate

__all__ = ["admission_gate", "admit"]


async def admit(admission: Admission | None, tokens: int, client: str | None) -> Ticket | None:
    """Wait for admission (None: every request starts at once); a refusal
    as the OpenAI error it is answered with: 429 ``queue_full`` or 503
    ``queue_timeout``, both with ``Retry-After``."""
    if admission is None:
        return None
    try:
        return await admission.admit(tokens, client=client)
    except AdmissionRefused as exc:
        full = exc.reason == "queue_full"
        raise OpenAIError(
            exc.message,
            status=429 if full else 503,
            type="rate_limit_error" if full else "server_error",
            code=exc.reason,
            retry_after=exc.retry_after,
        ) from None


def admission_gate(ticket: Ticket) -> PrefillGate:
    """``ticket``'s grants, one per piece of the prefill; a refusal (a piece
    that waited past the queue timeout) raised as the chain failure that ends
    the generation: a 503 ``queue_timeout`` answer, or a stream's error event
    (its 200 head is out by then)."""

    @asynccontextmanager
    async def gate(tokens: int) -> AsyncIterator[None]:
        try:
            async with ticket.prefilling(tokens):
                yield  # the piece's run: it asks admission nothing
        except AdmissionRefused as exc:
            raise MeshnetError(
                exc.message, code="queue_timeout", status=503, retry_after=exc.retry_after
            ) from None

    return gate
