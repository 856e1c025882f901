"""Stage backends: what a node computes on each chunk.

A stage is a callable on a numpy array returning an array — sync or async.
Today's stages are stubs (``echo``, ``zeros``); real model layers plug in
here later without touching the wire or the sequencing.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

__all__ = ["BACKENDS", "Stage", "echo", "make_stage", "zeros"]

StageFn = Callable[[np.ndarray], np.ndarray | Awaitable[np.ndarray]]


def echo(tensor: np.ndarray) -> np.ndarray:
    """The chunk unchanged (zero-copy: the received buffer itself)."""
    return tensor


def zeros(tensor: np.ndarray) -> np.ndarray:
    """A zeroed tensor of the same shape and dtype."""
    return np.zeros_like(tensor)


BACKENDS: dict[str, StageFn] = {"echo": echo, "zeros": zeros}


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


def make_stage(name: str, delay_ms: float = 0.0) -> Stage:
    try:
        return Stage(name, BACKENDS[name], delay_ms)
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})") from None
