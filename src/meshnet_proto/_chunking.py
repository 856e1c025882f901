"""Splitting a sequence into chunks along its token axis, and joining them back.

(Being written: only ``token_axis`` so far.)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["token_axis"]


def token_axis(shape: Sequence[int]) -> int:
    """The axis that counts tokens (SPEC §2): 1, or 0 for a rank-1 tensor."""
    if len(shape) == 0:
        raise ValueError("a scalar has no token axis: wire tensors have 1 to 8 dimensions")
    return 0 if len(shape) == 1 else 1
