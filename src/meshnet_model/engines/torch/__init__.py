"""The torch compute engine for model stages (``meshnet-node --engine torch``).

The numpy engine (``meshnet_model.engines.numpy``) stays the default and the
reference; this one runs the same layers with PyTorch so a stage can keep its
weights in bfloat16/float16 and compute on a GPU. Both sit behind the same
``StageRunner``: the runner owns sessions, the KV budget and the locking, an
engine owns the weights, the cache's arrays and the per-layer forward.

PyTorch is optional (``pip install -e '.[torch]'`` in the checkout): importing
``meshnet_model`` never imports it, and this package imports it only when an
engine is built (``load_torch_runner``), failing with one line that names the
extra when it is missing.

Modules, one concern each: ``_torch`` (the import, dtypes, device strings),
``weights`` (checkpoint tensors onto the device in the target dtype),
``kv_cache`` (a session's device cache in blocks), ``layers`` (the math),
``transfer`` (host <-> device bytes for the wire), ``engine`` (the forward
pass behind the runner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._torch import COMPUTE_DTYPES, TorchUnavailable, parse_device

__all__ = ["COMPUTE_DTYPES", "TorchUnavailable", "load_torch_runner", "parse_device"]

if TYPE_CHECKING:  # callers are checked against engine's own signature
    from .engine import load_torch_runner
else:

    def load_torch_runner(*args, **kwargs):
        """``engine.load_torch_runner``, importing torch only when called."""
        from .engine import load_torch_runner as load

        return load(*args, **kwargs)
