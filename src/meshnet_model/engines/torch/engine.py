"""The torch engine: one stage's forward pass behind the same ``StageRunner``.

``TorchStageModel`` has the numpy ``StageModel``'s interface — ``first``,
``last``, ``new_cache(budget, batch)``, ``forward(inputs, cache, position)``
taking and returning numpy arrays — so the runner (sessions, positions, the
KV budget, locking) and the node do not know which engine computes.

Outputs: hidden states in the compute dtype (a bf16 stage hands bf16 to the
codec, which sends it as is under ``--wire-dtype keep`` — no float32 round
trip); the last stage's logits as float32, as transformers' ``generate``
reads them and as the numpy engine returns them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import StageInvariantError
from ...formats.config import ModelConfig
from ...formats.gguf.checkpoint import GGUFCheckpoint
from ...formats.safetensors import Checkpoint
from ...progress import NO_PROGRESS, LoadProgress
from ...source import is_gguf, load_config, model_name
from ...stage.batch import ATTENTION_BLOCK, BatchEntry, PackedBatch
from ...stage.kv_cache import KVBudget
from ...stage.runner import (
    DEFAULT_KV_BUDGET,
    DEFAULT_MAX_CHUNK_TOKENS,
    DEFAULT_MAX_COMPUTE_BYTES,
    StageRunner,
)
from ...stage.weights import StageWeights, head_is_tied
from ..core_ledger import step_threads
from ._torch import COMPUTE_DTYPES, check_device, import_torch
from .calibrate import choose_kernels
from .dense_tiles import TILE_ROWS, StepRows, dense_tile_rows
from .kv_cache import TorchKVCache
from .layers import (
    RopeTable,
    attend,
    avoid_planned_attention,
    fused_rms_norm,
    mlp,
    product,
    project_qkv,
    rms_norm,
    rotate,
)
from .qlinear import linear
from .transfer import Transfer
from .weight_cache import cached_gguf_weights
from .weights import MappedEmbedding, TorchStageWeights, converted_weights

__all__ = ["TorchStageModel", "load_torch_runner"]


class TorchStageModel:
    # Query rows scored at once, in aligned blocks (stage.batch, costs.chunk_cost).
    query_block: int | None = ATTENTION_BLOCK
    # Compute threads (None: torch's default). Under OpenMP the count is a
    # setting of the calling thread, so forward() applies it in the worker
    # thread that runs it; set in the main thread only, a worker would spin
    # a pool over every core (measured: 2 cores busy with threads=1).
    threads: int | None = None

    def __init__(
        self,
        torch: Any,
        weights: StageWeights,
        *,
        dtype: str = "keep",
        device: str = "cpu",
        transfer: Transfer | None = None,
        held: TorchStageWeights | None = None,
    ) -> None:
        """``weights``: the stage's numpy tensors, converted here — or, with
        ``held`` (tensors already in their torch form, ``gguf_weights``), only
        its shape."""
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
        check_device(torch, device)
        self.torch = torch
        self.config: ModelConfig = weights.config
        self.layers = weights.layers
        self.first, self.last = weights.first, weights.last
        self.device = torch.device(device)
        avoid_planned_attention(torch, self.device)
        # transformers' order of operations, except in a quantized stage.
        self.norm: Any = rms_norm
        if held is not None:
            if held.dtype == torch.float32 and any(
                "int4pack" in form for form in held.held_forms()
            ):
                self.norm = fused_rms_norm
            self.dtype = held.dtype
            self.dtype_name = str(held.dtype).removeprefix("torch.")
            self.weights = held
            self.weights_dtype = "+".join(sorted(held.held_forms()))
        else:
            if dtype == "keep":
                kept = weights.blocks[0].q.dtype.name
                dtype = kept if kept in ("bfloat16", "float16") else "float32"
            self.dtype_name = dtype
            self.weights_dtype = dtype
            self.dtype = getattr(torch, dtype)
            self.weights = TorchStageWeights.from_numpy(
                torch, weights, dtype=self.dtype, device=self.device
            )
        self.rope = RopeTable(torch, self.config, self.dtype, self.device)
        # Every product by the int4pack kernel, which computes each row on its
        # own: batched entries share them, and chunks may be cut into pieces.
        self.row_invariant = self.weights.all_int4()
        # A quantized CPU stage's prompt tiles: int4pack or the dense GEMM,
        # timed at load (calibrate); the scheduler then cuts no tile.
        quantized = held is not None and any("int4pack" in f for f in held.held_forms())
        self.kernels = choose_kernels(torch) if quantized and self.device.type == "cpu" else None
        self.dense = None if self.kernels is None else self.kernels.dense_tiles()
        self.piece_tile: int | None = TILE_ROWS if self.dense is not None else None
        self.transfer = transfer or Transfer(torch, self.device)

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one cached key or value element (the compute dtype's): asked
        at every chunk's head check, so read off the dtype, not a tensor."""
        return int(self.dtype.itemsize)

    def new_cache(self, budget: KVBudget, batch: int) -> TorchKVCache:
        c = self.config
        cache = TorchKVCache(
            self.torch,
            budget,
            layers=len(self.layers),
            batch=batch,
            kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        cache.staging = self.transfer.new_staging()
        return cache

    def forward(
        self,
        inputs: np.ndarray,
        cache: TorchKVCache,
        position: int,
        *,
        between_layers: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """As ``StageModel.forward``: the chunk's layers at ``position``; the
        cache holds ``position + tokens`` after. ``between_layers`` is called
        before each layer and may raise to stop the compute (the runner's
        deadline and session-life check); the cache then keeps ``position``.
        A batch of one ``forward_batch``."""
        entry = BatchEntry(inputs, cache, position, between_layers)
        return self.forward_batch([entry]).result()

    def forward_batch(
        self, entries: Sequence[BatchEntry[TorchKVCache]]
    ) -> PackedBatch[TorchKVCache]:
        """As ``StageModel.forward_batch``: several sessions' chunks in one pass,
        each int4pack product over all their rows, a dense one per chunk (not
        row-invariant, ``stage.batch``), attention per chunk."""
        t = self.torch
        threads = step_threads(self.threads)  # a shared core ledger's grant (core_ledger)
        if threads is not None:
            t.set_num_threads(threads)
        batch = PackedBatch(entries)
        if not batch.running:
            return batch
        hidden = self.config.hidden_size
        with t.inference_mode():
            rows = [
                self._embed(e.inputs)
                if self.first
                else self.transfer.to_device(e.inputs, self.dtype)
                for e in batch.running
            ]
            x = _pack(t, [r.reshape(-1, hidden) for r in rows])
            x = self._layers(x, batch)
            if not batch.running:  # every entry stopped between layers
                return batch
            if x.shape[0] != batch.rows:  # the seed's invariant, as in the numpy engine
                raise StageInvariantError(
                    f"layers {self.layers.start}..{self.layers.stop - 1} computed {x.shape[0]} "
                    f"positions for {batch.rows} tokens received"
                )
            if not self.last:
                batch.finish(
                    [
                        self.transfer.to_host(
                            x[lo:hi].reshape(e.batch, e.tokens, hidden), e.cache.staging
                        )
                        for e, lo, hi in batch.spans()
                    ]
                )
                return batch
            w = self.weights
            final = self.norm(t, x[batch.last_rows()], w.norm, self.config.rms_norm_eps)
            heads = batch.head_rows()
            logits = product(t, final, w.lm_head, None, heads).float()
            batch.finish(
                [
                    e.head_output(self.transfer.to_host(logits[lo:hi], e.cache.staging))
                    for (lo, hi), e in zip(heads, batch.running, strict=True)
                ]
            )
        return batch

    def score(self, ids: np.ndarray, cache: TorchKVCache) -> np.ndarray:
        """Every position's next-token logits, float32 ``[batch, tokens, vocab]``, of
        a whole-model stage over a fresh ``cache`` (as ``StageModel.score``)."""
        if not (self.first and self.last):
            raise StageInvariantError("score needs a stage with every layer")
        t = self.torch
        batch = PackedBatch([BatchEntry(ids, cache, 0)])
        if not batch.running:
            batch.result()  # its error
        with t.inference_mode():
            x = self._layers(self._embed(ids).reshape(-1, self.config.hidden_size), batch)
            cache.length = ids.shape[1]
            w = self.weights
            final = self.norm(t, x, w.norm, self.config.rms_norm_eps)
            logits: np.ndarray = linear(t, final, w.lm_head).float().cpu().numpy()
            return logits.reshape(*ids.shape, -1)

    def _embed(self, ids: np.ndarray) -> Any:
        """Token ids → hidden states in the compute dtype (a mapped file-form
        embedding decodes only the rows asked for)."""
        t = self.torch
        if isinstance(self.weights.embed, MappedEmbedding):
            return self.weights.embed.lookup(t, ids, self.dtype, self.device)
        on_device = self.transfer.to_device(ids, t.long)
        return t.nn.functional.embedding(on_device, self.weights.embed).to(self.dtype)

    def _layers(self, x: Any, batch: PackedBatch[TorchKVCache]) -> Any:
        """The layers over packed rows ``[rows, hidden]``; an entry that must stop
        (``check_stops``) leaves with its rows."""
        c, t = self.config, self.torch
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rope = self._rope_rows(batch)
        blocks = self._step_rows(batch)
        for i, block in enumerate(self.weights.blocks):
            kept = batch.check_stops()
            if kept is not None:
                if not batch.running:
                    return x[:0]
                x = _pack(t, [x[lo:hi] for lo, hi in kept])
                rope = self._rope_rows(batch)
                blocks = self._step_rows(batch)
            layer = self.layers.start + i
            window = c.layer_window(layer)
            h = self.norm(t, x, block.input_norm, c.rms_norm_eps)
            q, k, v = project_qkv(t, h, block, c, blocks)
            rows = q.shape[0]
            # Norm and rope of every chunk's rows at once: per-op overhead is most
            # of a decode step's attention, and these are element by element.
            q, k = rotate(
                t,
                q.reshape(rows, heads, d),
                k.reshape(rows, kv_heads, d),
                block,
                c,
                rope if c.layer_rotates(layer) else None,
            )
            v = v.reshape(rows, kv_heads, d)
            outs = [
                attend(
                    t,
                    q[lo:hi],
                    k[lo:hi],
                    v[lo:hi],
                    c,
                    e.cache.keys[i],
                    e.cache.values[i],
                    e.position,
                    window,
                    batch=e.batch,
                    block_size=e.query_block,
                )
                for e, lo, hi in batch.spans()
            ]
            x = x + product(t, _pack(t, outs), block.o, block.o_bias, blocks)
            h = self.norm(t, x, block.post_norm, c.rms_norm_eps)
            x = x + mlp(t, h, block, blocks)
        return x

    def _step_rows(self, batch: PackedBatch[TorchKVCache]) -> list[tuple[int, int]]:
        """Each entry's rows, and the step's dense tiles where the stage takes them."""
        rows = batch.entry_rows()
        return rows if self.dense is None else StepRows(rows, dense_tile_rows(batch), self.dense)

    def _rope_rows(self, batch: PackedBatch[TorchKVCache]) -> tuple[Any, Any]:
        """Each packed row's (cos, sin) ``[rows, 1, d]``: its chunk's positions,
        repeated over the chunk's batch rows."""
        t = self.torch
        cos, sin = [], []
        for e in batch.running:
            c, s = self.rope.get(e.position, e.tokens)
            cos.append(c.repeat(e.batch, 1) if e.batch > 1 else c)
            sin.append(s.repeat(e.batch, 1) if e.batch > 1 else s)
        return _pack(t, cos)[:, None, :], _pack(t, sin)[:, None, :]

    def describe(self) -> dict[str, Any]:
        hidden = f"{self.dtype_name} hidden [batch, tokens, {self.config.hidden_size}]"
        return {
            **({} if self.last else {"output": hidden}),  # the wire sends it as is (keep)
            "engine": "torch",
            "device": str(self.device),
            "compute_dtype": self.dtype_name,
            "weights_dtype": self.weights_dtype,
            "weights_held": self.weights.held_forms(),
            "weights_bytes": self.weights.nbytes,
            "weights_mapped_bytes": self.weights.shared_with_file,
            "weights_cache": self.weights.cache_report(),
            "threads": self.threads or self.torch.get_num_threads(),
            "torch_threads": self.threads or self.torch.get_num_threads(),
            **({"kernels": self.kernels.describe()} if self.kernels is not None else {}),
        }


def load_torch_runner(
    directory: str | Path,
    layers: range | None = None,
    *,
    dtype: str = "keep",
    device: str = "cpu",
    threads: int | None = None,
    kv_budget_bytes: int = DEFAULT_KV_BUDGET,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    max_compute_bytes: int = DEFAULT_MAX_COMPUTE_BYTES,
    config: ModelConfig | None = None,
    transfer: Transfer | None = None,
    progress: LoadProgress = NO_PROGRESS,
    weights_cache: str = "off",
) -> StageRunner:
    """A ``StageRunner`` computing with torch (``meshnet-node --engine torch``).

    ``progress``: told the stored bytes of each tensor as it is read.
    ``weights_cache``: ``--weights-cache`` (``weight_cache``): off, auto or a directory.

    Raises ``ValueError`` with one line for the command line: torch missing
    (naming the extra), a CUDA device this machine lacks, a bad checkpoint.
    """
    torch = import_torch()
    check_device(torch, device)  # before reading gigabytes of weights
    if threads is not None:
        torch.set_num_threads(threads)  # this thread's; forward() sets its worker's
    path = Path(directory)
    if is_gguf(path):
        model, mapped = _gguf_model(
            torch,
            path,
            layers,
            config,
            dtype=dtype,
            device=device,
            transfer=transfer,
            progress=progress,
            weights_cache=weights_cache,
        )
    else:
        # Mapping reads nothing yet: its bytes count as read only if the stage
        # keeps the map; a converted stage counts them as it reads them below.
        mapped_bytes = _Tally()
        mapped = StageWeights.load(path, layers, dtype="keep", config=config, progress=mapped_bytes)
        held = mapped.blocks[0].q.dtype.name
        if dtype not in ("keep", held):
            # Converted: read tensor by tensor instead of from the mapping (whose
            # touched pages would stay in the RSS beside the converted copy).
            span = mapped.layers
            mapped = dataclasses.replace(mapped, blocks=[], embed=None, norm=None, lm_head=None)
            dev = torch.device(device)
            weights = converted_weights(
                torch,
                Checkpoint(path, progress=progress),
                mapped.config,
                span,
                dtype=getattr(torch, dtype),
                device=dev,
            )
            model = TorchStageModel(
                torch, mapped, dtype=dtype, device=device, transfer=transfer, held=weights
            )
        else:
            progress.on_bytes(mapped_bytes.bytes)
            model = TorchStageModel(torch, mapped, dtype=dtype, device=device, transfer=transfer)
    model.threads = threads
    # The runner needs the stage's shape, not the numpy arrays: dropping them
    # lets a converted stage's map go (only the torch tensors hold memory).
    shape_only = dataclasses.replace(mapped, blocks=[], embed=None, norm=None, lm_head=None)
    return StageRunner(
        shape_only,
        kv_budget_bytes=kv_budget_bytes,
        max_chunk_tokens=max_chunk_tokens,
        max_compute_bytes=max_compute_bytes,
        name=model_name(path),
        path=str(path),
        model=model,
    )


def _gguf_model(
    torch: Any,
    path: Path,
    layers: range | None,
    config: ModelConfig | None,
    *,
    dtype: str,
    device: str,
    transfer: Transfer | None,
    progress: LoadProgress = NO_PROGRESS,
    weights_cache: str = "off",
) -> tuple[TorchStageModel, StageWeights]:
    """A GGUF stage read tensor by tensor from its blocks (``gguf_weights``).

    ``keep`` on a file whose projections are quantized holds them quantized
    (``qlinear``: int4pack, two halves for Q8_0, bfloat16 where no kernel
    reads them), the kernels taking bfloat16 inputs around a float32 stream;
    ``float32``/``bfloat16``/``float16`` dequantize
    every matrix to that dtype. A float file with ``keep`` stays mapped, as a
    safetensors checkpoint does.
    """
    ckpt = GGUFCheckpoint(path, progress=progress)
    config = config or load_config(path)
    span = range(config.num_hidden_layers) if layers is None else layers
    probe = f"model.layers.{span.start}.self_attn.q_proj.weight"
    quantized_file = ckpt.kind(probe).view is None
    if dtype == "keep" and not quantized_file:
        mapped = StageWeights.load(path, span, dtype="keep", config=config, progress=progress)
        return TorchStageModel(torch, mapped, dtype=dtype, device=device, transfer=transfer), mapped
    # Quantized: the kernels take bfloat16 inputs; the residual stream, norms,
    # attention and the KV cache stay float32 (half the KL of an all-bfloat16
    # stage on the real model, at the same speed: docs/models.md).
    compute = "float32" if dtype == "keep" else dtype
    dev = torch.device(device)
    held = cached_gguf_weights(
        weights_cache,
        torch,
        ckpt,
        config,
        span,
        dtype=getattr(torch, compute),
        device=dev,
        quantized=dtype == "keep",
    )
    shape = StageWeights(
        config=config,
        layers=span,
        blocks=[],
        embed=None,
        norm=None,
        lm_head=None,
        dtype="+".join(sorted(held.held_forms())),
        tied_head=span.stop == config.num_hidden_layers and head_is_tied(config, ckpt),
        files=ckpt.files_opened(),
    )
    model = TorchStageModel(
        torch, shape, dtype=compute, device=device, transfer=transfer, held=held
    )
    return model, shape


class _Tally:
    """A ``LoadProgress`` that only adds up the bytes it is told of."""

    def __init__(self) -> None:
        self.bytes = 0

    def on_bytes(self, n: int) -> None:
        self.bytes += n


def _pack(torch: Any, parts: list[Any]) -> Any:
    """Rows one after another (no copy for a single part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)
