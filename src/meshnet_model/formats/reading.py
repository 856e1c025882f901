"""Reading a file's bytes into memory of this process's own (``pread``), not mapping them.

A loader that converts a tensor into another form and drops its bytes must
not take them through a memory map: every page of the map it touched stays
counted in the process's RSS for as long as the map lives. ``read_rows``
reads rows of a tensor; ``RowReader`` reads them a range at a time, when
sliced, so a loader converting a chunk of rows at a time never holds more
than a chunk of the file's bytes. A read that comes back short (a file cut
while it was open) is a ``CheckpointError``, like every other bad file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

__all__ = ["RowReader", "read_rows"]


def read_rows(path: str | Path, offset: int, rows: int, row_bytes: int) -> np.ndarray:
    """``rows`` rows of ``row_bytes`` bytes at file ``offset``, uint8 ``[rows, row_bytes]``."""
    out = np.empty((rows, row_bytes), np.uint8)
    view = out.data.cast("B")  # memoryview(out): numpy types ndarray a Buffer only on 3.12+
    try:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < out.nbytes:
                n = os.preadv(f.fileno(), [view[done:]], offset + done)
                if n <= 0:
                    raise CheckpointError(f"{path}: short read at byte {offset + done}")
                done += n
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    return out


class RowReader:
    """A tensor's rows read from the file when sliced (``reader[a:b]`` → uint8
    ``[b - a, row_bytes]``)."""

    def __init__(self, path: str | Path, offset: int, rows: int, row_bytes: int) -> None:
        self.path, self.offset, self.row_bytes = path, offset, row_bytes
        self.shape = (rows, row_bytes)

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("rows are read in contiguous ranges")
        return read_rows(
            self.path, self.offset + start * self.row_bytes, max(0, stop - start), self.row_bytes
        )

    def all(self) -> np.ndarray:
        return self[0 : self.shape[0]]
