"""The tensors ``meshnet bench`` and ``meshnet demo`` send.

Here, in the bench package, because the bench measures with them and the
CLI (which runs the bench) only borrows them: the dependency goes one way,
``meshnet_cli`` -> ``meshnet_bench``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy.typing as npt

from meshnet_bench._wire1 import encode_body

__all__ = ["SEED", "make_activation", "wire1_body_size"]

SEED = 20240611


def make_activation(
    tokens: int, hidden: int, seed: int = SEED, dtype: npt.DTypeLike = ml_dtypes.bfloat16
) -> np.ndarray:
    """A (1, tokens, hidden) tensor shaped like a transformer's hidden states:
    most channels small, a few large outliers; bfloat16 unless ``dtype`` says
    otherwise (``meshnet bench`` sends float32 as wire 1 did). Random
    mantissas are what keeps zstd's ratio honest: a zeroed or constant tensor
    would compress a thousandfold and prove nothing."""
    rng = np.random.default_rng(seed)
    scale = rng.lognormal(mean=np.log(0.5), sigma=0.5, size=hidden).astype(np.float32)
    scale[rng.choice(hidden, size=min(4, hidden), replace=False)] *= 30.0
    values = rng.standard_normal((1, tokens, hidden), dtype=np.float32) * scale
    return values.astype(dtype, copy=False)


def wire1_body_size(array: np.ndarray) -> int:
    """Bytes of the same tensor as wire 1 sent it: base64 inside a JSON object."""
    return len(encode_body(array))
