"""The Llama decoder layer's math in torch, as transformers computes it.

The operations and their order follow transformers' ``LlamaDecoderLayer``
(and its mistral/qwen2/qwen3/smollm3 variants), so that in the same dtype the
two round alike:

* RMSNorm in float32 whatever the compute dtype, the normalised value cast
  back before the weight multiplies it;
* rope's cos/sin made in float32 and cast to the compute dtype, applied as
  ``q * cos + rotate_half(q) * sin`` ("rotate half");
* attention through ``scaled_dot_product_attention``; grouped-query heads
  are folded into the query axis (``[b, kv_heads, groups * t, d]``), which is
  the same arithmetic as repeating the keys per head without the copy;
* ``down(silu(gate(x)) * up(x))``, residual adds in the compute dtype.

Everything runs under ``torch.inference_mode`` (the engine's caller): no
autograd graph, no version counters.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...formats.config import ModelConfig
from ...rope import Rope
from ...stage.batch import ATTENTION_BLOCK, SHARED_ROWS, product_segments, query_blocks
from .qlinear import Int4Matrix, linear

__all__ = [
    "RopeTable",
    "attend",
    "avoid_planned_attention",
    "fused_rms_norm",
    "mlp",
    "product",
    "project_qkv",
    "rms_norm",
    "rotate",
]


def fused_rms_norm(torch: Any, x: Any, weight: Any, eps: float) -> Any:
    """One kernel instead of eight (float32 in and out): the quantized stages'
    norm, where a decode step's time is mostly per-op overhead. The same
    formula; its float32 rounding may differ from ``rms_norm``'s in the last
    bit, which the quantized path's error budget covers."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(torch: Any, x: Any, weight: Any, eps: float) -> Any:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(torch: Any, x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RopeTable:
    """cos/sin rows for absolute positions on the device, in the compute dtype.

    Made by the numpy ``Rope`` (the very float32 values the numpy engine
    uses) and kept as a table grown by doubling, so a decode step slices it
    instead of computing and uploading two rows. Dynamic NTK beyond the
    trained length depends on the chunk's end, not only the position: those
    chunks are computed afresh.
    """

    def __init__(self, torch: Any, config: ModelConfig, dtype: Any, device: Any) -> None:
        self.torch, self.rope = torch, Rope(config)
        self.dtype, self.device = dtype, device
        self.cos: Any = None  # torch tensors, from the first get()
        self.sin: Any = None
        self.size = 0

    def _upload(self, cos: np.ndarray, sin: np.ndarray) -> tuple[Any, Any]:
        t = self.torch
        return (
            t.from_numpy(cos).to(self.device, self.dtype),
            t.from_numpy(sin).to(self.device, self.dtype),
        )

    def get(self, start: int, count: int) -> tuple[Any, Any]:
        end = start + count
        rope = self.rope
        if rope.scaling.rope_type == "dynamic" and end > rope.max_positions:
            return self._upload(*rope.cos_sin(start, count))
        if end > self.size:
            size = max(end, 2 * self.size, 256)
            if rope.scaling.rope_type == "dynamic":
                size = min(max(size, end), max(rope.max_positions, end))
            self.cos, self.sin = self._upload(*rope.cos_sin(0, size))
            self.size = size
        return self.cos[start:end], self.sin[start:end]


def product(torch: Any, x: Any, weight: Any, bias: Any, blocks: RowBlocks = None) -> Any:
    """Packed rows times a dense tensor or a quantized matrix (by its kernel, qlinear).

    Row-invariant (``stage.batch``): the int4pack kernel computes each row on
    its own, so one call takes every row. A dense product (oneDNN, MKL) picks
    its kernel by the number of rows and sums in another order, so with
    ``blocks`` (each batched entry's rows) the small entries share products of
    exactly ``SHARED_ROWS`` rows, zero-padded, and each larger entry runs
    alone on its own rows (``product_segments``)."""
    if isinstance(weight, Int4Matrix):  # its dense tiles, if any: blocks (dense_tiles.StepRows)
        return linear(torch, x, weight, bias, blocks)
    if blocks is None:
        return linear(torch, x, weight, bias)
    parts = []
    for lo, hi, padded in product_segments(blocks):
        rows = x[lo:hi]
        if padded and hi - lo < SHARED_ROWS:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, SHARED_ROWS - (hi - lo)))
        parts.append(linear(torch, rows, weight, bias)[: hi - lo])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# Each batched entry's rows (PackedBatch.entry_rows), or None: one product.
RowBlocks = list[tuple[int, int]] | None


def project_qkv(
    torch: Any, x: Any, block: Any, config: ModelConfig, blocks: RowBlocks = None
) -> tuple[Any, Any, Any]:
    """The query, key and value projections of packed rows ``[rows, hidden]``:
    one kernel call each (one for the three in a quantized stage), however
    many chunks the rows come from."""
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if block.qkv is not None:  # one kernel for the three (a quantized stage)
        q, k, v = product(torch, x, block.qkv, None, blocks).split(
            [heads * d, kv_heads * d, kv_heads * d], dim=-1
        )
        return _add(q, block.q_bias), _add(k, block.k_bias), _add(v, block.v_bias)
    return (
        product(torch, x, block.q, block.q_bias, blocks),
        product(torch, x, block.k, block.k_bias, blocks),
        product(torch, x, block.v, block.v_bias, blocks),
    )


def rotate(
    torch: Any,
    q: Any,
    k: Any,
    block: Any,
    config: ModelConfig,
    rope: tuple[Any, Any] | None,
) -> tuple[Any, Any]:
    """Packed rows' queries ``[rows, heads, d]`` and keys ``[rows, kv_heads, d]``
    made ready to attend: qwen3's per-head RMSNorm, then rope with each row's
    own (cos, sin) ``[rows, 1, d]`` (None on a layer without rope). Element by
    element, so one call for every chunk of a step gives each row exactly the
    numbers it gets alone."""
    if block.q_norm is not None:  # qwen3: RMSNorm of each head's vector, before rope
        q = rms_norm(torch, q, block.q_norm, config.rms_norm_eps)
        k = rms_norm(torch, k, block.k_norm, config.rms_norm_eps)
    if rope is not None:
        cos, sin = rope
        q = q * cos + rotate_half(torch, q) * sin
        k = k * cos + rotate_half(torch, k) * sin
    return q, k


def attend(
    torch: Any,
    q: Any,
    k: Any,
    v: Any,
    config: ModelConfig,
    keys: Any,
    values: Any,
    past: int,
    window: int | None,
    *,
    batch: int,
    block_size: int = ATTENTION_BLOCK,
) -> Any:
    """Causal grouped-query attention of one chunk at positions ``past ..``
    from its rotated rows (``[batch * t, heads, d]`` queries, ``[batch * t,
    kv_heads, d]`` keys and values), writing its keys and values into the
    cache tensors ``[b, kv_heads, capacity, d]`` at ``past``; returns the
    heads' outputs ``[batch * t, heads * d]``, before ``o``. ``window``: the
    query at ``p`` sees keys ``p - window < k <= p`` (transformers' sliding
    mask). ``block_size``: the query rows attended at once (a window's: 1,
    ``BatchEntry.query_block``)."""
    b = batch
    t = q.shape[0] // b
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    groups = heads // kv_heads
    q = q.reshape(b, t, heads, d).transpose(1, 2)
    total = past + t
    keys[:, :, past:total] = k.reshape(b, t, kv_heads, d).transpose(1, 2)
    values[:, :, past:total] = v.reshape(b, t, kv_heads, d).transpose(1, 2)
    outs = []
    # Aligned query blocks (stage.batch.query_blocks): the queries [a, b) see the
    # keys up to b, so a chunk's numbers do not depend on how a step split it.
    for lo, hi in query_blocks(past, t, block_size):
        rows, end = hi - lo, past + hi
        first_key = 0 if window is None else max(0, past + lo - window + 1)
        mask = None
        if rows > 1:
            query_pos = torch.arange(past + lo, end, device=q.device)[:, None]
            key_pos = torch.arange(first_key, end, device=q.device)[None, :]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            mask = mask.repeat(groups, 1)  # the folded query axis is (group, token)
        # [b, heads, rows, d] -> [b, kv_heads, groups * rows, d]: head h uses kv head h // groups.
        block = q[:, :, lo:hi].reshape(b, kv_heads, groups * rows, d)
        out = torch.nn.functional.scaled_dot_product_attention(
            block,
            keys[:, :, first_key:end],
            values[:, :, first_key:end],
            attn_mask=mask,
            scale=1.0 / math.sqrt(d),
        )
        # reshape, not view: CUDA's memory-efficient kernel returns its output
        # as a transposed view of [b, groups * rows, kv_heads, d], which no
        # view regroups into heads (a copy then; on the CPU it is contiguous).
        outs.append(out.reshape(b, heads, rows, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).reshape(b * t, heads * d)


def avoid_planned_attention(torch: Any, device: Any) -> None:
    """On CUDA, take cuDNN out of ``scaled_dot_product_attention``'s choices.

    torch (2.11 on an H200) picks cuDNN's attention for bfloat16 and float16,
    and cuDNN builds an execution plan for each key length it has not seen:
    every decode step of a longer context than the process has served, and
    every prefill chunk at a new position, pays for one (two bfloat16 stages of
    SmolLM2-135M's shape: 82 ms a decode step against 23 ms, 273 ms a 5-token
    chunk against 32 ms; .ci/gpu-check.sh). Flash and memory-efficient
    attention take any length at once, and as fast as a planned cuDNN call.
    torch keeps the choice per process; every stage of a process wants it,
    and the CPU has no such kernels, so a CPU stage leaves it alone."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _add(x: Any, bias: Any) -> Any:
    return x if bias is None else x + bias


def mlp(torch: Any, x: Any, block: Any, blocks: RowBlocks = None) -> Any:
    f = torch.nn.functional
    if block.gate_up is not None:  # one kernel for both (a quantized stage)
        gate, up = product(torch, x, block.gate_up, None, blocks).chunk(2, dim=-1)
        gate, up = _add(gate, block.gate_bias), _add(up, block.up_bias)
    else:
        gate = product(torch, x, block.gate, block.gate_bias, blocks)
        up = product(torch, x, block.up, block.up_bias, blocks)
    return product(torch, f.silu(gate) * up, block.down, block.down_bias, blocks)
