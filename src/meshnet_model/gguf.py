"""A GGUF file (llama.cpp's format) as a checkpoint: config, tensors by their HF names.

``GGUFFile(path)`` parses the header with the ``gguf`` package's
``GGUFReader``, which memory-maps the file and builds only views; nothing of
a tensor is read until it is asked for. Any failure to parse (bad magic,
truncated header or data, unknown tensor type id) becomes one
``CheckpointError`` line.

``gguf_config(file)`` turns the metadata into a ``config.json``-shaped dict
(plain Hugging Face keys), which the package's one config reader then
validates — the GGUF path gets no looser rules than a checkpoint directory.
Fail-closed: an architecture other than the families we run is refused by
name, and so is any ``{arch}.*`` key that would change the forward pass and
is not mapped (``_ARCH_KEYS`` lists what is understood, ``_INERT_KEYS`` what
cannot change the math).

``GGUFCheckpoint`` has ``Checkpoint``'s interface: ``tensor(name)`` under the
transformers name (``model.layers.3.self_attn.q_proj.weight``), in the
transformers layout. llama.cpp's converter permutes the rows of the q and k
projections of llama-type models (``llama``: Llama and Mistral) so that its
rope can rotate adjacent pairs; here the permutation is undone, as
transformers does on load. Qwen2/Qwen3 are converted without it.
"""

from __future__ import annotations

import functools
import math
import re
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import CheckpointError
from .gguf_quants import GGML_TYPES, GGMLType, decode

__all__ = ["GGUFCheckpoint", "GGUFFile", "gguf_config", "hf_name", "is_gguf", "unpermute"]

GGUF_SUFFIX = ".gguf"

# GGUF architecture → HF model_type. Mistral files say "llama" (llama.cpp
# converts MistralForCausalLM as llama); a sliding window makes them "mistral".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED = frozenset({"llama"})

# {arch}.<key> → HF key, for the keys copied as they are.
_ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
}
# Read below, not copied: head_dim and rope scaling.
_ARCH_DERIVED = {
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    # Whether the model was fine-tuned at the scaled length: no effect on the math.
    "rope.scaling.finetuned",
}
# Mixture-of-experts sizes: a dense model is one where they are 0 (else refused).
_DENSE_IF_ZERO = {"expert_count", "expert_used_count"}
# Keys outside {arch}.* that cannot change the forward pass: descriptions,
# provenance, the tokenizer (read by gguf_tokenizer.py), quantization notes.
_INERT_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")
_ROPE_SCALING_TYPES = {"none", "linear", "yarn"}
_STRING, _ARRAY = 8, 9  # GGUFValueType ids
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


def _field_value(field: Any) -> Any:
    """A ``ReaderField``'s value as plain Python (str, int, float, bool, list)."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    kind = types[-1] if types[0] != GGUFValueType.ARRAY or len(types) > 1 else GGUFValueType.UINT8
    if kind == GGUFValueType.STRING:
        values = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    else:
        # One part per element, or (numeric arrays, see _Reader) one part for all.
        values = [v for i in field.data for v in field.parts[i].tolist()]
        if kind == GGUFValueType.BOOL:
            values = [bool(v) for v in values]
    return values if types[0] == GGUFValueType.ARRAY else values[0]


def _reader_class() -> type:
    """``GGUFReader``, made fast on real vocabularies.

    The package's reader slices its ``np.memmap`` once or twice per array
    element, and every ``np.memmap`` slice pays the subclass's bookkeeping: a
    Qwen-sized vocabulary (151k tokens and merges) took 36 s to parse here.
    Two changes, no change of result: the mapping is sliced as a plain
    ``ndarray`` view (which still holds the map alive), and a numeric array
    is one view, a string array one walk over its lengths (36 s → under 1 s).
    """
    from gguf import GGUFReader, GGUFValueType

    class _Reader(GGUFReader):  # type: ignore[misc]
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = np.asarray(value)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if int(raw_type) != _ARRAY or self.byte_order != "I" or sys.byteorder != "little":
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = self._get(orig_offs, np.uint32)
            count = self._get(orig_offs + 4, np.uint64)
            sub, n = int(item_type[0]), int(count[0])
            types = [GGUFValueType.ARRAY, GGUFValueType(sub)]
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(sub))
            if nptype is not None:
                values = self._get(orig_offs + 12, nptype, n)
                if values.shape[0] != n:
                    raise ValueError(f"array at {orig_offs} runs past the end of the file")
                return 12 + int(values.nbytes), [item_type, count, values], [2], types
            if sub != _STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            # Strings: a u64 length, then the bytes; walked without numpy per item.
            data = self._plain
            view = memoryview(data)
            parts: list[np.ndarray] = [item_type, count]
            offs = orig_offs + 12
            for _ in range(n):
                (length,) = struct.unpack_from("<Q", view, offs)
                if offs + 8 + length > data.shape[0]:
                    raise ValueError(f"string at {offs} runs past the end of the file")
                parts.append(data[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(2, len(parts))), types

    return _Reader


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, size: int, mtime_ns: int) -> Any:
    """The parsed header, kept: a node and a gateway read the config, the
    tensors and the tokenizer of one file, and parsing a real vocabulary takes
    seconds. Keyed by size and mtime, so a rewritten file is parsed again."""
    del size, mtime_ns  # part of the cache key only
    return _reader_class()(path, "r")


class GGUFFile:
    """A parsed GGUF header and memory-mapped tensor data."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            self._reader = _open_reader(str(self.path.resolve()), *_stamp(self.path))
        except Exception as exc:  # the reader raises whatever numpy raises on bad bytes
            detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(
                f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {detail})"
            ) from None
        self._values: dict[str, Any] = {}
        self.tensors = {t.name: t for t in self._reader.tensors}

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    def get(self, key: str, default: Any = None) -> Any:
        if key not in self._values:
            field = self._reader.fields.get(key)
            if field is None:
                return default
            self._values[key] = _field_value(field)
        return self._values[key]

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: no general.architecture in the metadata")
        return arch

    def type_of(self, name: str) -> GGMLType:
        tensor = self.tensors[name]
        kind = GGML_TYPES.get(int(tensor.tensor_type))
        if kind is None:
            supported = ", ".join(t.name for t in GGML_TYPES.values())
            raise CheckpointError(
                f"{self.path}: tensor {name} is {tensor.tensor_type.name}, a type this "
                f"package does not decode (supported: {supported})"
            )
        return kind

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order: ``[rows, columns]`` (GGUF lists the dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def array(self, name: str) -> np.ndarray:
        """The tensor's values: a view of the file for F32/F16/BF16, else float32."""
        kind = self.type_of(name)
        shape = self.shape(name)
        if shape and shape[-1] % kind.block:
            raise CheckpointError(
                f"{self.path}: tensor {name} has rows of {shape[-1]}, not a multiple of "
                f"the {kind.name} block of {kind.block}"
            )
        raw = self.tensors[name].data
        expected = math.prod(shape[:-1]) * kind.row_bytes(shape[-1]) if shape else 0
        if raw.nbytes != expected:
            raise CheckpointError(
                f"{self.path}: tensor {name} has {raw.nbytes} bytes in the file, "
                f"{kind.name} {list(shape)} needs {expected} (truncated?)"
            )
        return decode(np.asarray(raw).view(np.uint8), kind, shape)


def _int(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"GGUF key {key} must be one integer, got {value!r}")
    return value


def _llama3_from_freqs(
    factors: np.ndarray, theta: float, head_dim: int, context: int
) -> dict[str, Any]:
    """Llama 3 rope scaling whose per-frequency factors are ``factors``.

    llama.cpp stores Llama 3.x's banded rope rescaling as ``rope_freqs.weight``
    (``inv_freq / factor_i`` per frequency) instead of its four parameters.
    Only the ratios of ``original_max_position_embeddings``, ``low_freq_factor``
    and ``high_freq_factor`` matter, so with ``low_freq_factor`` 1 they follow
    from two factors on the ramp; the result is checked against every factor,
    and anything that is not Llama 3 scaling is refused.
    """
    from .config import RopeScaling
    from .rope import _base_inv_freq, _llama3

    inv = _base_inv_freq(theta, head_dim)
    wavelen = 2 * math.pi / inv
    factor = float(factors.max())
    refused = CheckpointError(
        "rope_freqs.weight: per-frequency rope factors that are not Llama 3 rope "
        "scaling are not supported"
    )
    if factor <= 1.0 or factors.shape != inv.shape:
        if factors.shape == inv.shape and np.all(factors == 1.0):
            return {}
        raise refused
    # On the ramp 1/f = (1 - s)/factor + s, and s = a / wavelen + b.
    ramp = (factors > 1.0) & (factors < factor)
    if ramp.sum() < 2:
        raise refused
    s = (1.0 / factors[ramp].astype(np.float64) - 1.0 / factor) / (1.0 - 1.0 / factor)
    x = 1.0 / wavelen[ramp]
    a, b = np.polyfit(x, s, 1)
    if not (a > 0 and b < 0):
        raise refused
    high = 1.0 - 1.0 / b
    original = -a / b
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": float(original),
    }
    rebuilt = _llama3(inv, RopeScaling.from_dict(scaling), context)
    if not np.allclose(inv / rebuilt, factors, rtol=1e-4, atol=0):
        raise refused
    # Round the recovered length to an integer when the published values are
    # (8192 for Llama 3.1/3.2), re-checking that the rounding changes nothing.
    rounded = dict(scaling, original_max_position_embeddings=round(original),
                   high_freq_factor=round(high, 4))  # fmt: skip
    again = _llama3(inv, RopeScaling.from_dict(rounded), context)
    if np.allclose(inv / again, factors, rtol=1e-4, atol=0):
        return rounded
    return scaling  # pragma: no cover - a file whose ratios are not round


def gguf_config(file: GGUFFile) -> dict[str, Any]:
    """The file's metadata as a Hugging Face ``config.json`` dict (see module doc)."""
    arch = file.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{file.path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    if (file.get("split.count") or 1) > 1:
        raise CheckpointError(
            f"{file.path}: split GGUF files (split.count {file.get('split.count')}) are not "
            "supported; merge them with llama.cpp's gguf-split --merge"
        )
    prefix = arch + "."
    for key in file.keys():  # noqa: SIM118 - GGUFFile is not a dict
        if key.startswith(_INERT_PREFIXES) or key.startswith("split."):
            continue
        tail = key.removeprefix(prefix)
        if tail in _DENSE_IF_ZERO and file.get(key) == 0:
            continue  # some converters write expert counts of 0 for a dense model
        if key == tail or (tail not in _ARCH_KEYS and tail not in _ARCH_DERIVED):
            raise CheckpointError(
                f"{file.path}: GGUF key {key} = {file.get(key)!r} is not supported "
                "(it may change the forward pass)"
            )
    config: dict[str, Any] = {"model_type": ARCHITECTURES[arch], "hidden_act": "silu"}
    for tail, hf_key in _ARCH_KEYS.items():
        value = file.get(prefix + tail)
        if value is not None:
            config[hf_key] = value
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if key not in config:
            raise CheckpointError(f"{file.path}: GGUF metadata lacks the key for {key}")
    heads = _int(config["num_attention_heads"], prefix + "attention.head_count")
    if "num_key_value_heads" in config:
        _int(config["num_key_value_heads"], prefix + "attention.head_count_kv")
    if "vocab_size" not in config:
        tokens = file.tensors.get("token_embd.weight")
        if tokens is not None:
            config["vocab_size"] = int(tokens.shape.tolist()[-1])
    key_length = file.get(prefix + "attention.key_length")
    value_length = file.get(prefix + "attention.value_length")
    head_dim = key_length if key_length is not None else config["hidden_size"] // heads
    if value_length is not None and value_length != head_dim:
        raise CheckpointError(
            f"{file.path}: attention.value_length {value_length} differs from the key "
            f"length {head_dim}; not supported"
        )
    config["head_dim"] = head_dim
    rotary = file.get(prefix + "rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise CheckpointError(
            f"{file.path}: rope.dimension_count {rotary} is not the head dimension "
            f"{head_dim} (partial rotary embeddings are not supported)"
        )
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    if arch in ("qwen2",):
        # Qwen2 carries q/k/v biases (the tensors are read when present).
        config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    config["rope_scaling"] = _rope_scaling(file, prefix, config)
    if "sliding_window" in config and arch == "llama":
        config["model_type"] = "mistral"
    for key in ("bos", "eos", "padding"):
        value = file.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, int):
            config[{"padding": "pad"}.get(key, key) + "_token_id"] = value
    return config


def _rope_scaling(file: GGUFFile, prefix: str, config: dict[str, Any]) -> dict[str, Any] | None:
    kind = file.get(prefix + "rope.scaling.type")
    if kind is not None and kind not in _ROPE_SCALING_TYPES:
        raise CheckpointError(f"{file.path}: rope.scaling.type {kind!r} is not supported")
    scaling: dict[str, Any] | None = None
    if kind in ("linear", "yarn"):
        scaling = {
            "rope_type": kind,
            "factor": float(file.get(prefix + "rope.scaling.factor", 1.0)),
        }
        original = file.get(prefix + "rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        for tail, hf_key in (
            ("rope.scaling.attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            value = file.get(prefix + tail)
            if value is not None:
                scaling[hf_key] = value
    if "rope_freqs.weight" in file.tensors:
        if scaling is not None:
            raise CheckpointError(
                f"{file.path}: rope_freqs.weight together with rope.scaling.type {kind!r}"
            )
        factors = np.asarray(file.array("rope_freqs.weight"), dtype=np.float32)
        scaling = (
            _llama3_from_freqs(
                factors.reshape(-1),
                float(config.get("rope_theta", 10000.0)),
                int(config["head_dim"]),
                int(config.get("max_position_embeddings", 2048)),
            )
            or None
        )
    return scaling


class GGUFCheckpoint:
    """A GGUF file with ``Checkpoint``'s interface (HF tensor names and layouts)."""

    def __init__(self, path: str | Path) -> None:
        self.file = GGUFFile(path)
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
        try:
            gguf_name = self._names[name]
        except KeyError:
            raise CheckpointError(
                f"{self.path}: the GGUF file has no tensor for {name!r}"
            ) from None
        array = self.file.array(gguf_name)
        self._read.add(gguf_name)
        if self.permuted and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            array = unpermute(array, int(self.config["num_attention_heads"]))
        elif self.permuted and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            kv = self.config.get("num_key_value_heads") or self.config["num_attention_heads"]
            array = unpermute(array, int(kv))
        if not mmap:
            array = np.array(array)
        return array

    def files_opened(self) -> list[str]:
        return [self.path.name] if self._read else []

    def tensors_read(self) -> list[str]:
        """GGUF names of the tensors decoded so far (a stage reads only its own)."""
        return sorted(self._read)

    def dtypes(self, names: Iterable[str]) -> set[str]:
        return {self.file.type_of(self._names[n]).name for n in names}
