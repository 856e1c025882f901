"""What one stage takes: the checks a chunk passes before it is computed.

``StageRunner``'s ``check_*`` methods are these, given the runner's weights,
engine and limits. Everything here is decided from the chunk's header (shape,
dtype, position) but ``check_values``, which reads the tensor once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ChunkTooLarge, ContextExceeded, StageInputError
from ..formats.config import ModelConfig
from .costs import chunk_cost, reachable_context
from .weights import StageWeights

if TYPE_CHECKING:  # typing only: the engines import this package
    from ..engines.base import Engine

__all__ = ["check_cost", "check_position", "check_shape", "check_values"]

_FLOAT_WIRE = ("float32", "float16", "bfloat16")


def check_shape(weights: StageWeights, shape: tuple[int, ...], dtype: str) -> None:
    """Raise ``StageInputError`` unless a chunk of this shape and dtype (its
    wire name) is what this stage takes — the checks that need no values."""
    c = weights.config
    if weights.first:
        if dtype != "int32" or len(shape) != 2:
            raise StageInputError(
                f"the stage owning layer 0 takes token ids: int32 [batch, tokens], got "
                f"{dtype} {list(shape)}"
            )
        return
    if dtype not in _FLOAT_WIRE or len(shape) != 3 or shape[2] != c.hidden_size:
        raise StageInputError(
            f"layers {weights.layers.start}..{weights.layers.stop - 1} take "
            f"hidden states: float [batch, tokens, {c.hidden_size}], got {dtype} "
            f"{list(shape)}"
        )


def check_cost(
    weights: StageWeights,
    model: Engine[Any],
    shape: tuple[int, ...],
    position: int | None,
    *,
    kv_budget: int,
    max_chunk_tokens: int,
    max_compute_bytes: int,
) -> None:
    """Refuse (``ChunkTooLarge``, ``ContextExceeded``) a chunk of ``shape``
    that would allocate or compute more than the limits allow."""
    config = weights.config
    batch, tokens = shape[0], shape[1]
    context = config.max_position_embeddings
    if tokens > context:
        raise ContextExceeded(
            f"a chunk of {tokens} tokens is longer than the model's context of {context} positions"
        )
    if batch * tokens > max_chunk_tokens:
        raise ChunkTooLarge(
            f"a chunk of {batch} x {tokens} = {batch * tokens} token rows is over this "
            f"node's limit of {max_chunk_tokens} (--max-chunk-tokens)"
        )
    itemsize = getattr(model, "kv_itemsize", 4)
    span = len(weights.layers)
    reachable = reachable_context(
        config, layers=span, batch=batch, kv_budget=kv_budget, kv_itemsize=itemsize
    )
    if position is not None:
        reachable = min(reachable, position + tokens)
    cost = chunk_cost(
        config,
        batch=batch,
        tokens=tokens,
        context=reachable,
        last=weights.last,
        query_block=model.query_block,
    )
    if cost.total > max_compute_bytes:
        raise ChunkTooLarge(
            f"a chunk of shape {list(shape)} needs ~{cost.total} bytes of scratch, over "
            f"this node's limit of {max_compute_bytes} (--max-compute-bytes)"
        )


def check_position(config: ModelConfig, position: int, tokens: int) -> None:
    """Refuse positions past the model's context (RoPE was never trained there)."""
    context = config.max_position_embeddings
    if position + tokens > context:
        raise ContextExceeded(
            f"positions {position}..{position + tokens - 1} are past the model's context "
            f"of {context} positions (max_position_embeddings)"
        )


def check_values(weights: StageWeights, inputs: np.ndarray) -> None:
    """Raise ``StageInputError`` unless the values of ``inputs`` are usable."""
    vocab = weights.config.vocab_size
    if weights.first and inputs.size and (inputs.min() < 0 or inputs.max() >= vocab):
        raise StageInputError(
            f"token ids must be in 0..{vocab - 1}, got {inputs.min()}..{inputs.max()}"
        )
    # A NaN or an infinity would be written into the session's KV cache and
    # poison every later position: refused, never computed on.
    if not weights.first and not np.isfinite(inputs).all():
        raise StageInputError("hidden states must be finite (no NaN or infinity)")
