"""The tensors one pipeline stage runs, loaded from a checkpoint directory.

A stage owning layers ``start .. end-1`` reads exactly:

* ``model.embed_tokens.weight`` when it owns layer 0 (it embeds token ids);
* ``model.layers.{i}.*`` for its own layers;
* ``model.norm.weight`` and ``lm_head.weight`` when it owns the last layer —
  or ``model.embed_tokens.weight`` in its place when the head is tied
  (``tie_word_embeddings``, or a checkpoint that ships no ``lm_head``).

``dtype`` is what the weights are held in. A checkpoint already in that dtype
stays memory-mapped (no copy at all); otherwise it is converted once at load
time. ``float32`` (the default) is the fastest: compute is float32, so held
half-precision weights are widened before every matmul — about 3x slower
decode on the SmolLM-135M shape here, measured. ``keep`` (the checkpoint's own
dtype, mapped) halves the memory of a bfloat16 checkpoint at that price.
bfloat16 → float32 is exact, so ``keep`` and ``float32`` give the same bits.
Norm weights and biases, tiny, are always float32.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import CheckpointError
from ..formats.config import ModelConfig
from ..progress import NO_PROGRESS, LoadProgress
from ..source import load_config, open_checkpoint

__all__ = ["WEIGHT_DTYPES", "LayerWeights", "StageWeights", "held_tensors", "parse_layers"]

WEIGHT_DTYPES: dict[str, np.dtype | None] = {
    "keep": None,
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


_FLOAT_DTYPES = frozenset(
    np.dtype(t) for t in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16)
)


def parse_layers(text: str, num_layers: int | None = None) -> range:
    """``"A:B"`` → ``range(A, B)``; checked against ``num_layers`` when given."""
    start_text, sep, end_text = text.partition(":")
    if not sep or not start_text.isdigit() or not end_text.isdigit():
        raise ValueError(f"layers must look like A:B (e.g. 0:12), got {text!r}")
    start, end = int(start_text), int(end_text)
    if start >= end:
        raise ValueError(f"layers {text}: the start must be below the end")
    if num_layers is not None and end > num_layers:
        raise ValueError(f"layers {text}: the model has {num_layers} layers (0:{num_layers})")
    return range(start, end)


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer; projection matrices are ``[out, in]`` as in the checkpoint."""

    input_norm: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    o: np.ndarray
    post_norm: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    q_bias: np.ndarray | None = None
    k_bias: np.ndarray | None = None
    v_bias: np.ndarray | None = None
    o_bias: np.ndarray | None = None
    gate_bias: np.ndarray | None = None
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [head_dim], qwen3's per-head RMSNorm of q
    k_norm: np.ndarray | None = None


@dataclass(slots=True)
class StageWeights:
    config: ModelConfig
    layers: range
    blocks: list[LayerWeights]
    embed: np.ndarray | None  # [vocab, hidden] on the first stage
    norm: np.ndarray | None  # [hidden] on the last stage
    lm_head: np.ndarray | None  # [vocab, hidden] on the last stage (maybe the embedding)
    dtype: str  # what the matrices are held in
    tied_head: bool
    files: list[str]

    @property
    def first(self) -> bool:
        return self.layers.start == 0

    @property
    def last(self) -> bool:
        return self.layers.stop == self.config.num_hidden_layers

    @property
    def nbytes(self) -> int:
        arrays = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        total = sum(a.nbytes for a in arrays if a is not None)
        for block in self.blocks:
            total += sum(a.nbytes for a in vars_of(block) if a is not None)
        return total

    @classmethod
    def load(
        cls,
        directory: str | Path,
        layers: range | None = None,
        *,
        dtype: str = "float32",
        config: ModelConfig | None = None,
        mmap: bool = True,
        progress: LoadProgress = NO_PROGRESS,
    ) -> StageWeights:
        """``progress``: told the stored bytes of each tensor as it is read."""
        config = config or load_config(directory)  # a directory or a .gguf file
        layers = range(config.num_hidden_layers) if layers is None else layers
        if not (0 <= layers.start < layers.stop <= config.num_hidden_layers and layers.step == 1):
            raise ValueError(
                f"layers {layers.start}:{layers.stop} do not fit a model of "
                f"{config.num_hidden_layers} layers"
            )
        if dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}")
        target = WEIGHT_DTYPES[dtype]
        ckpt = open_checkpoint(directory, progress=progress)
        c = config
        hidden = c.hidden_size

        def read(name: str, shape: tuple[int, ...], matrix: bool = True) -> np.ndarray:
            array = ckpt.tensor(name, mmap=mmap)
            check_shape(name, array.shape, shape)
            if array.dtype not in _FLOAT_DTYPES:
                raise CheckpointError(f"{name}: dtype {array.dtype} is not a float type")
            if not matrix:
                return np.ascontiguousarray(array, dtype=np.float32)
            if target is None or array.dtype == target:
                return array
            return array.astype(target)

        blocks = []
        for i in layers:
            fields: dict[str, np.ndarray | None] = {}
            for spec in layer_tensors(c, i):
                # Exactly the tensors the family's modeling code has: a bias the
                # config does not ask for is ignored (transformers drops it as an
                # unexpected key), one it asks for must be there.
                wanted = spec.wanted
                fields[spec.field] = read(spec.name, spec.shape, spec.matrix) if wanted else None
            blocks.append(LayerWeights(**fields))  # type: ignore[arg-type]
        first, last = layers.start == 0, layers.stop == c.num_hidden_layers
        tied = head_is_tied(c, ckpt)
        embed_shape = (c.vocab_size, hidden)
        embed = read("model.embed_tokens.weight", embed_shape) if first or (last and tied) else None
        norm = lm_head = None
        if last:
            norm = read("model.norm.weight", (hidden,), matrix=False)
            lm_head = embed if tied else read("lm_head.weight", embed_shape)
        held = {a.dtype.name for b in blocks for a in (b.q, b.k, b.v, b.o)}
        return cls(
            config=c,
            layers=layers,
            blocks=blocks,
            embed=embed if first else None,
            norm=norm,
            lm_head=lm_head,
            dtype=held.pop() if len(held) == 1 else ",".join(sorted(held)),
            tied_head=last and tied,
            files=ckpt.files_opened(),
        )


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor a stage reads: the ``LayerWeights`` field it fills, its
    transformers name and shape, whether it is a matrix (held in the stage's
    dtype) or a vector (norms, biases: float32), and whether the family has it."""

    field: str
    name: str
    shape: tuple[int, ...]
    matrix: bool
    wanted: bool = True


def layer_tensors(c: ModelConfig, i: int) -> list[TensorSpec]:
    """The tensors of decoder layer ``i``, in ``LayerWeights``' field order:
    the one table both engines' loaders read."""
    hidden, heads, kv_heads, d = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    )
    inter = c.intermediate_size
    p = f"model.layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    return [
        TensorSpec("input_norm", p + "input_layernorm.weight", (hidden,), False),
        TensorSpec("q", a + "q_proj.weight", (heads * d, hidden), True),
        TensorSpec("k", a + "k_proj.weight", (kv_heads * d, hidden), True),
        TensorSpec("v", a + "v_proj.weight", (kv_heads * d, hidden), True),
        TensorSpec("o", a + "o_proj.weight", (hidden, heads * d), True),
        TensorSpec("post_norm", p + "post_attention_layernorm.weight", (hidden,), False),
        TensorSpec("gate", m + "gate_proj.weight", (inter, hidden), True),
        TensorSpec("up", m + "up_proj.weight", (inter, hidden), True),
        TensorSpec("down", m + "down_proj.weight", (hidden, inter), True),
        TensorSpec("q_bias", a + "q_proj.bias", (heads * d,), False, c.qkv_bias),
        TensorSpec("k_bias", a + "k_proj.bias", (kv_heads * d,), False, c.qkv_bias),
        TensorSpec("v_bias", a + "v_proj.bias", (kv_heads * d,), False, c.qkv_bias),
        TensorSpec("o_bias", a + "o_proj.bias", (hidden,), False, c.o_bias),
        TensorSpec("gate_bias", m + "gate_proj.bias", (inter,), False, c.mlp_bias),
        TensorSpec("up_bias", m + "up_proj.bias", (inter,), False, c.mlp_bias),
        TensorSpec("down_bias", m + "down_proj.bias", (hidden,), False, c.mlp_bias),
        TensorSpec("q_norm", a + "q_norm.weight", (d,), False, c.qk_norm),
        TensorSpec("k_norm", a + "k_norm.weight", (d,), False, c.qk_norm),
    ]


def check_shape(name: str, stored: tuple[int, ...], shape: tuple[int, ...]) -> None:
    """Refuse a tensor whose stored shape is not the one the config implies
    (every loader, both engines)."""
    if tuple(stored) != tuple(shape):
        raise CheckpointError(
            f"{name}: shape {list(stored)} in the checkpoint, {list(shape)} from its config"
        )


def head_is_tied(c: ModelConfig, ckpt: object) -> bool:
    """A checkpoint without lm_head.weight is tied whatever its config says
    (transformers ties it then too); one with it and tie_word_embeddings set
    uses the embedding, as transformers' tie_weights() does."""
    return c.tie_word_embeddings or "lm_head.weight" not in ckpt  # type: ignore[operator]


def held_tensors(c: ModelConfig, layers: range, ckpt: Container[str]) -> list[str]:
    """The transformers names of the tensors ``StageWeights.load`` reads for
    ``layers`` (the module docstring's rule), in its order; ``ckpt``: the
    checkpoint's tensor names (whether it ships an ``lm_head``)."""
    names = [s.name for i in layers for s in layer_tensors(c, i) if s.wanted]
    first, last = layers.start == 0, layers.stop == c.num_hidden_layers
    tied = head_is_tied(c, ckpt)
    if first or (last and tied):
        names.append("model.embed_tokens.weight")
    if last:
        names.append("model.norm.weight")
        names += [] if tied else ["lm_head.weight"]
    return names


def vars_of(block: LayerWeights) -> list[np.ndarray | None]:
    return [getattr(block, name) for name in block.__slots__]
