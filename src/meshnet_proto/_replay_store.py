"""What answered chunks keep between requests, and the ledger of its bytes.

A node keeps each chunk's success answer (for a replay) and, after a failed
forward, its stage output (for a reforward), so that a retransmission never
runs a stage twice (wire-2 §3). Together they are held to
``max_stored_bytes``; past it the oldest go (``EVICTED``), and a
retransmission of theirs is refused.

The ledger cannot drift from the records: a record enters it only here,
when it moves into a held phase, and leaves it only here, when it moves out
(a reforward, an eviction) or is forgotten (``forget``). The sequencer
routes every such move through this class; nothing else touches the count.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._chunk_record import ChunkRecord, move

__all__ = ["ReplayStore"]


class ReplayStore:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        # serial -> (record, bytes), oldest first: the eviction order.
        self._held: dict[int, tuple[ChunkRecord, int]] = {}
        self._bytes = 0

    @property
    def stored_bytes(self) -> int:
        """Bytes held between requests: answers and outputs kept for a reforward."""
        return self._bytes

    def __len__(self) -> int:
        """How many records hold bytes."""
        return len(self._held)

    def answered(self, record: ChunkRecord, response: Any, nbytes: int) -> None:
        """``response_ready``: keep the answer for a replay; the output goes."""
        move(record, "response_ready")
        record.response, record.stage_output = response, None
        self._hold(record, nbytes)

    def forward_failed(self, record: ChunkRecord, nbytes: int) -> None:
        """Keep the stage output (already on the record) for a reforward."""
        move(record, "forward_failed")
        self._hold(record, nbytes)

    def reforward(self, record: ChunkRecord) -> Any:
        """The kept output goes downstream again: in flight, no longer held."""
        self._release(record)
        move(record, "reforward")
        return record.stage_output

    def forget(self, records: Iterable[ChunkRecord]) -> None:
        """Records that go (trimmed, a new run, a session ended): so do their bytes."""
        for record in records:
            self._release(record)

    def _hold(self, record: ChunkRecord, nbytes: int) -> None:
        if nbytes <= 0:
            return
        self._held[record.ticket.serial] = (record, nbytes)
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            _, (oldest, _) = next(iter(self._held.items()))
            self._release(oldest)
            move(oldest, "evict")
            oldest.response = oldest.stage_output = None

    def _release(self, record: ChunkRecord) -> None:
        held = self._held.pop(record.ticket.serial, None)
        if held is not None:
            self._bytes -= held[1]
