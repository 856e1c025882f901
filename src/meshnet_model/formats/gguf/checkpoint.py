"""A GGUF file (llama.cpp's format) as a checkpoint: tensors under their HF names.

``GGUFCheckpoint`` has ``Checkpoint``'s interface: ``tensor(name)`` under the
transformers name (``model.layers.3.self_attn.q_proj.weight``), in the
transformers layout; ``config`` is the file's metadata as a ``config.json``
dict (``config.py``), the header is parsed by ``file.py``.
llama.cpp's converter permutes the rows of the q and k projections of
llama-type models (``llama``: Llama and Mistral) so that its rope can rotate
adjacent pairs; here the permutation is undone, as transformers does on
load. Qwen2/Qwen3 are converted without it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CheckpointError
from ...progress import NO_PROGRESS, LoadProgress
from .config import gguf_config
from .file import GGUFFile
from .quants import GGMLType

__all__ = ["GGUFCheckpoint", "GGUFFile", "gguf_config", "hf_name", "is_gguf", "unpermute"]

GGUF_SUFFIX = ".gguf"
# Architectures whose q/k rows llama.cpp permutes (Llama and Mistral files).
_PERMUTED = frozenset({"llama"})
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF tensor name (after blk.N.) → HF name (after model.layers.N.)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # llama.cpp's per-frequency rope factors (Llama 3.x): folded into the config.
    "rope_freqs.weight": "rope_freqs.weight",
}


def is_gguf(path: str | Path) -> bool:
    """A ``--model`` path naming a GGUF file rather than a checkpoint directory."""
    return Path(path).suffix.lower() == GGUF_SUFFIX


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or None for one we do not know."""
    found = _LAYER.match(gguf_name)
    if found:
        tail = _LAYER_TENSORS.get(found.group(2))
        return None if tail is None else f"model.layers.{found.group(1)}.{tail}"
    return _GLOBAL_TENSORS.get(gguf_name)


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation of a ``[heads * head_dim, ...]`` tensor.

    The converter reorders each head's rows from the HF layout (first half,
    second half: rotate_half pairs i and i + d/2) to interleaved pairs
    (i, i + d/2 adjacent); as an index map, per head: ``gguf[2i + j] =
    hf[j * d/2 + i]``. This is its inverse.
    """
    head_dim = rows.shape[0] // heads
    split = rows.reshape(heads, head_dim // 2, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


class GGUFCheckpoint:
    """A GGUF file with ``Checkpoint``'s interface (HF tensor names and layouts)."""

    def __init__(self, path: str | Path, *, progress: LoadProgress = NO_PROGRESS) -> None:
        """``progress``: told the stored bytes of each tensor when it is first read."""
        self.file = GGUFFile(path)
        self.progress = progress
        self.path = self.file.path
        self.config = gguf_config(self.file)
        self.permuted = self.file.architecture in _PERMUTED
        self._names: dict[str, str] = {}
        for name in self.file.tensors:
            mapped = hf_name(name)
            if mapped is not None:
                self._names[mapped] = name
        self._read: set[str] = set()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def tensor(self, name: str, *, mmap: bool = True) -> np.ndarray:
        """The tensor under its HF name; ``mmap=False`` returns a copy."""
        gguf_name = self._gguf_name(name)
        array = self.file.array(gguf_name)
        self._mark(gguf_name)
        heads = self._permuted_heads(gguf_name)
        if heads is not None:
            array = unpermute(array, heads)
        if not mmap:
            array = np.array(array)
        return array

    def kind(self, name: str) -> GGMLType:
        """The GGML type the tensor is stored in (under its HF name)."""
        return self.file.type_of(self._gguf_name(name))

    def raw(self, name: str) -> tuple[GGMLType, tuple[int, ...], np.ndarray]:
        """The tensor's stored bytes, ``[rows, row_bytes]`` uint8, read from the
        file, in the transformers row order (the q/k permutation undone on the
        rows, which are independent of each other in every GGML type)."""
        gguf_name = self._gguf_name(name)
        kind, shape, rows = self.file.raw(gguf_name)
        self._mark(gguf_name)
        heads = self._permuted_heads(gguf_name)
        if heads is not None:
            rows = np.ascontiguousarray(unpermute(rows, heads))
        return kind, shape, rows

    def rows(self, name: str) -> tuple[GGMLType, tuple[int, ...], Any]:
        """The tensor's stored rows, read a range at a time when sliced
        (``formats.reading.RowReader``) — or, for the q/k projections whose rows the
        converter permuted (a permutation within each head), read whole."""
        gguf_name = self._gguf_name(name)
        if self._permuted_heads(gguf_name) is not None:
            return self.raw(name)
        self._mark(gguf_name)
        return self.file.rows(gguf_name)

    def mapped_rows(self, name: str) -> np.ndarray:
        """The tensor's stored bytes as a read-only ``[rows, row_bytes]`` view of
        the file's mapping (pages are read when touched, and only those count
        in the stage's memory). Not for the q/k projections, whose rows the
        converter permuted."""
        gguf_name = self._gguf_name(name)
        if self._permuted_heads(gguf_name) is not None:
            raise ValueError(f"{name}: permuted rows cannot be used mapped")
        self._mark(gguf_name)
        return self.file.mapped_rows(gguf_name)

    def _mark(self, gguf_name: str) -> None:
        """The tensor was read: noted, and its stored bytes counted once."""
        if gguf_name not in self._read:
            self._read.add(gguf_name)
            self.progress.on_bytes(int(self.file.tensors[gguf_name].n_bytes))

    def _gguf_name(self, name: str) -> str:
        try:
            return self._names[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: the GGUF file has no tensor for {name!r}"
            ) from None

    def _permuted_heads(self, gguf_name: str) -> int | None:
        """The head count llama.cpp permuted this tensor's rows by, or None."""
        if self.permuted and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return int(self.config["num_attention_heads"])
        if self.permuted and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            kv = self.config.get("num_key_value_heads") or self.config["num_attention_heads"]
            return int(kv)
        return None

    def files_opened(self) -> list[str]:
        return [self.path.name] if self._read else []

    def tensors_read(self) -> list[str]:
        """GGUF names of the tensors decoded so far (a stage reads only its own)."""
        return sorted(self._read)

    def dtypes(self, names: Iterable[str]) -> set[str]:
        return {self.file.type_of(self._names[n]).name for n in names}
