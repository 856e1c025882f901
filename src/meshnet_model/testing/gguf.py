"""Small GGUF files written as llama.cpp's converter writes them (tests, benchmarks).

``write_gguf(path, config, weights, qtype=..., tokenizer=...)`` takes a model
in the Hugging Face layout (``config.json`` dict, tensors by transformers
name, float32) and writes it with the ``gguf`` package's ``GGUFWriter``:

* tensor names mapped to llama.cpp's (``blk.N.attn_q.weight`` ...);
* q/k projections of llama-type models permuted the way the converter does
  (``permute`` below) — so a reader that forgets to undo it fails the tests;
* 2-D tensors encoded in ``qtype`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1 through
  ``gguf.quants.quantize``), 1-D ones (norms, biases) kept F32 as llama.cpp does;
* metadata under llama.cpp's keys, and a tokenizer (``GGUFVocab``) when given.

Base dependencies only (numpy, gguf). The tests' tiny trained vocabularies
(sentencepiece, a test-only package) live in ``tests/support/vocab.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..formats.gguf.checkpoint import _GLOBAL_TENSORS, _LAYER_TENSORS

__all__ = [
    "FILE_TYPES",
    "GGUFVocab",
    "metadata_writer",
    "permute",
    "random_k_quant",
    "write_gguf",
]


@dataclass
class GGUFVocab:
    """A tokenizer as GGUF metadata (``tokenizer.ggml.*``)."""

    model: str  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    add_bos: bool | None = None
    add_space_prefix: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k reordering: per head, HF's (first half, second
    half) rows become interleaved pairs.
    ``meshnet_model.formats.gguf.checkpoint.unpermute`` undoes it."""
    head_dim = rows.shape[0] // heads
    split = rows.reshape(heads, 2, head_dim // 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def _gguf_name(hf_name: str) -> str:
    for gguf_name, hf in _GLOBAL_TENSORS.items():
        if hf == hf_name:
            return gguf_name
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        tail = ".".join(parts[3:])
        for gguf_tail, hf_tail in _LAYER_TENSORS.items():
            if hf_tail == tail:
                return f"blk.{parts[2]}.{gguf_tail}"
    raise ValueError(f"no GGUF name for {hf_name}")


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    *,
    qtype: str = "F32",
    vocab: GGUFVocab | None = None,
    chat_template: str | None = None,
    name: str = "meshnet test model",
    extra_metadata: Mapping[str, Any] | None = None,
    rope_freqs: np.ndarray | None = None,
    encoded: Mapping[str, tuple[np.ndarray, str]] | None = None,
) -> Path:
    """Write ``weights`` (HF names, float32) as a GGUF file of architecture
    ``config["model_type"]`` (llama, mistral → "llama", qwen2, qwen3).

    ``encoded``: tensors already in the file's encoding and layout, HF name →
    (bytes ``[rows, row_bytes]`` uint8, ggml type name), written as they are —
    for types the ``gguf`` package cannot quantize (``random_k_quant``)."""
    import gguf

    path = Path(path)
    writer, arch, heads, kv_heads = metadata_writer(
        path,
        config,
        qtype=qtype,
        vocab=vocab,
        chat_template=chat_template,
        name=name,
        extra_metadata=extra_metadata,
    )
    permuted = arch == "llama"
    kind = gguf.GGMLQuantizationType[qtype]
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for hf, (raw, raw_type) in (encoded or {}).items():
        writer.add_tensor(_gguf_name(hf), raw, raw_dtype=gguf.GGMLQuantizationType[raw_type])
    for hf, array in weights.items():
        if hf in (encoded or {}):
            continue
        data = np.asarray(array, dtype=np.float32)
        if permuted and hf.endswith(("q_proj.weight", "q_proj.bias")):
            data = permute(data, heads)
        elif permuted and hf.endswith(("k_proj.weight", "k_proj.bias")):
            data = permute(data, kv_heads)
        name_out = _gguf_name(hf)
        if data.ndim < 2 or qtype == "F32":
            writer.add_tensor(name_out, np.ascontiguousarray(data))
        elif qtype == "F16":
            writer.add_tensor(name_out, data.astype(np.float16))
        else:
            writer.add_tensor(name_out, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ggml file types (``general.file_type``) of the encodings written here.
FILE_TYPES = {
    "F32": 0,
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q8_0": 7,
    "Q4_K": 15,
    "Q6_K": 18,
    "BF16": 32,
}


def metadata_writer(
    path: str | Path,
    config: Mapping[str, Any],
    *,
    qtype: str = "F32",
    vocab: GGUFVocab | None = None,
    chat_template: str | None = None,
    name: str = "meshnet test model",
    extra_metadata: Mapping[str, Any] | None = None,
) -> tuple[Any, str, int, int]:
    """A ``gguf.GGUFWriter`` for ``path`` holding the metadata of ``config``
    under llama.cpp's keys (and ``vocab``, ``chat_template``), no tensors yet;
    with the architecture name and the head counts. ``write_gguf`` and
    ``random_gguf.write_random_gguf`` add the tensors."""
    import gguf

    model_type = config.get("model_type", "llama")
    arch = {"mistral": "llama"}.get(model_type, model_type)
    path = Path(path)
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    if arch == "qwen3" or head_dim != int(config["hidden_size"]) // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(int(config["vocab_size"]))
    if config.get("sliding_window"):
        writer.add_sliding_window(int(config["sliding_window"]))
    writer.add_file_type(FILE_TYPES[qtype])
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))
    if vocab is not None:
        _write_vocab(writer, vocab)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    return writer, arch, heads, kv_heads


def random_k_quant(
    rows: int, columns: int, qtype: str, std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random ``Q4_K`` or ``Q6_K`` bytes ``[rows, row_bytes]`` whose values have
    about ``std`` spread and mean near 0 (random nibbles, 6-bit scales and mins;
    the float16 super-block scales chosen for the spread). The ``gguf`` package
    decodes but cannot encode these types; real files are mostly made of them."""
    blocks = rows * columns // 256
    if qtype == "Q4_K":
        raw = rng.integers(0, 256, (blocks, 144), dtype=np.uint8)
        # value = d*sc*q - dmin*m; q uniform 0..15 (std 4.6), sc and m ~ 31.5 on average.
        d = np.float16(std / (4.6 * 31.5))
        raw[:, 0:2] = np.full((blocks, 1), d).view(np.uint8)
        raw[:, 2:4] = np.full((blocks, 1), np.float16(7.5 * float(d))).view(np.uint8)
    elif qtype == "Q6_K":
        raw = rng.integers(0, 256, (blocks, 210), dtype=np.uint8)
        # value = d*sc*(q-32); q uniform 0..63 (std 18.5), |sc| ~ 64 on average.
        raw[:, 208:210] = np.full((blocks, 1), np.float16(std / (18.5 * 64))).view(np.uint8)
    else:
        raise ValueError(f"random_k_quant makes Q4_K or Q6_K, not {qtype}")
    return raw.reshape(rows, -1)


def _write_vocab(writer: Any, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    for value, add in (
        (vocab.bos_id, writer.add_bos_token_id),
        (vocab.eos_id, writer.add_eos_token_id),
        (vocab.unk_id, writer.add_unk_token_id),
        (vocab.pad_id, writer.add_pad_token_id),
    ):
        if value is not None:
            add(value)
    if vocab.add_bos is not None:
        writer.add_add_bos_token(vocab.add_bos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
