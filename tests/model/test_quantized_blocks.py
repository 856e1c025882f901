"""The quantized held forms (engines/torch/qlinear, formats/gguf/blocks), piece by piece.

* every 4-bit affine map (``int4_groups``, ``int4_split``) reproduces the
  reference dequantization — exactly for Q4_0 and Q8_0 (its two halves sum
  to ``d * q``), within float32 rounding of the folded zero for Q4_1/Q4_K;
* the int4pack kernel's packing is independent between 64-row blocks, which
  the chunked conversion of a big tensor relies on;
* an ``Int4Matrix`` multiplies as the dense matrix of its bfloat16-rounded
  scales does; the held bytes are what ``held_matrix_bytes`` predicts;
* a GGUF stage is read tensor by tensor (``raw`` reads; the mapping is not
  touched for converted tensors) and keeps the embedding in its file form.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.engines.torch.qlinear import (
    Int4Matrix,
    held_form,
    held_matrix_bytes,
    linear,
    quantized_matrix,
)
from meshnet_model.engines.torch.weights import MappedEmbedding
from meshnet_model.formats.gguf.blocks import INT4_FORMS, int4_split
from meshnet_model.formats.gguf.quants import GGML_TYPES, decode
from meshnet_model.testing.gguf import random_k_quant
from support.gguf import build_model, write_model_gguf

KINDS = {t.name: t for t in GGML_TYPES.values()}


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q6_K"):
        return random_k_quant(rows, cols, kind, 0.05, rng).reshape(rows, -1)
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return quantize(values, GGMLQuantizationType[kind]).reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(INT4_FORMS))
def test_the_int4_maps_reproduce_the_reference_dequantization(kind: str) -> None:
    blocks = _blocks(kind, 64, 512)
    reference = decode(blocks.reshape(-1), KINDS[kind], (64, 512)).astype(np.float64)
    total = np.zeros_like(reference)
    for q, scale, zero in int4_split(blocks, KINDS[kind]):
        assert q.dtype == np.uint8 and int(q.max()) <= 15
        groups = np.repeat(scale.astype(np.float64), 32, axis=1)
        zeros = np.repeat(zero.astype(np.float64), 32, axis=1)
        total += (q.astype(np.float64) - 8) * groups + zeros
    if kind in ("Q4_0", "Q8_0"):
        assert np.array_equal(total, reference)  # exact: no zero folded in
    else:
        ulp = np.spacing(np.abs(reference).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(total - reference) <= 4 * ulp + 1e-12)


def test_int4pack_packs_64_row_blocks_independently() -> None:
    rng = np.random.default_rng(1)
    q = torch.from_numpy(rng.integers(0, 16, (2048 + 192, 256)).astype(np.int32))
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    parts = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i : i + 1024], 1)
             for i in range(0, q.shape[0], 1024)]  # fmt: skip
    assert torch.equal(whole, torch.cat(parts))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_a_held_matrix_multiplies_as_its_dequantized_values(kind: str) -> None:
    rows, cols = 2048 + 64, 512  # more than one conversion chunk
    blocks = _blocks(kind, rows, cols, seed=2)
    held = quantized_matrix(torch, KINDS[kind], (rows, cols), blocks, compute=torch.bfloat16)
    x = torch.randn(3, cols, dtype=torch.float32)
    reference = (
        x.double()
        @ torch.from_numpy(decode(blocks.reshape(-1), KINDS[kind], (rows, cols))).double().T
    )
    if kind == "Q6_K":  # no kernel here reads it: the loader holds it dense
        assert held is None and held_form(KINDS[kind], (rows, cols)) == "dense"
        return
    assert isinstance(held, Int4Matrix) and held.nbytes == held_matrix_bytes(
        KINDS[kind], (rows, cols)
    )
    out = linear(torch, x, held)
    assert out.dtype == torch.float32 and out.shape == (3, rows)
    # bf16 activations and scales: ~2^-8 relative, on sums of 512 terms.
    error = (out.double() - reference).abs().max() / reference.abs().max()
    assert error < 0.02, error


def test_shapes_the_kernel_refuses_are_held_dense() -> None:
    assert held_form(KINDS["Q4_0"], (100, 512)) == "dense"
    assert held_matrix_bytes(KINDS["Q4_0"], (100, 512)) == 2 * 100 * 512
    assert held_matrix_bytes(KINDS["Q4_0"], (128, 512)) == 128 * 256 + 16 * 128 * 4
    assert held_matrix_bytes(KINDS["Q8_0"], (128, 512)) == 2 * (128 * 256 + 16 * 128 * 4)
    blocks = _blocks("Q4_0", 100, 512)
    assert quantized_matrix(torch, KINDS["Q4_0"], (100, 512), blocks,
                            compute=torch.bfloat16) is None  # fmt: skip


def test_a_quantized_stage_reads_its_tensors_and_maps_only_the_embedding(
    tmp_path: Path,
) -> None:
    path = write_model_gguf(tmp_path, build_model("llama", layers=2, hidden=128), "Q4_0")
    runner = load_torch_runner(path, range(0, 2), dtype="keep")
    weights = runner.model.weights
    assert isinstance(weights.embed, MappedEmbedding)
    assert weights.embed.kind.name == "Q4_0"
    assert np.shares_memory(weights.embed.rows, weights.embed.rows)  # a view, not a copy
    assert weights.embed.rows.base is not None
    block = weights.blocks[0]
    assert isinstance(block.qkv, Int4Matrix) and block.q is None
    assert isinstance(block.gate_up, Int4Matrix) and isinstance(block.down, Int4Matrix)
    # The tied head of 300 rows (not in 64-row tiles) is held dense in bfloat16.
    assert runner.describe()["weights_held"] == {
        "mapped(Q4_0)": 1, "int4pack(Q4_0)": 8, "bfloat16": 1
    }  # fmt: skip
    # The numpy engine's float32 of the same tensors is 6.4x what is held here.
    assert runner.describe()["compute_dtype"] == "float32"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K+Q6_K"])
def test_the_footprint_predicts_the_bytes_the_stage_holds(tmp_path: Path, qtype: str) -> None:
    """engines.footprint reads headers only; what the loader then holds is the
    same number of bytes, stage by stage (first, middle, last)."""
    from meshnet_model.engines.footprint import stage_footprint
    from support.gguf import write_k_quant_gguf

    model = build_model("llama", layers=3, hidden=256)
    if qtype == "Q4_K+Q6_K":
        path = write_k_quant_gguf(tmp_path, model)
    else:
        path = write_model_gguf(tmp_path, model, qtype)
    for layers in (range(0, 1), range(1, 2), range(2, 3), range(0, 3)):
        runner = load_torch_runner(path, layers, dtype="keep")
        predicted = stage_footprint(path, layers, engine="torch", dtype="keep",
                                    kv_budget_bytes=0, max_chunk_tokens=128,
                                    max_compute_bytes=1 << 20)  # fmt: skip
        assert predicted.weights == runner.model.weights.nbytes, (layers, qtype)


def test_the_packing_used_is_the_kernel_s_layout() -> None:
    """``pack_int4`` writes the layout torch's int4 kernel has: 64-row blocks
    on AVX-512 CPUs, 32-row ones on AVX2; the check finds which, and what is
    used is the kernel's layout (torch's own converter where neither is)."""
    from meshnet_model.engines.torch.qlinear import _torch_pack, int4pack_block, pack_int4

    block = int4pack_block(torch)
    capability = str(torch.backends.cpu.get_cpu_capability())
    if capability.startswith("AVX512"):
        assert block == 64
    elif capability == "AVX2":
        assert block == 32
    q = np.random.default_rng(5).integers(0, 16, (192, 576)).astype(np.uint8)
    theirs = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(q.astype(np.int32)), 1
    ).numpy()
    used = _torch_pack(torch, q) if block is None else pack_int4(q, block)
    assert np.array_equal(used, theirs)
    assert [b for b in (64, 32) if np.array_equal(pack_int4(q, b), theirs)] == (
        [] if block is None else [block]
    )
