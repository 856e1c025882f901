"""The Llama decoder's forward pass for one pipeline stage, in numpy.

Everything is computed in float32, whatever the weights are held in:
numpy has no fast half-precision matmul (float16 goes through slow paths,
bfloat16 through ml_dtypes' element loops), and float32 keeps the error of a
long prefill small enough that "the same prompt through any split gives the
same logits" can be checked bit for bit and "chunked equals whole" within a
tight tolerance. A half-precision weight is widened to float32 just before its
matmul. The KV cache is float32 for the same reason.

Determinism: the same inputs through the same shapes run the same BLAS calls
and give the same bits, so a split of the layers over nodes changes nothing
(each layer sees the very same float32 hidden state). What does change the
last bits is chunking: a matmul over 7 rows and one over 64 may sum in
another order, and attention sums over another number of keys — hence the
stated tolerance for chunked prefill and for decode against recompute
(docs/models.md).

Shapes: ``hidden`` is ``[batch, tokens, hidden_size]``; the first stage takes
token ids ``[batch, tokens]`` (int32); the last returns the logits of the last
position, ``[batch, vocab]`` float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ...errors import StageInvariantError
from ...formats.config import ModelConfig
from ...rope import Rope, apply_rope
from ...stage.batch import (
    ATTENTION_BLOCK,
    SHARED_ROWS,
    BatchEntry,
    PackedBatch,
    product_segments,
    query_blocks,
)
from ...stage.kv_cache import KVCache
from ...stage.weights import LayerWeights, StageWeights

__all__ = [
    "StageInvariantError",
    "StageModel",
    "attend",
    "linear",
    "project_qkv",
    "rms_norm",
    "silu",
]

F32 = np.float32


_BF16 = np.dtype(ml_dtypes.bfloat16)


def _f32(w: np.ndarray) -> np.ndarray:
    """``w`` as float32 (itself when it is). bfloat16 is the upper half of a
    float32, so it widens exactly by a 16-bit shift — several times faster than
    ml_dtypes' element-wise ``astype``, and this runs per matmul with ``keep``."""
    if w.dtype == F32:
        return w
    if w.dtype == _BF16:
        return (w.view(np.uint16).astype(np.uint32) << 16).view(F32)
    return w.astype(F32)


def linear(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None = None,
    blocks: list[tuple[int, int]] | None = None,
) -> np.ndarray:
    """``x @ weight.T (+ bias)`` with ``weight`` ``[out, in]``, as 2-D matmuls:
    one, or with ``blocks`` (each batched entry's rows) shared tiles of
    ``SHARED_ROWS`` rows for the small entries and one per larger entry, so
    each row's numbers do not depend on the step it ran in (BLAS is not
    row-invariant across row counts, ``stage.batch``)."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    w = _f32(weight).T
    if blocks is None:
        out = rows @ w
    else:
        segments = product_segments(blocks)
        outs = [(_segment(rows, lo, hi, padded) @ w)[: hi - lo] for lo, hi, padded in segments]
        out = outs[0] if len(outs) == 1 else np.concatenate(outs)
    if bias is not None:
        out += bias
    shaped: np.ndarray = out.reshape(*lead, weight.shape[0])
    return shaped


def _segment(rows: np.ndarray, lo: int, hi: int, padded: bool) -> np.ndarray:
    """Rows ``[lo, hi)``, zero-padded to ``SHARED_ROWS`` in a shared tile."""
    if not padded or hi - lo == SHARED_ROWS:
        return rows[lo:hi]
    tile = np.zeros((SHARED_ROWS, rows.shape[1]), rows.dtype)
    tile[: hi - lo] = rows[lo:hi]
    return tile


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    normed: np.ndarray = weight * (x * (F32(1.0) / np.sqrt(variance + F32(eps))))
    return normed


def silu(x: np.ndarray) -> np.ndarray:
    # sigmoid through tanh: no overflow warning for large negative inputs.
    gated: np.ndarray = x * (F32(0.5) * (F32(1.0) + np.tanh(F32(0.5) * x)))
    return gated


def project_qkv(
    x: np.ndarray, block: LayerWeights, blocks: list[tuple[int, int]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query, key and value projections of packed rows ``[rows, hidden]``
    (one product per entry: ``blocks``)."""
    return (
        linear(x, block.q, block.q_bias, blocks),
        linear(x, block.k, block.k_bias, blocks),
        linear(x, block.v, block.v_bias, blocks),
    )


def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    block: LayerWeights,
    config: ModelConfig,
    rope: tuple[np.ndarray, np.ndarray] | None,
    keys: np.ndarray,
    values: np.ndarray,
    past: int,
    window: int | None,
    *,
    batch: int,
    block_size: int = ATTENTION_BLOCK,
) -> np.ndarray:
    """Grouped-query causal self-attention of one chunk at positions ``past ..``
    from its projected rows (``[batch * t, heads * d]``
    queries, ``[batch * t, kv_heads * d]`` keys and values) over its own cache;
    returns the heads' outputs ``[batch * t, heads * d]``, before ``o``. Writes
    the chunk's rotated keys and values into ``keys``/``values`` (``[batch,
    kv_heads, capacity, head_dim]``) at ``past``.

    ``rope``: this chunk's (cos, sin), or None on a layer without rope
    (smollm3). ``window``: a sliding window — the query at position ``p``
    sees keys ``p - window < k <= p``, transformers' sliding mask; the cache
    keeps every key, so chunking and decode see exactly those keys.
    ``block_size``: the query rows attended at once (a window's: 1,
    ``BatchEntry.query_block``).
    """
    b = batch
    t = q.shape[0] // b
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    groups = heads // kv_heads
    q = q.reshape(b, t, heads, d)
    k = k.reshape(b, t, kv_heads, d)
    if block.q_norm is not None and block.k_norm is not None:
        # qwen3: RMSNorm over each head's vector, before rope.
        q = rms_norm(q, block.q_norm, config.rms_norm_eps)
        k = rms_norm(k, block.k_norm, config.rms_norm_eps)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = v.reshape(b, t, kv_heads, d).transpose(0, 2, 1, 3)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    keys[:, :, past : past + t] = k
    values[:, :, past : past + t] = v
    q = q.reshape(b, kv_heads, groups, t, d)
    scale = F32(1.0 / math.sqrt(d))
    out = np.empty((b, kv_heads, groups, t, d), F32)
    # Aligned query blocks (stage.batch.query_blocks): the queries [a, b) see the
    # keys [0, b), so a chunk's numbers do not depend on how it was split.
    for lo, hi in query_blocks(past, t, block_size):
        end = past + hi
        k_all = keys[:, :, None, :end]  # [b, kv, 1, end, d]: broadcast over the group
        v_all = values[:, :, None, :end]
        scores = (q[:, :, :, lo:hi] @ k_all.swapaxes(-1, -2)) * scale  # [b,kv,g,rows,end]
        # Causal: the query at position past+i sees keys 0..past+i.
        key_pos = np.arange(end)
        query_pos = (past + np.arange(lo, hi))[:, None]
        hidden = key_pos[None, :] > query_pos
        if window is not None:
            hidden |= key_pos[None, :] <= query_pos - window
        scores[..., hidden] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[:, :, :, lo:hi] = scores @ v_all
    return out.reshape(b, heads, t, d).transpose(0, 2, 1, 3).reshape(b * t, heads * d)


def mlp(
    x: np.ndarray, block: LayerWeights, blocks: list[tuple[int, int]] | None = None
) -> np.ndarray:
    gate = linear(x, block.gate, block.gate_bias, blocks)
    up = linear(x, block.up, block.up_bias, blocks)
    return linear(silu(gate) * up, block.down, block.down_bias, blocks)


class StageModel:
    """The forward pass of one stage's layers, over a session's ``KVCache``."""

    query_block: int | None = ATTENTION_BLOCK  # attention scores this many query rows at once
    # BLAS products are not row-invariant: shared fixed tiles for small entries,
    # larger ones apart, and the scheduler never cuts a chunk into pieces
    # (stage.batch).
    row_invariant = False
    piece_tile: int | None = None

    def __init__(self, weights: StageWeights) -> None:
        self.weights = weights
        self.config = weights.config
        self.rope = Rope(self.config)

    @property
    def first(self) -> bool:
        return self.weights.first

    @property
    def last(self) -> bool:
        return self.weights.last

    def new_cache(self, budget, batch: int) -> KVCache:  # type: ignore[no-untyped-def]
        c = self.config
        return KVCache(
            budget,
            layers=len(self.weights.layers),
            batch=batch,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
        )

    def describe(self) -> dict[str, Any]:
        from ..choice import blas_threads

        return {
            "engine": "numpy",
            "device": "cpu",
            "compute_dtype": "float32",
            "threads": blas_threads(),
        }

    def embed(self, ids: np.ndarray) -> np.ndarray:
        assert self.weights.embed is not None
        return _f32(self.weights.embed[ids])

    def forward(
        self,
        inputs: np.ndarray,
        cache: KVCache,
        position: int,
        *,
        between_layers: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Run this stage's layers on a chunk starting at session ``position``.

        ``inputs``: token ids ``[batch, tokens]`` on the first stage, else hidden
        ``[batch, tokens, hidden]`` float32 (checked by the caller). Returns
        hidden ``[batch, tokens, hidden]``, or the last position's logits
        ``[batch, vocab]`` on the last stage. The cache must hold exactly
        ``position`` positions; it holds ``position + tokens`` after.
        ``between_layers`` is called before each layer and may raise to stop
        the compute (a spent deadline, an ended session); the cache then keeps
        ``position`` positions. A batch of one ``forward_batch``: one code path.
        """
        entry = BatchEntry(inputs, cache, position, between_layers)
        return self.forward_batch([entry]).result()

    def forward_batch(self, entries: Sequence[BatchEntry[KVCache]]) -> PackedBatch[KVCache]:
        """Several sessions' chunks in one pass (``stage.batch``): one step, each
        chunk's products on its own rows (BLAS is not row-invariant) and its
        attention over its own cache. Each entry ends with its ``output`` or
        its ``error``."""
        batch = PackedBatch(entries)
        if not batch.running:
            return batch
        hidden = self.config.hidden_size
        rows = [self.embed(e.inputs) if self.first else _f32(e.inputs) for e in batch.running]
        x = _pack([r.reshape(-1, hidden) for r in rows])
        x = self._layers(x, batch)
        if not batch.running:  # every entry stopped between layers
            return batch
        # The invariant of shared/seeds/003: a stage must compute every position
        # it received, never a suffix — else the next stage would attend over a
        # prefix it never got. The seed allows a short output on the stage that
        # owns layer 0 (suffix-only prefill after a prefix-cache hit); this
        # implementation has no prefix cache, so it holds every stage to it.
        # Checked explicitly, not with ``assert``: it must hold under ``-O`` too.
        if x.shape[0] != batch.rows:
            raise StageInvariantError(
                f"layers {self.weights.layers.start}..{self.weights.layers.stop - 1} computed "
                f"{x.shape[0]} positions for {batch.rows} tokens received; non-first stages "
                "must execute the full range"
            )
        if not self.last:
            batch.finish(
                [x[lo:hi].reshape(e.batch, e.tokens, hidden) for e, lo, hi in batch.spans()]
            )
            return batch
        assert self.weights.norm is not None and self.weights.lm_head is not None
        final = rms_norm(x[batch.last_rows()], self.weights.norm, self.config.rms_norm_eps)
        heads = batch.head_rows()
        logits = linear(final, self.weights.lm_head, None, heads)
        batch.finish(
            [e.head_output(logits[lo:hi]) for (lo, hi), e in zip(heads, batch.running, strict=True)]
        )
        return batch

    def score(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        """Every position's next-token logits, float32 ``[batch, tokens, vocab]``, of
        a whole-model stage (first and last) over a fresh ``cache`` — for
        measuring one engine against another (``meshnet_model.testing.quality``)."""
        if not (self.first and self.last):
            raise StageInvariantError("score needs a stage with every layer")
        batch = PackedBatch([BatchEntry(ids, cache, 0)])
        if not batch.running:
            batch.result()  # its error
        x = self._layers(self.embed(ids).reshape(-1, self.config.hidden_size), batch)
        cache.length = ids.shape[1]
        assert self.weights.norm is not None and self.weights.lm_head is not None
        logits = linear(
            rms_norm(x, self.weights.norm, self.config.rms_norm_eps), self.weights.lm_head
        )
        return logits.reshape(*ids.shape, -1)

    def _layers(self, x: np.ndarray, batch: PackedBatch[KVCache]) -> np.ndarray:
        """The layers over packed rows ``[rows, hidden]``; an entry that must stop
        (``check_stops``) leaves with its rows."""
        c = self.config
        ropes = [self.rope.cos_sin(e.position, e.tokens) for e in batch.running]
        blocks = batch.entry_rows()
        for i, block in enumerate(self.weights.blocks):
            kept = batch.check_stops()
            if kept is not None:
                if not batch.running:
                    return x[:0]
                x = _pack([x[lo:hi] for lo, hi in kept])
                ropes = [self.rope.cos_sin(e.position, e.tokens) for e in batch.running]
                blocks = batch.entry_rows()
            layer = self.weights.layers.start + i
            rotates, window = c.layer_rotates(layer), c.layer_window(layer)
            h = rms_norm(x, block.input_norm, c.rms_norm_eps)
            q, k, v = project_qkv(h, block, blocks)
            heads = [
                attend(
                    q[lo:hi],
                    k[lo:hi],
                    v[lo:hi],
                    block,
                    c,
                    rope if rotates else None,
                    e.cache.keys[i],
                    e.cache.values[i],
                    e.position,
                    window,
                    batch=e.batch,
                    block_size=e.query_block,
                )
                for (e, lo, hi), rope in zip(batch.spans(), ropes, strict=True)
            ]
            x = x + linear(_pack(heads), block.o, block.o_bias, blocks)
            h = rms_norm(x, block.post_norm, c.rms_norm_eps)
            x = x + mlp(h, block, blocks)
        return x


def _pack(parts: list[np.ndarray]) -> np.ndarray:
    """Rows one after another (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
