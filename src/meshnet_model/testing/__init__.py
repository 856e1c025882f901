"""Small random Llama checkpoints in the real Hugging Face layout (tests, benchmarks).

``write_checkpoint(directory, config, seed=0, shards=1, dtype="float32")``
writes ``config.json`` and the weights as transformers names them — one
``model.safetensors``, or ``shards`` files ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` — through ``safetensors.numpy``.
``extra_files`` adds files next to them (a ``tokenizer.json``,
``tokenizer_config.json`` …, for whoever needs a tokenizer).

The weights are random but scaled so that activations keep unit size through
the layers (projection std ``1/sqrt(fan_in)``, embeddings std 1, norm weights
near 1): logits are O(1) and differences between two computations are not
hidden under a vanishing signal. Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.config import ModelConfig, RopeScaling
from ..formats.safetensors import INDEX_FILE, SINGLE_FILE
from ..stage.weights import WEIGHT_DTYPES

__all__ = ["random_weights", "small_config", "smollm_135m_config", "write_checkpoint"]


def small_config(**overrides: Any) -> ModelConfig:
    """A tiny Llama: hidden 64, 4 layers, 4 heads / 2 KV heads, vocab 256."""
    values: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    if isinstance(values.get("rope_scaling"), dict):
        values["rope_scaling"] = RopeScaling.from_dict(values["rope_scaling"])
    return ModelConfig(**values)


def smollm_135m_config(**overrides: Any) -> ModelConfig:
    """The shape of HuggingFaceTB/SmolLM-135M (random weights, of course)."""
    values: dict[str, Any] = dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    values.update(overrides)
    return ModelConfig(**values)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of ``LlamaForCausalLM``, float32, by its transformers name."""
    rng = np.random.default_rng(seed)
    c = config
    hidden, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    q_out, kv_out = c.num_attention_heads * d, c.num_key_value_heads * d

    def matrix(rows: int, cols: int) -> np.ndarray:
        scaled: np.ndarray = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        return scaled.astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((c.vocab_size, hidden), dtype=np.float32)
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = matrix(q_out, hidden)
        out[p + "self_attn.k_proj.weight"] = matrix(kv_out, hidden)
        out[p + "self_attn.v_proj.weight"] = matrix(kv_out, hidden)
        out[p + "self_attn.o_proj.weight"] = matrix(hidden, q_out)
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        out[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        out[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
        if c.qkv_bias:
            for proj, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                out[p + f"self_attn.{proj}_proj.bias"] = bias(n)
        if c.o_bias:
            out[p + "self_attn.o_proj.bias"] = bias(hidden)
        if c.qk_norm:
            for proj in ("q", "k"):
                out[p + f"self_attn.{proj}_norm.weight"] = (
                    1.0 + 0.1 * rng.standard_normal(d, dtype=np.float32)
                ).astype(np.float32)
        if c.mlp_bias:
            for proj, n in (("gate", inter), ("up", inter), ("down", hidden)):
                out[p + f"mlp.{proj}_proj.bias"] = bias(n)
    out["model.norm.weight"] = norm()
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = matrix(c.vocab_size, hidden)
    return out


def _shard_names(shards: int) -> list[str]:
    return [f"model-{k:05d}-of-{shards:05d}.safetensors" for k in range(1, shards + 1)]


def write_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    *,
    seed: int = 0,
    shards: int = 1,
    dtype: str = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """Write a checkpoint directory; returns its path.

    ``dtype``: float32, bfloat16 or float16 — what the safetensors hold (norm
    weights included, as transformers saves them). ``shards`` > 1 splits the
    tensors, in name order, into that many files of about equal size and
    writes the index. ``weights`` overrides the random ones (same names).
    """
    from safetensors.numpy import save_file

    target = WEIGHT_DTYPES.get(dtype)
    if target is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if shards < 1:
        raise ValueError("shards must be at least 1")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tensors = dict(weights) if weights is not None else random_weights(config, seed)
    tensors = {k: np.ascontiguousarray(v.astype(target, copy=False)) for k, v in tensors.items()}
    document = config.to_dict()
    document["torch_dtype"] = dtype
    (path / "config.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    for name, content in (extra_files or {}).items():
        target_file = path / name
        if isinstance(content, bytes):
            target_file.write_bytes(content)
        else:
            target_file.write_text(content, encoding="utf-8")
    metadata = {"format": "pt"}  # what transformers writes; readers check it
    if shards == 1:
        save_file(tensors, str(path / SINGLE_FILE), metadata=metadata)
        return path
    names = sorted(tensors)
    total = sum(tensors[n].nbytes for n in names)
    files = _shard_names(shards)
    groups: list[list[str]] = [[] for _ in files]
    done = 0
    for name in names:
        # Fill shard k until it holds its share; never leave a shard empty.
        k = min(done * shards // max(total, 1), shards - 1)
        groups[k].append(name)
        done += tensors[name].nbytes
    for k in range(shards):
        if not groups[k]:
            donor = max(range(shards), key=lambda j: len(groups[j]))
            groups[k].append(groups[donor].pop())
    weight_map = {}
    for file, group in zip(files, groups, strict=True):
        save_file({n: tensors[n] for n in group}, str(path / file), metadata=metadata)
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return path
