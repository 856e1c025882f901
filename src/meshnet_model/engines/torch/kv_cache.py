"""A session's keys and values on the engine's device, in its compute dtype.

The budget logic is the numpy ``KVCache``'s (one ``KVBudget`` per stage, the
allocated capacity counted, 503 ``kv_memory_full`` when a chunk cannot fit,
``SessionEnded`` for a cache closed mid-chunk); this subclass only says what
an element costs and allocates device tensors. Capacity is always a whole
number of blocks (``BLOCK`` positions): a session's cache is preallocated a
block at a time and grows by doubling, so decode steps write into memory that
is already there instead of allocating per token.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ...stage.kv_cache import KVBudget, KVCache
from .transfer import Staging

__all__ = ["BLOCK", "TorchKVCache"]

BLOCK = 64  # positions per allocation unit


class TorchKVCache(KVCache):
    def __init__(
        self,
        torch: Any,
        budget: KVBudget,
        *,
        layers: int,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        device: Any,
    ) -> None:
        super().__init__(budget, layers=layers, batch=batch, kv_heads=kv_heads, head_dim=head_dim)
        self.torch, self.dtype, self.device = torch, dtype, device
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        # The session's device->host buffers (CUDA; None on the CPU): they
        # live and die with the session, as its cache does.
        self.staging: Staging | None = None

    def reserve(self, needed: int) -> None:
        super().reserve(-(-needed // BLOCK) * BLOCK)

    def _allocate(self, capacity: int) -> None:
        t = self.torch
        shape = (self.batch, self.kv_heads, capacity, self.head_dim)
        filled = self.length
        keys, values = [], []
        for layer in range(self.layers):
            k = t.empty(shape, dtype=self.dtype, device=self.device)
            v = t.empty(shape, dtype=self.dtype, device=self.device)
            if filled:
                k[:, :, :filled] = self.keys[layer][:, :, :filled]
                v[:, :, :filled] = self.values[layer][:, :, :filled]
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def export_state(self) -> np.ndarray:
        t, n = self.torch, self.length
        stacked = t.stack(
            [
                t.stack([k[:, :, :n], v[:, :, :n]])
                for k, v in zip(self.keys, self.values, strict=True)
            ]
        )
        host = stacked.cpu().contiguous()
        if self.dtype == t.bfloat16:  # numpy has no bfloat16: the bits, as ml_dtypes'
            return host.view(t.int16).numpy().view(ml_dtypes.bfloat16)  # type: ignore[no-any-return]
        return host.numpy()  # type: ignore[no-any-return]

    def import_state(self, state: np.ndarray) -> None:
        t = self.torch
        n = self._check_import(state)
        host = np.ascontiguousarray(state)
        if self.dtype == t.bfloat16:
            tensor = t.from_numpy(host.view(np.int16)).view(t.bfloat16)
        else:
            tensor = t.from_numpy(host)
        tensor = tensor.to(self.device)
        self.reserve(n)
        for layer in range(self.layers):
            self.keys[layer][:, :, :n] = tensor[layer, 0]
            self.values[layer][:, :, :n] = tensor[layer, 1]
        self.length = n
