"""One stage's tensors as torch tensors on the target device, in the target dtype.

Three loaders:

* ``gguf_weights`` — a GGUF file, tensor by tensor from its blocks: held
  quantized (``qlinear``) or dequantized to a dense dtype, a chunk of rows at
  a time, the embedding kept mapped in its file form (``MappedEmbedding``);
* ``converted_weights`` — a safetensors checkpoint converted to another
  dtype, tensor by tensor, read (not mapped) and dropped;
* ``TorchStageWeights.from_numpy`` — a checkpoint already in the target
  dtype (or on another device), below.

For ``from_numpy`` the checkpoint is read by the numpy loader with
``dtype="keep"``: every matrix a read-only view on the file's memory map,
never converted there. A matrix is then handed to torch:

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

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import ml_dtypes
import numpy as np

from ...formats.config import ModelConfig
from ...formats.gguf.blocks import dequantize_rows, row_chunks
from ...formats.gguf.checkpoint import GGUFCheckpoint
from ...formats.gguf.quants import GGMLType
from ...formats.safetensors import Checkpoint
from ...stage.weights import (
    LayerWeights,
    StageWeights,
    TensorSpec,
    check_shape,
    head_is_tied,
    layer_tensors,
)
from .qlinear import KERNEL_DTYPE, Int4Matrix, quantized_matrix, stacks

__all__ = [
    "MappedEmbedding",
    "TorchLayer",
    "TorchStageWeights",
    "converted_weights",
    "gguf_weights",
    "mapped_embedding",
    "to_torch",
]

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
    # A quantized stage multiplies q, k and v (gate and up) by one kernel call:
    # their rows stacked in one matrix, and the separate fields None.
    qkv: Any = None
    gate_up: Any = None


@dataclass(slots=True)
class TorchStageWeights:
    blocks: list[TorchLayer]
    embed: Any  # [vocab, hidden] on the first stage, else None
    norm: Any
    lm_head: Any  # the embedding itself when tied
    dtype: Any  # the torch dtype everything is held and computed in
    device: Any
    shared_with_file: int  # bytes used straight from a memory map (no copy)
    # Where the held forms came from or went (``weight_cache.CacheStatus``):
    # None when no weights cache was asked for.
    cache: Any = None

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
                held = isinstance(t, Int4Matrix | MappedEmbedding)
                total += t.nbytes if held else t.numel() * t.element_size()
        return total

    def cache_report(self) -> dict[str, Any]:
        """``/info``'s ``weights_cache``: the cache's state for this stage."""
        return {"state": "off"} if self.cache is None else self.cache.report()

    def all_int4(self) -> bool:
        """Whether every product of the stage (its layers' and its head) is by
        the int4pack kernel, which computes each row on its own (``stage.batch``)."""
        products = [self.lm_head] if self.lm_head is not None else []
        for block in self.blocks:
            matrices = (
                block.q,
                block.k,
                block.v,
                block.o,
                block.gate,
                block.up,
                block.down,
                block.qkv,
                block.gate_up,
            )
            products += [m for m in matrices if m is not None]
        return bool(products) and all(isinstance(m, Int4Matrix) for m in products)

    def held_forms(self) -> dict[str, int]:
        """Matrices by the form they are held in (``int4pack(Q4_1)``,
        ``int4pack x2(Q8_0)``, ``mapped(Q8_0)`` for a file-form embedding, or a
        torch dtype's name), a stacked q/k/v or gate/up counting once."""
        forms: dict[str, int] = {}
        tensors = [self.embed, self.lm_head]
        for block in self.blocks:
            tensors += [
                block.q,
                block.k,
                block.v,
                block.o,
                block.gate,
                block.up,
                block.down,
                block.qkv,
                block.gate_up,
            ]
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, Int4Matrix):
                name = f"{t.form}({t.source})"
            elif isinstance(t, MappedEmbedding):
                name = f"mapped({t.kind.name})"
            else:
                name = str(t.dtype).removeprefix("torch.")
            forms[name] = forms.get(name, 0) + 1
        return forms

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


@dataclass(frozen=True, slots=True)
class MappedEmbedding:
    """The token embedding in its file form, memory-mapped: a lookup decodes only
    the rows it asks for, so the stage holds the pages of the tokens it has seen
    (never a float copy of the whole table)."""

    rows: np.ndarray  # uint8 [vocab, row_bytes], a view of the file's mapping
    kind: GGMLType
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def lookup(self, torch: Any, ids: np.ndarray, dtype: Any, device: Any) -> Any:
        picked = self.rows[ids.reshape(-1)]
        values = dequantize_rows(picked, self.kind, self.shape[1])
        tensor = torch.from_numpy(values).to(device=device, dtype=dtype)
        return tensor.reshape(*ids.shape, self.shape[1])


def gguf_weights(
    torch: Any,
    ckpt: GGUFCheckpoint,
    config: ModelConfig,
    layers: range,
    *,
    dtype: Any,
    device: Any,
    quantized: bool,
) -> TorchStageWeights:
    """One stage of a GGUF file, tensor by tensor, straight from its blocks.

    ``quantized``: every quantized matrix in its held form (``qlinear``), the
    embedding mapped in its file form; otherwise every matrix dequantized to
    ``dtype``, a chunk of rows at a time. Either way no tensor is ever widened
    whole, so the peak of the load is the result plus one tensor's bytes.

    The conversions run on one torch thread: they are many small ops, and
    torch's pool over them cost twice the time of one thread (measured on
    2 cores: 0.19 against 0.10 s for an 8192 x 2048 Q4_0 matrix).
    """
    with _one_torch_thread(torch):
        c = config
        read = _GGUFTensors(torch, ckpt, dtype=dtype, device=device, quantized=quantized)
        blocks = [read.layer(c, i) for i in layers]
        first, last = layers.start == 0, layers.stop == c.num_hidden_layers
        tied = head_is_tied(c, ckpt)
        embed_name, embed_shape = "model.embed_tokens.weight", (c.vocab_size, c.hidden_size)
        embed = norm = lm_head = None
        if first:
            embed = mapped_embedding(ckpt, c) if quantized else None
            if embed is None:
                embed = read.matrix(embed_name, embed_shape)
        if last:
            norm = read.vector("model.norm.weight", (c.hidden_size,))
            if tied and isinstance(embed, MappedEmbedding | type(None)):
                lm_head = read.matrix(embed_name, embed_shape)
            elif tied:
                lm_head = embed  # one dense tensor for both
            else:
                lm_head = read.matrix("lm_head.weight", embed_shape)
        return TorchStageWeights(blocks, embed, norm, lm_head, dtype, device, 0)


def mapped_embedding(ckpt: GGUFCheckpoint, config: ModelConfig) -> MappedEmbedding | None:
    """The token embedding in its file form, mapped — or None when its type is
    a plain float one (held as a matrix then)."""
    name, shape = "model.embed_tokens.weight", (config.vocab_size, config.hidden_size)
    kind = ckpt.kind(name)
    if kind.view is not None:
        return None
    mapped = ckpt.mapped_rows(name)
    check_shape(name, (mapped.shape[0], shape[1]), shape)
    return MappedEmbedding(mapped, kind, shape)


@contextlib.contextmanager
def _one_torch_thread(torch: Any) -> Iterator[None]:
    """torch computing on one thread within the block (the load's conversions)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _GGUFTensors:
    """A GGUF file's tensors as ``gguf_weights`` holds them (its docstring)."""

    def __init__(
        self, torch: Any, ckpt: GGUFCheckpoint, *, dtype: Any, device: Any, quantized: bool
    ):
        self.torch, self.ckpt = torch, ckpt
        self.dtype, self.device, self.quantized = dtype, device, quantized
        self.kernel_dtype = getattr(torch, KERNEL_DTYPE)

    def layer(self, c: ModelConfig, i: int) -> TorchLayer:
        """Decoder layer ``i``: q/k/v and gate/up stacked where a kernel reads them so."""
        fields: dict[str, Any] = {}
        specs = {spec.field: spec for spec in layer_tensors(c, i)}
        for fused, names in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
            held = self.stacked([specs[n] for n in names])
            if held is not None:
                fields[fused] = held
                for n in names:
                    fields[n] = None
                    del specs[n]
        for spec in specs.values():
            if not spec.wanted:
                fields[spec.field] = None
            elif spec.matrix:
                fields[spec.field] = self.matrix(spec.name, spec.shape)
            else:
                fields[spec.field] = self.vector(spec.name, spec.shape)
        return TorchLayer(**fields)

    def stacked(self, specs: list[TensorSpec]) -> Any:
        """One quantized matrix of the specs' rows stacked, or None when they
        are not all of one type a kernel reads (each is then held alone)."""
        if not self.quantized or self.device.type != "cpu":
            return None
        kinds = [self.ckpt.kind(spec.name) for spec in specs]
        shape = (sum(spec.shape[0] for spec in specs), specs[0].shape[1])
        if not stacks(kinds, shape):
            return None
        parts = []
        for spec in specs:
            _, stored, blocks = self.ckpt.raw(spec.name)
            check_shape(spec.name, stored, spec.shape)
            parts.append(blocks)
        return quantized_matrix(
            self.torch, kinds[0], shape, np.concatenate(parts), compute=self.kernel_dtype
        )

    def matrix(self, name: str, shape: tuple[int, ...]) -> Any:
        torch, quantized, device = self.torch, self.quantized, self.device
        kind, stored, blocks = self.ckpt.rows(name)  # read a chunk of rows at a time
        check_shape(name, stored, shape)
        rows, cols = shape
        if quantized and kind.view is None and device.type == "cpu":
            held = quantized_matrix(torch, kind, (rows, cols), blocks, compute=self.kernel_dtype)
            if held is not None:
                return held
        # Dense: what was asked for, or (held quantized) the kernels' dtype.
        target = self.kernel_dtype if quantized and kind.view is None else self.dtype
        dense = torch.empty((rows, cols), dtype=target)
        for part in row_chunks(rows, 1024):
            dense[part] = torch.from_numpy(dequantize_rows(blocks[part], kind, cols)).to(target)
        return dense if device.type == "cpu" else dense.to(device)

    def vector(self, name: str, shape: tuple[int, ...]) -> Any:
        array = self.ckpt.tensor(name)
        check_shape(name, array.shape, shape)
        values = np.array(array, dtype=np.float32)  # a writable copy: a few KiB
        return self.torch.from_numpy(values).to(device=self.device, dtype=self.dtype)


def converted_weights(
    torch: Any, ckpt: Checkpoint, config: ModelConfig, layers: range, *, dtype: Any, device: Any
) -> TorchStageWeights:
    """A safetensors stage converted to ``dtype``, tensor by tensor: each is read
    (not mapped), converted and dropped before the next. Converting views of
    the file's mapping instead leaves every page it touched counted in the
    stage's RSS while the mapping lives — a float32 checkpoint held as
    bfloat16 then costs both."""

    def read(name: str, shape: tuple[int, ...]) -> Any:
        array = ckpt.read(name)
        check_shape(name, array.shape, shape)
        return to_torch(torch, array).to(device=device, dtype=dtype)

    c = config
    blocks = []
    for i in layers:
        fields = {
            spec.field: read(spec.name, spec.shape) if spec.wanted else None
            for spec in layer_tensors(c, i)
        }
        blocks.append(TorchLayer(**fields))
    first, last = layers.start == 0, layers.stop == c.num_hidden_layers
    tied = head_is_tied(c, ckpt)
    shape = (c.vocab_size, c.hidden_size)
    embed = read("model.embed_tokens.weight", shape) if first or (last and tied) else None
    norm = lm_head = None
    if last:
        norm = read("model.norm.weight", (c.hidden_size,))
        lm_head = embed if tied else read("lm_head.weight", shape)
    return TorchStageWeights(blocks, embed if first else None, norm, lm_head, dtype, device, 0)
