"""The bytes each tensor of a model takes in the form an engine holds it,
from the checkpoint's headers alone (no tensor is read).

``held_matrix`` is the one table of held forms (docs/models.md);
``model_bytes`` adds a model's parts up under one engine and dtype. The
footprint of a stage (``footprint``) is built on these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..formats.config import ModelConfig
from ..formats.gguf.checkpoint import hf_name, is_gguf
from ..formats.gguf.file import GGUFFile
from ..formats.gguf.quants import GGML_TYPES
from ..formats.safetensors import Checkpoint
from ..source import load_config
from .torch.qlinear import held_form, stacks
from .torch.qlinear import held_matrix_bytes as torch_held_bytes

__all__ = ["ENGINES", "DTYPES", "ModelBytes", "held_matrix", "held_matrix_bytes", "model_bytes"]

ENGINES = ("numpy", "torch")
DTYPES = ("keep", "float32", "bfloat16", "float16")
# The torch engine's quantized held forms are engines/torch/qlinear's
# (``held_form``, ``held_matrix_bytes``): int4pack for Q4_0/Q4_1/Q4_K, two
# int4pack halves for Q8_0, dense bfloat16 for the rest.
_GGML = {t.name: t for t in GGML_TYPES.values()}
_ITEMSIZE = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _is_float(kind: str) -> bool:
    return kind in _ITEMSIZE


def held_matrix(
    engine: str, dtype: str, kind: str, rows: int, cols: int, *, quantized_file: bool = False
) -> tuple[str, int]:
    """(form, bytes) of a ``[rows, cols]`` matrix stored as ``kind`` (a GGML type
    name such as ``Q4_K``/``F16``, or a numpy float dtype name), held by
    ``engine`` with ``--dtype dtype``. ``quantized_file``: the file's projection
    matrices are quantized (torch ``keep`` then holds float matrices as bf16).
    The single table of held forms (docs/models.md)."""
    n, k = rows, cols
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype != "keep":
        return dtype, _DTYPE_BYTES[dtype] * n * k
    if engine == "numpy":  # keep: floats as they are, quantized dequantized to float32
        if _is_float(kind):
            return kind.lower(), _ITEMSIZE[kind] * n * k
        return "float32", 4 * n * k
    if not _is_float(kind):
        if kind not in _GGML:  # a type no reader here decodes: refused at load
            return kind, 2 * n * k
        ggml = _GGML[kind]
        form = held_form(ggml, (n, k))
        return ("bfloat16" if form == "dense" else form), torch_held_bytes(ggml, (n, k))
    if quantized_file:
        return "bfloat16", 2 * n * k
    return kind.lower(), _ITEMSIZE[kind] * n * k


def held_matrix_bytes(
    engine: str, dtype: str, kind: str, rows: int, cols: int, *, quantized_file: bool = False
) -> int:
    return held_matrix(engine, dtype, kind, rows, cols, quantized_file=quantized_file)[1]


@dataclass(frozen=True, slots=True)
class _Tensor:
    kind: str  # GGML type name or numpy dtype name
    shape: tuple[int, ...]  # numpy order: [rows, cols]
    file_bytes: int


def _tensors(path: str | Path) -> dict[str, _Tensor]:
    """Every tensor's type, shape and stored bytes by HF name, from the headers."""
    if is_gguf(path):
        file = GGUFFile(path)
        found = {}
        for tensor in file.tensors.values():
            name = hf_name(tensor.name)
            if name is not None:
                kind = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
                found[name] = _Tensor(kind, file.shape(tensor.name), int(tensor.n_bytes))
        return found
    ckpt = Checkpoint(path)
    found = {}
    for name in ckpt.weight_map:
        f = ckpt.file_for(name)
        dtype, shape = f.dtype(name), tuple(f.shape(name))
        found[name] = _Tensor(dtype.name, shape, math.prod(shape) * dtype.itemsize)
    return found


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """Held bytes of a model's parts under one engine and dtype."""

    config: ModelConfig
    engine: str
    dtype: str
    quantized: bool  # the file's projection matrices are quantized
    embed: int  # the first stage's embedding
    layers: list[int]  # each decoder layer
    head: int  # the last stage's norm and head
    head_shares_embed: bool  # on a one-stage model, the head is the embedding's memory
    forms: list[frozenset[str]]  # each layer's matrix forms
    head_form: str

    def weights(self, layers: range, *, first: bool | None = None, last: bool | None = None) -> int:
        first = layers.start == 0 if first is None else first
        last = layers.stop == self.config.num_hidden_layers if last is None else last
        total = sum(self.layers[layers.start : layers.stop])
        total += self.embed if first else 0
        if last:
            total += self.head - (self.embed_matrix if first and self.head_shares_embed else 0)
        return total

    @property
    def embed_matrix(self) -> int:
        return self.embed

    def form(self, layers: range) -> str:
        forms = set().union(*self.forms[layers.start : layers.stop])
        return "+".join(sorted(forms)) or self.head_form


def _stack(parts: list[_Tensor]) -> _Tensor | None:
    """Matrices of one quantized type stacked by rows, as the torch loader holds
    q/k/v and gate/up — or None where it holds them apart (mixed types, a
    stack no kernel reads)."""
    if not parts or any(t.kind not in _GGML for t in parts):
        return None
    shape = (sum(t.shape[0] for t in parts), parts[0].shape[1])
    if not stacks([_GGML[t.kind] for t in parts], shape):
        return None
    return _Tensor(parts[0].kind, shape, sum(t.file_bytes for t in parts))


def _vector_bytes(t: _Tensor) -> int:
    return 4 * math.prod(t.shape)


def model_bytes(
    path: str | Path, engine: str, dtype: str, config: ModelConfig | None = None
) -> ModelBytes:
    """The held bytes of every part of the model at ``path`` (headers only)."""
    config = config or load_config(path)
    tensors = _tensors(path)
    quantized = any(
        not _is_float(t.kind)
        for name, t in tensors.items()
        if name.startswith("model.layers.") and any(p in name for p in _PROJECTIONS)
    )

    def matrix(t: _Tensor) -> tuple[str, int]:
        rows, cols = t.shape if len(t.shape) == 2 else (math.prod(t.shape), 1)
        return held_matrix(engine, dtype, t.kind, rows, cols, quantized_file=quantized)

    stacks = engine == "torch" and dtype == "keep" and quantized
    layers, forms = [], []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        total, kinds = 0, set()
        matrices = {n: t for n, t in tensors.items() if n.startswith(prefix) and len(t.shape) == 2}
        if stacks:  # the loader stacks q/k/v and gate/up into one matrix when it can
            for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
                members = [n for n in matrices if any(f".{g}." in n for g in group)]
                stacked = _stack([matrices[n] for n in members])
                if len(members) == len(group) and stacked is not None:
                    form, size = matrix(stacked)
                    total += size
                    kinds.add(form)
                    for n in members:
                        del matrices[n]
        for name, t in tensors.items():
            if not name.startswith(prefix):
                continue
            if len(t.shape) == 2:
                if name not in matrices:
                    continue  # held stacked
                form, size = matrix(t)
                total += size
                kinds.add(form)
            else:  # norm weights and biases: float32
                total += _vector_bytes(t)
        layers.append(total)
        forms.append(frozenset(kinds))
    embed_t = tensors.get("model.embed_tokens.weight")
    embed = 0
    if embed_t is not None:
        # torch keep maps the embedding in its file form; otherwise a matrix.
        keep_mapped = engine == "torch" and dtype == "keep"
        embed = embed_t.file_bytes if keep_mapped else matrix(embed_t)[1]
    tied = config.tie_word_embeddings or "lm_head.weight" not in tensors
    head_t = embed_t if tied else tensors["lm_head.weight"]
    head_form, head = matrix(head_t) if head_t is not None else ("none", 0)
    norm = tensors.get("model.norm.weight")
    head += _vector_bytes(norm) if norm is not None else 0
    # A tied head is the embedding's own memory, except where torch keep holds
    # the head quantized beside the mapped embedding.
    shares = tied and not (engine == "torch" and dtype == "keep" and quantized)
    return ModelBytes(
        config, engine, dtype, quantized, embed, layers, head, shares, forms, head_form
    )
