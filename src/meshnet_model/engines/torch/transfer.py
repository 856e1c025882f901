"""Tensors between the host (numpy, the wire's side) and the engine's device.

* Host -> device: the received array is viewed as a CPU tensor (no copy) and
  moved once with ``.to(device, dtype)`` — which is the array itself when the
  device is the CPU and the dtype already right.
* Device -> host, CPU: the output tensor's memory viewed as a numpy array (no
  copy); the engine allocates a fresh output per chunk, so the view stays
  valid for as long as the node keeps it (replays, reforwards).
* Device -> host, CUDA: one copy into a page-locked (pinned) host buffer the
  session reuses (``Staging``), viewed as numpy. The node may keep a chunk's
  output after the chunk (a stored answer for replay, a reforward), so the
  buffer is reused only once nothing viewing it is alive — a weak reference
  to the array lent out says so; while it lives a new buffer is allocated.
  In steady decode the previous step's answer is gone and one buffer serves
  every step.

``Staging`` takes its allocator as a parameter: a CPU test drives the same
code with ordinary memory and counts allocations and copies (no GPU here).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from .weights import to_torch

__all__ = ["Staging", "Transfer", "to_numpy"]

_NUMPY = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def _numpy_dtype(tensor: Any) -> np.dtype:
    dtype: np.dtype = _NUMPY[str(tensor.dtype).removeprefix("torch.")]
    return dtype


def to_numpy(torch: Any, tensor: Any) -> np.ndarray:
    """A CPU tensor's memory as a numpy array (no copy; bfloat16 as ml_dtypes')."""
    # torch is handed in untyped (imported lazily): say what .numpy() gives.
    if tensor.dtype == torch.bfloat16:
        raw: np.ndarray = tensor.view(torch.int16).numpy()
        return raw.view(ml_dtypes.bfloat16)
    array: np.ndarray = tensor.numpy()
    return array


class Staging:
    """One session's reusable host buffers for device -> host copies.

    A buffer is lent out as the numpy array of one answer and reused once
    that array is gone. Up to ``keep`` buffers stay with the session (two
    cover the usual case: the caller still holds step k's answer while step
    k+1 copies), beyond that an answer gets a buffer of its own.
    """

    def __init__(
        self, torch: Any, alloc: Callable[[int, Any], Any] | None = None, keep: int = 2
    ) -> None:
        self.torch = torch
        self.alloc = alloc or (lambda n, dtype: torch.empty(n, dtype=dtype, pin_memory=True))
        self.keep = keep
        self.pool: list[tuple[Any, weakref.ref[np.ndarray] | None]] = []
        self.allocations = 0
        self.copies = 0

    def _buffer(self, numel: int, dtype: Any) -> tuple[int, Any]:
        for i, (buffer, lent) in enumerate(self.pool):
            if (
                (lent is None or lent() is None)
                and buffer.dtype == dtype
                and buffer.numel() >= numel
            ):
                return i, buffer
        buffer = self.alloc(numel, dtype)
        self.allocations += 1
        free = [i for i, (_, lent) in enumerate(self.pool) if lent is None or lent() is None]
        if len(self.pool) < self.keep:
            self.pool.append((buffer, None))
            return len(self.pool) - 1, buffer
        if free:  # a free buffer too small or of another dtype: replace it
            self.pool[free[0]] = (buffer, None)
            return free[0], buffer
        return -1, buffer  # every kept buffer is lent: this one is the answer's own

    def copy_out(self, tensor: Any) -> np.ndarray:
        numel = tensor.numel()
        slot, buffer = self._buffer(numel, tensor.dtype)
        host = buffer[:numel]
        host.copy_(tensor.reshape(-1))
        self.copies += 1
        # A fresh ndarray over the buffer, weakly referenced: every view the
        # node makes of it (slices, memoryviews for the socket) keeps it alive.
        raw = host.view(self.torch.int16) if host.dtype == self.torch.bfloat16 else host
        flat = np.frombuffer(memoryview(raw.numpy()), dtype=_numpy_dtype(tensor))
        if slot >= 0:
            self.pool[slot] = (buffer, weakref.ref(flat))
        return flat.reshape(tuple(tensor.shape))


class Transfer:
    """Moves a stage's inputs to its device and its outputs back (see module doc)."""

    def __init__(
        self,
        torch: Any,
        device: Any,
        *,
        staged: bool | None = None,
        alloc: Callable[[int, Any], Any] | None = None,
    ) -> None:
        self.torch, self.device = torch, device
        self.staged = device.type != "cpu" if staged is None else staged
        self.alloc = alloc

    def to_device(self, array: np.ndarray, dtype: Any | None = None) -> Any:
        tensor = to_torch(self.torch, np.ascontiguousarray(array))
        return tensor.to(device=self.device, dtype=dtype)

    def new_staging(self) -> Staging | None:
        return Staging(self.torch, self.alloc) if self.staged else None

    def to_host(self, tensor: Any, staging: Staging | None) -> np.ndarray:
        if staging is not None:
            return staging.copy_out(tensor)
        return to_numpy(self.torch, tensor.contiguous())
