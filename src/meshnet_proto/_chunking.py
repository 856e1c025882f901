"""Splitting a sequence into chunks along its token axis, and joining them back.

The gateway cuts a client's whole sequence into runs of chunks (wire-2 §1, §3)
and reassembles the last node's chunk outputs. Cutting never copies: each
chunk is a numpy view of the client's tensor, so a long prefill costs no
memory to split. Joining copies once, into the tensor the client gets.

Everything :class:`ChunkAssembler` is fed comes from the downstream chain
(the last node's answers), and the gateway's client did nothing wrong when
those disagree, so its errors are ``ProtocolError`` with status **502**
(bad gateway: "an invalid response from the upstream server"), codes
``chunk_missing``, ``chunk_duplicate``, ``chunk_mismatch`` and
``bad_chunk_index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ._errors import ErrorCode, ProtocolError

__all__ = ["Chunk", "ChunkAssembler", "plan_chunks", "token_axis"]

# See the module docstring: a disagreement among the downstream's answers is
# the downstream's fault, not the client's.
ASSEMBLY_ERROR_STATUS = 502


def token_axis(shape: Sequence[int]) -> int:
    """The axis that counts tokens (wire-2 §2): 1, or 0 for a rank-1 tensor."""
    if len(shape) == 0:
        raise ValueError("a scalar has no token axis: wire tensors have 1 to 8 dimensions")
    return 0 if len(shape) == 1 else 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """One chunk of a planned run.

    ``position`` is the offset of the chunk's first token within the planned
    array (add the session's base position before sending it); ``view`` is a
    numpy view of those tokens, sharing memory with the array.
    """

    index: int
    total: int
    position: int
    tokens: int
    view: np.ndarray


def plan_chunks(array: np.ndarray, chunk_tokens: int) -> list[Chunk]:
    """Cut ``array`` along its token axis into chunks of at most ``chunk_tokens``.

    Every chunk but the last has exactly ``chunk_tokens`` tokens. The views
    are basic slices: no element is copied (for rank ≥ 2 with a leading
    dimension > 1 they are strided, and the codec makes them contiguous when
    it encodes them).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    axis = token_axis(array.shape)
    tokens = array.shape[axis]
    if tokens < 1:
        raise ValueError(f"cannot chunk a tensor with no tokens (shape {array.shape})")
    total = -(-tokens // chunk_tokens)
    lead = (slice(None),) * axis
    chunks = []
    for index in range(total):
        start = index * chunk_tokens
        stop = min(start + chunk_tokens, tokens)
        chunks.append(
            Chunk(
                index=index,
                total=total,
                position=start,
                tokens=stop - start,
                view=array[(*lead, slice(start, stop))],
            )
        )
    return chunks


def _assembly_error(message: str, code: ErrorCode) -> ProtocolError:
    return ProtocolError(message, code=code, status=ASSEMBLY_ERROR_STATUS)


class ChunkAssembler:
    """Collects the ``total`` chunk outputs of one run and joins them in index order.

    Chunks may be added in any order (with ``--inflight`` > 1 they complete
    out of order). Every chunk must have the first one's dtype, rank and
    every dimension except the token axis. Arrays are kept as given (no copy)
    until :meth:`result` concatenates them once.
    """

    __slots__ = ("_parts", "_reference", "_total")

    def __init__(self, total: int) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be an int >= 1, got {total!r}")
        self._total = total
        self._parts: dict[int, np.ndarray] = {}
        # (dtype, shape with the token axis blanked) of the first chunk added.
        self._reference: tuple[np.dtype, tuple[int | None, ...]] | None = None

    @property
    def total(self) -> int:
        return self._total

    @property
    def received(self) -> int:
        """How many distinct chunks have been added."""
        return len(self._parts)

    @property
    def complete(self) -> bool:
        return len(self._parts) == self._total

    def missing(self) -> list[int]:
        """Indices not added yet, ascending."""
        return [index for index in range(self._total) if index not in self._parts]

    def add(self, index: int, array: np.ndarray) -> None:
        """Record chunk ``index``'s output."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self._total:
            raise _assembly_error(
                f"chunk index {index!r} is outside 0..{self._total - 1}", ErrorCode.BAD_CHUNK_INDEX
            )
        if index in self._parts:
            raise _assembly_error(f"chunk {index} was already received", ErrorCode.CHUNK_DUPLICATE)
        if array.ndim == 0:
            raise _assembly_error(
                f"chunk {index} is a scalar, not a tensor", ErrorCode.CHUNK_MISMATCH
            )
        axis = token_axis(array.shape)
        signature = (
            array.dtype,
            tuple(None if dim == axis else size for dim, size in enumerate(array.shape)),
        )
        if self._reference is None:
            self._reference = signature
        elif signature != self._reference:
            raise _assembly_error(
                f"chunk {index} is {array.dtype} of shape {array.shape}, which does not "
                f"match the run's {self._describe(self._reference)} (only the token "
                "axis may differ)",
                ErrorCode.CHUNK_MISMATCH,
            )
        self._parts[index] = array

    @staticmethod
    def _describe(signature: tuple[np.dtype, tuple[int | None, ...]]) -> str:
        dtype, shape = signature
        dims = ",".join("*" if size is None else str(size) for size in shape)
        return f"{dtype} of shape ({dims})"

    def result(self) -> np.ndarray:
        """All chunks joined along the token axis (one copy, a new writable array)."""
        if not self.complete:
            missing = self.missing()
            raise _assembly_error(
                f"{len(missing)} of {self._total} chunks missing (first: {missing[0]})",
                ErrorCode.CHUNK_MISSING,
            )
        parts = [self._parts[index] for index in range(self._total)]
        return np.concatenate(parts, axis=token_axis(parts[0].shape))
