"""Random, well-formed GGUF files of real models' shapes (benchmarks, tests).

``write_random_gguf(path, config, qtype="Q4_0", seed=0)`` writes a llama
GGUF file as llama.cpp's converter lays it out (metadata through
``testing.gguf.metadata_writer``, tensor names ``blk.N.attn_q.weight`` …,
Llama 3 rope scaling as a ``rope_freqs.weight`` tensor) whose blocks are
random bytes of the right structure, written tensor by tensor: the tensor
infos go first (``GGUFWriter.add_tensor_info``), then each tensor's bytes are
made and written (``write_tensor_data``) and dropped, so memory stays at one
tensor (the 1B shape's largest, the embedding, is 148 MB in Q4_0) and a
1B-shaped Q4_0 file (~700 MB) takes seconds. Nothing is quantized: the
bytes *are* the quantized weights.

``config`` is a Hugging Face ``config.json`` dict; ``LLAMA_3_2_1B`` and
``LLAMA_3_2_3B`` are the published shapes, ``TINY`` a small one whose
columns still fit the k-quants' 256-value super-blocks (write it with
``weight_std=TINY_WEIGHT_STD``).

Scales, so that a forward pass stays sane through every layer:

* every projection has weight std 0.02 (per-block scales drawn around the
  value that gives it, ±50 %, so blocks differ as in a real file): after an
  RMS norm a projection's output has std ``0.02 * sqrt(fan_in)`` (0.9 for
  hidden 2048), each layer adds O(1) to the residual stream, and 16 or 28
  layers keep it within a few units, finite in float32 and bfloat16;
* norm weights are exactly 1 (F32, as llama.cpp keeps 1-D tensors);
* the embedding, tied to the output head, has std ``LOGIT_STD / sqrt(hidden)``
  (0.066 for hidden 2048): the head sees the final norm's unit-rms vector,
  so the logits have std about ``LOGIT_STD`` = 3 — a peaked distribution
  (a few tokens hold most of the mass, as a trained model's do), not the
  near-uniform one of small logits nor the one-hot one of large logits, so
  KL and top-1 agreement between two engines mean something (the 1B shape:
  entropy about 7 nats of ln 128256 = 11.8, the top token 4-13 %, a different
  one at every position);
* the tied head scores the input token itself at about
  ``LOGIT_STD**2 * sqrt(hidden) / |h|`` (``h`` the final hidden state): the
  layers must outweigh the embedding in ``h`` or every position predicts its
  own token. At 0.02 the real shapes' 16+ wide layers do (that logit is 2-7
  beside a top of 14); a narrow toy's do not, so ``TINY`` is written with
  ``TINY_WEIGHT_STD`` = 0.1;
* block scales of random sign (Q4_0, Q8_0) and Q4_1's ``m = -7.5 d`` make the
  weights' mean 0: the nibbles' mean of -0.5 would otherwise add one fixed
  direction to every hidden state, and every position would predict the same.

Encodings (``QTYPES``): ``F32``, ``F16``; ``Q4_0`` (per 32 values an f16
scale and 16 bytes of nibbles, value ``d * (q - 8)``), ``Q4_1`` (f16 ``d``,
f16 ``m`` set to ``-7.5 d`` so the mean is 0, 16 nibble bytes), ``Q8_0`` (f16
``d`` + 32 int8); ``Q4_K``/``Q6_K`` through ``testing.gguf.random_k_quant``
(their rows must be multiples of 256 values). Base dependencies only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .gguf import GGUFVocab, metadata_writer, random_k_quant

__all__ = [
    "LLAMA_3_2_1B",
    "LLAMA_3_2_3B",
    "LOGIT_STD",
    "QTYPES",
    "TINY",
    "TINY_WEIGHT_STD",
    "WEIGHT_STD",
    "random_tensors",
    "tensor_plan",
    "write_random_gguf",
]

WEIGHT_STD = 0.02
TINY_WEIGHT_STD = 0.1
LOGIT_STD = 3.0
QTYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA_3_2_1B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 2048,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
}
LLAMA_3_2_3B: dict[str, Any] = {
    **LLAMA_3_2_1B,
    "hidden_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 8192,
}
TINY: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
}

# (block values, block bytes) of the block encodings made here.
_BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
# What random_k_quant's values' std comes out as, per std asked for (measured:
# its random 6-bit scales and mins spread the values more than it assumes).
_K_SPREAD = {"Q4_K": 1.79, "Q6_K": 1.15}
_NIBBLE_STD = math.sqrt((16**2 - 1) / 12)  # uniform 0..15
_INT8_STD = math.sqrt((256**2 - 1) / 12)  # uniform -128..127


def tensor_plan(
    config: Mapping[str, Any], weight_std: float = WEIGHT_STD
) -> Iterator[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, shape ``(rows, columns)`` or ``(n,)``, std) of every tensor
    but ``rope_freqs.weight``, in llama.cpp's order; std 0 means "all ones"."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    yield "token_embd.weight", (vocab, hidden), LOGIT_STD / math.sqrt(hidden)
    for i in range(int(config["num_hidden_layers"])):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (hidden,), 0.0
        yield p + "attn_q.weight", (q, hidden), weight_std
        yield p + "attn_k.weight", (kv, hidden), weight_std
        yield p + "attn_v.weight", (kv, hidden), weight_std
        yield p + "attn_output.weight", (hidden, q), weight_std
        yield p + "ffn_norm.weight", (hidden,), 0.0
        yield p + "ffn_gate.weight", (inter, hidden), weight_std
        yield p + "ffn_up.weight", (inter, hidden), weight_std
        yield p + "ffn_down.weight", (hidden, inter), weight_std
    yield "output_norm.weight", (hidden,), 0.0
    if not config.get("tie_word_embeddings", False):
        yield "output.weight", (vocab, hidden), LOGIT_STD / math.sqrt(hidden)


def _scales(rng: np.random.Generator, blocks: int, d: float, signed: bool) -> np.ndarray:
    """Per-block f16 scales around ``d`` (±50 %), as bytes ``[blocks, 2]``;
    ``signed``: of random sign (as llama.cpp's Q4_0/Q8_0 quantizers make them,
    the sign putting the block's largest value at -8 or -128), which also
    cancels the quants' mean (-0.5) — with it, every matrix would add the
    same direction to every token's hidden state and swamp the input."""
    values = d * rng.uniform(0.5, 1.5, blocks)
    if signed:
        values *= rng.choice(np.array([-1.0, 1.0]), blocks)
    return values.astype(np.float16).view(np.uint8).reshape(blocks, 2)


def random_tensor(
    shape: tuple[int, ...], std: float, qtype: str, rng: np.random.Generator
) -> tuple[np.ndarray, str]:
    """One tensor's bytes (or F32/F16 values) and its ggml type name."""
    if len(shape) == 1 or std == 0.0:
        return np.ones(shape, np.float32), "F32"
    rows, columns = shape
    if qtype == "F32":
        return (std * rng.standard_normal(shape, dtype=np.float32)), "F32"
    if qtype == "F16":
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(np.float16), "F16"
    if qtype not in _BLOCKS:
        raise ValueError(f"qtype {qtype!r} is not one of {', '.join(QTYPES)}")
    size, nbytes = _BLOCKS[qtype]
    if columns % size:
        raise ValueError(f"{qtype} rows hold multiples of {size} values, not {columns}")
    if qtype in ("Q4_K", "Q6_K"):
        return random_k_quant(rows, columns, qtype, std / _K_SPREAD[qtype], rng), qtype
    blocks = rows * columns // size
    # Random bytes everywhere (the quants), then the scales written over.
    raw = np.frombuffer(rng.bytes(blocks * nbytes), np.uint8).reshape(blocks, nbytes).copy()
    # Q4_1's per-block scale spread (d around its mean, m = -7.5 d): same std.
    d = std / (_INT8_STD if qtype == "Q8_0" else _NIBBLE_STD)
    scales = _scales(rng, blocks, d, signed=qtype != "Q4_1")
    raw[:, 0:2] = scales
    if qtype == "Q4_1":
        m = -7.5 * scales.view(np.float16).astype(np.float32)
        raw[:, 2:4] = m.astype(np.float16).view(np.uint8).reshape(blocks, 2)
    return raw.reshape(rows, columns // size * nbytes), qtype


def random_tensors(
    config: Mapping[str, Any],
    qtype: str = "Q4_0",
    seed: int = 0,
    weight_std: float = WEIGHT_STD,
) -> Iterator[tuple[str, np.ndarray, str]]:
    """(GGUF name, bytes or values, ggml type name) of every tensor, one at a
    time (``rope_freqs.weight`` not among them)."""
    rng = np.random.default_rng(seed)
    for name, shape, std in tensor_plan(config, weight_std):
        data, kind = random_tensor(shape, std, qtype, rng)
        yield name, data, kind


def llama3_rope_factors(config: Mapping[str, Any]) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs.weight`` for Llama 3 rope scaling (its
    converter's formula), or None without it."""
    scaling = config.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    theta = float(config.get("rope_theta", 10000.0))
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    if kind in _BLOCKS:
        size, nbytes = _BLOCKS[kind]
        return math.prod(shape) // size * nbytes
    return math.prod(shape) * (4 if kind == "F32" else 2)


def write_random_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    qtype: str = "Q4_0",
    seed: int = 0,
    *,
    weight_std: float = WEIGHT_STD,
    name: str = "meshnet random model",
    vocab: GGUFVocab | None = None,
) -> Path:
    """Write a random ``config``-shaped GGUF file in ``qtype`` (module doc);
    returns its path. 2-D tensors are in ``qtype``, norms F32. The same
    ``seed`` gives the same file. ``weight_std``: the projections' std
    (``TINY_WEIGHT_STD`` for ``TINY``, see there); ``vocab``: a tokenizer to
    write too (llama.cpp loads no file without one)."""
    std = float(weight_std)
    import gguf

    path = Path(path)
    if config.get("model_type", "llama") not in ("llama", "mistral"):
        raise ValueError("write_random_gguf writes llama-architecture files")
    writer, _, _, _ = metadata_writer(path, config, qtype=qtype, name=name, vocab=vocab)
    rope = llama3_rope_factors(config)
    # The tensor infos first (shapes and types are known without the bytes).
    kinds: list[str] = []
    for tensor, shape, spread in tensor_plan(config, std):
        kind = "F32" if len(shape) == 1 or spread == 0.0 else qtype
        kinds.append(kind)
        ggml = gguf.GGMLQuantizationType[kind]
        if kind in _BLOCKS:
            byte_shape = (shape[0], shape[1] // _BLOCKS[kind][0] * _BLOCKS[kind][1])
            writer.add_tensor_info(
                tensor, byte_shape, np.dtype(np.uint8), _nbytes(shape, kind), raw_dtype=ggml
            )
        else:
            dtype = np.dtype(np.float32 if kind == "F32" else np.float16)
            writer.add_tensor_info(tensor, shape, dtype, _nbytes(shape, kind))
    if rope is not None:
        writer.add_tensor_info("rope_freqs.weight", rope.shape, rope.dtype, rope.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for (tensor, data, kind), expected in zip(
        random_tensors(config, qtype, seed, std), kinds, strict=True
    ):
        assert kind == expected, tensor
        writer.write_tensor_data(data)
        del data
    if rope is not None:
        writer.write_tensor_data(rope)
    writer.close()
    return path
