"""A GGUF file's metadata as a Hugging Face ``config.json`` dict, fail-closed.

``gguf_config(file)`` maps llama.cpp's keys to plain HF keys; the package's
one config reader (``ModelConfig.from_dict``) then validates the dict, so the
GGUF path gets no looser rules than a checkpoint directory. An architecture
other than the families we run is refused by name, and so is any
``{arch}.*`` key that is not mapped (``_ARCH_KEYS``, ``_ARCH_DERIVED``) and
could change the forward pass. docs/models.md has the table.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import CheckpointError
from .file import GGUFFile

__all__ = ["ARCHITECTURES", "gguf_config"]

# GGUF architecture → HF model_type. Mistral files say "llama" (llama.cpp
# converts MistralForCausalLM as llama); a sliding window makes them "mistral".
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

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
# provenance, the tokenizer (read by tokenizer.py), quantization notes.
_INERT_PREFIXES = ("general.", "tokenizer.", "quantize.", "GGUF.")
_ROPE_SCALING_TYPES = {"none", "linear", "yarn"}


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
    from ...rope import _base_inv_freq, _llama3
    from ..config import RopeScaling

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
    rounded = dict(
        scaling, original_max_position_embeddings=round(original), high_freq_factor=round(high, 4)
    )
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
