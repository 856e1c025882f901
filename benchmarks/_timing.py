"""Timing shared by the benchmarks (run as scripts: this folder is on sys.path)."""

from __future__ import annotations

import time

import numpy as np

from meshnet_gateway import Client


async def best_forward(
    client: Client, array: np.ndarray, *, encoding: str, repeat: int
) -> tuple[float, np.ndarray]:
    """Best wall time of ``repeat`` forwards of ``array`` and the last output.

    One token goes through first so that connections are open and pooled
    before anything is timed.
    """
    await client.forward(array[:, :1], encoding=encoding)
    best, output = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = await client.forward(array, encoding=encoding)
        best = min(best, time.perf_counter() - start)
        output = result.output
    assert output is not None
    return best, output
