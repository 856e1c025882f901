"""A byte budget for the tensors a server holds for requests in flight.

Per-request limits (``max_tensor_bytes``) stop one peer from asking for too
much at once; they do not stop many peers, each asking for a legal amount, from
adding up to more memory than the machine has: 256 connections x 512 MiB is
128 GiB, and an 8 KiB zstd body may legally decode to 512 MiB. A server
reserves what a request will hold *before* reading its body, from its head
alone, and returns it when the answer is written. A reservation that does not
fit is a 503 with ``Retry-After`` (load, not a fault of the request), which
the sender retries.
"""

from __future__ import annotations

from ._codec import body_bound
from ._errors import CapacityError, ErrorCode
from ._headers import WireHeaders

__all__ = ["ByteBudget", "Reservation", "request_cost"]


def request_cost(headers: WireHeaders, *, relaying: bool = False) -> int:
    """Bytes a request with ``headers`` makes its server hold at most.

    An identity body *is* the tensor (decoding is a zero-copy view); a zstd
    body is held beside the tensor it decompresses to, up to its bound. A
    node that relays (has a ``--next``) holds two more tensors of about that
    size while the request is in flight: its stage output, kept for a
    reforward until the answer is stored, and the downstream's answer it
    relays.
    """
    cost = (
        headers.nbytes if headers.encoding == "identity" else headers.nbytes + body_bound(headers)
    )
    return cost + 2 * headers.nbytes if relaying else cost


class Reservation:
    """Bytes taken from a :class:`ByteBudget`; ``release()`` is idempotent."""

    __slots__ = ("_budget", "nbytes")

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self._budget: ByteBudget | None = budget
        self.nbytes = nbytes

    def release(self) -> None:
        if self._budget is not None:
            self._budget._give_back(self.nbytes)
            self._budget = None

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class ByteBudget:
    """At most ``limit`` bytes reserved at once.

    One request larger than the whole budget is still let in when nothing
    else is held, so a limit set below ``max_tensor_bytes`` slows such
    requests down to one at a time instead of refusing them for ever.
    """

    def __init__(self, limit: int, *, retry_after: int = 1) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"ByteBudget limit must be a positive int, got {limit!r}")
        self.limit = limit
        self.retry_after = retry_after
        self.in_use = 0
        self.peak = 0

    def reserve(self, nbytes: int) -> Reservation:
        """Take ``nbytes`` or raise 503 ``memory_full``."""
        if nbytes < 0:
            raise ValueError("cannot reserve a negative number of bytes")
        if self.in_use and self.in_use + nbytes > self.limit:
            raise CapacityError(
                f"this server holds {self.in_use:,} bytes of tensors for requests in "
                f"flight; {nbytes:,} more would pass its budget of {self.limit:,}: retry "
                "shortly",
                code=ErrorCode.MEMORY_FULL,
                retry_after=self.retry_after,
            )
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        return Reservation(self, nbytes)

    def _give_back(self, nbytes: int) -> None:
        self.in_use -= nbytes
