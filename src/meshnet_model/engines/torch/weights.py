"""One stage's tensors as torch tensors on the target device, in the target dtype.

The checkpoint is read by the numpy loader with ``dtype="keep"``: every
matrix a read-only view on the file's memory map, never converted there. A
matrix is then handed to torch:

* already in the target dtype on the CPU: ``torch.from_numpy`` over the map —
  no copy at all, the pages are loaded when first touched (a bf16 checkpoint
  computed in bf16 is never widened, and costs its file size);
* another dtype or another device: one ``.to(device, dtype)`` straight from
  the map — the converted tensor is the only copy held.

The numpy views are dropped afterwards, so a converted stage does not keep
the map's pages (RSS counts mapped pages once touched). Norm weights and
biases are held in the compute dtype too, as transformers holds them when a
model is loaded in that dtype.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

import ml_dtypes
import numpy as np

from ...stage.weights import LayerWeights, StageWeights

__all__ = ["TorchLayer", "TorchStageWeights", "to_torch"]

_BF16 = np.dtype(ml_dtypes.bfloat16)


def to_torch(torch: Any, array: np.ndarray) -> Any:
    """A CPU tensor sharing ``array``'s memory (bfloat16 through an int16 view:
    numpy has no bfloat16 torch knows of)."""
    with warnings.catch_warnings():
        # The map is read-only and torch warns that it cannot promise that;
        # the engine never writes to a weight.
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        if array.dtype == _BF16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


@dataclass(slots=True)
class TorchLayer:
    """One decoder layer; the same names and ``[out, in]`` layout as ``LayerWeights``."""

    input_norm: Any
    q: Any
    k: Any
    v: Any
    o: Any
    post_norm: Any
    gate: Any
    up: Any
    down: Any
    q_bias: Any = None
    k_bias: Any = None
    v_bias: Any = None
    o_bias: Any = None
    gate_bias: Any = None
    up_bias: Any = None
    down_bias: Any = None
    q_norm: Any = None
    k_norm: Any = None


@dataclass(slots=True)
class TorchStageWeights:
    blocks: list[TorchLayer]
    embed: Any  # [vocab, hidden] on the first stage, else None
    norm: Any
    lm_head: Any  # the embedding itself when tied
    dtype: Any  # the torch dtype everything is held and computed in
    device: Any
    shared_with_file: int  # bytes used straight from the memory map (no copy)

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.norm, self.lm_head]
        for block in self.blocks:
            tensors += [getattr(block, f.name) for f in fields(block)]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    @classmethod
    def from_numpy(
        cls, torch: Any, weights: StageWeights, *, dtype: Any, device: Any
    ) -> TorchStageWeights:
        shared = 0

        def move(array: np.ndarray | None) -> Any:
            nonlocal shared
            if array is None:
                return None
            tensor = to_torch(torch, array)
            if tensor.dtype == dtype and device.type == "cpu":
                shared += array.nbytes
                return tensor
            return tensor.to(device=device, dtype=dtype)

        blocks = [
            TorchLayer(**{f.name: move(getattr(b, f.name)) for f in fields(LayerWeights)})
            for b in weights.blocks
        ]
        embed = move(weights.embed)
        if weights.tied_head and weights.embed is not None:
            lm_head = embed  # one tensor for both, as the checkpoint has one
        else:
            lm_head = move(weights.lm_head)
        return cls(blocks, embed, move(weights.norm), lm_head, dtype, device, shared)
