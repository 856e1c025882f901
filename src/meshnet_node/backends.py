"""Stage backends: what a node computes on each chunk.

A stage is a callable on a numpy array returning an array — sync or async.
Today's stages are stubs (``echo``, ``zeros``, and ``count``: echo that
counts its runs per chunk, for fault and load tests); real model layers plug
in here later without touching the wire or the sequencing.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

__all__ = [
    "BACKENDS",
    "ChunkKey",
    "CountingStage",
    "Stage",
    "current_chunk",
    "echo",
    "make_stage",
    "running_chunk",
    "zeros",
]

StageFn = Callable[[np.ndarray], np.ndarray | Awaitable[np.ndarray]]


def echo(tensor: np.ndarray) -> np.ndarray:
    """The chunk unchanged (zero-copy: the received buffer itself)."""
    return tensor


def zeros(tensor: np.ndarray) -> np.ndarray:
    """A zeroed tensor of the same shape and dtype."""
    return np.zeros_like(tensor)


BACKENDS: dict[str, StageFn] = {"echo": echo, "zeros": zeros, "count": echo}

# (session, chunk index, position): which chunk a stage run is for.
ChunkKey = tuple[str, int, int]
# Set by the node around each stage run, so a stage can tell chunks apart
# without the stage call itself having to carry sequencing details.
current_chunk: ContextVar[ChunkKey | None] = ContextVar("meshnet_current_chunk", default=None)


@contextmanager
def running_chunk(session: str, index: int, position: int) -> Iterator[None]:
    token = current_chunk.set((session, index, position))
    try:
        yield
    finally:
        current_chunk.reset(token)


@dataclass(slots=True)
class Stage:
    """One stage: ``fn`` plus a simulated compute delay (``--delay-ms``).

    A sync ``fn`` runs on the event loop: only cheap stages belong there; a
    real layer should be async (or wrap itself in ``anyio.to_thread``).
    ``calls`` counts runs, which is what "a replay does not rerun the stage"
    is checked against.
    """

    name: str
    fn: StageFn
    delay_ms: float = 0.0
    calls: int = 0

    async def __call__(self, tensor: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.delay_ms:
            await anyio.sleep(self.delay_ms / 1000)
        result = self.fn(tensor)
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, np.ndarray):
            raise TypeError(f"stage {self.name} returned {type(result).__name__}, not an ndarray")
        return result

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "delay_ms": self.delay_ms}


@dataclass(slots=True)
class CountingStage(Stage):
    """``echo`` that counts how often it ran each chunk (``--backend count``).

    The proof behind "no stage runs a chunk twice" under retries and replays:
    ``runs[(session, index, position)]`` must never exceed 1. For tests and
    diagnostics only: it keeps one counter entry per chunk ever run.
    """

    runs: Counter[ChunkKey | None] = field(default_factory=Counter)

    async def __call__(self, tensor: np.ndarray) -> np.ndarray:
        self.runs[current_chunk.get()] += 1
        return await Stage.__call__(self, tensor)

    def describe(self) -> dict[str, Any]:
        # Bounded summary (not the table itself) for /info.
        return {
            **Stage.describe(self),
            "runs": sum(self.runs.values()),
            "chunks": len(self.runs),
            "max_runs_per_chunk": max(self.runs.values(), default=0),
        }


def make_stage(name: str, delay_ms: float = 0.0) -> Stage:
    if name == "count":
        return CountingStage(name, echo, delay_ms)
    try:
        return Stage(name, BACKENDS[name], delay_ms)
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})") from None
