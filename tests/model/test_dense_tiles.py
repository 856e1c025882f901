"""Prompt tiles of a quantized stage through the dense GEMM (issue 39,
engines/torch/dense_tiles and calibrate).

* the decoded weights are the held ones (int4 maps with bfloat16 scale and
  zero) rounded once to bfloat16, and a tile's product is the product of
  those weights to the GEMM's own rounding;
* bits: a chunk whose whole tiles take the dense GEMM gives the same bits
  alone, batched beside a decode row, and in the pieces the scheduler cuts
  (never inside a tile) — what failover by replay needs (wire-2 §3.8);
* the choice: ``MESHNET_QUANT_KERNEL`` forces it, else a calibration at
  load picks it, and ``/info`` (``describe``) shows it with its figures;
* the footprint counts the decode buffer.

The error budget with every tile forced dense is in test_dense_tiles_budget.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest
import torch

from meshnet_model.engines.choice import usable_cores
from meshnet_model.engines.footprint import stage_footprint
from meshnet_model.engines.torch.calibrate import ENV, _calibrate, bfloat16_units, choose_kernels
from meshnet_model.engines.torch.dense_tiles import (
    TILE_ROWS,
    DenseTiles,
    StepRows,
    dense_tile_rows,
    scratch_bytes,
)
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.engines.torch.qlinear import Int4Matrix, int4pack_block, quantized_matrix
from meshnet_model.formats.gguf.blocks import int4_split
from meshnet_model.formats.gguf.quants import GGML_TYPES
from meshnet_model.stage.batch import BatchEntry, PackedBatch
from meshnet_model.stage.runner import StageRunner, StageWork
from meshnet_model.testing.gguf import random_k_quant
from meshnet_node.backends import StageContext
from meshnet_node.model_stage import ModelStage
from support.gguf import build_model, write_model_gguf

KINDS = {t.name: t for t in GGML_TYPES.values()}
ROWS, COLS = 640, 512  # two weight tiles: 512 rows, then 128
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff: 8 significant bits, nearest
F32_EPS = 2.0**-24


def _blocks(kind: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "Q4_K":
        return random_k_quant(ROWS, COLS, kind, 0.05, rng).reshape(ROWS, -1)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    values = (rng.standard_normal((ROWS, COLS)) * 0.05).astype(np.float32)
    return quantize(values, GGMLQuantizationType[kind]).reshape(ROWS, -1)


def _matrix(kind: str) -> tuple[Int4Matrix, np.ndarray]:
    """The held matrix, and its exact weights (float64) from the int4 maps
    with the (scale, zero) pairs rounded to bfloat16 as held."""
    blocks = _blocks(kind)
    matrix = quantized_matrix(torch, KINDS[kind], (ROWS, COLS), blocks, compute=torch.bfloat16)
    assert matrix is not None
    exact = np.zeros((ROWS, COLS))
    for q, scale, zero in int4_split(blocks, KINDS[kind]):
        s = torch.from_numpy(scale).to(torch.bfloat16).double().numpy()
        z = torch.from_numpy(zero).to(torch.bfloat16).double().numpy()
        exact += (q.astype(np.float64) - 8) * np.repeat(s, 32, 1) + np.repeat(z, 32, 1)
    return matrix, exact


def _all_tiles(rows: int) -> list[tuple[int, int]]:
    return [(lo, lo + TILE_ROWS) for lo in range(0, rows, TILE_ROWS)]


def _dense(matrix: Int4Matrix, x: torch.Tensor, tiles: list[tuple[int, int]]) -> torch.Tensor:
    return matrix.matmul(
        torch, x, StepRows([(0, x.shape[0])], tiles, DenseTiles(int4pack_block(torch) or 64))
    )


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_the_decoded_weights_are_the_held_ones_rounded_once(kind: str) -> None:
    """Multiplying the identity reads the decoded weights back exactly (one
    product of 1.0 per output, summed with zeros). Each is the held weight's
    bfloat16 rounding, or (a float32 step before it: Q4_1's and Q4_K's zero
    added, Q8_0's halves summed) within one bfloat16 unit of it."""
    matrix, exact = _matrix(kind)
    decoded = _dense(matrix, torch.eye(COLS, dtype=torch.bfloat16), _all_tiles(COLS))
    got = decoded.double().numpy().T
    rounded = torch.from_numpy(exact).to(torch.bfloat16).double().numpy()
    assert np.all(np.abs(got - exact) <= 2 * BF16_EPS * np.abs(exact))
    share = float(np.mean(got == rounded))
    assert share == 1.0 if kind == "Q4_0" else share > 0.999, share


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_a_tile_is_the_decoded_weights_product_and_the_rest_is_int4pack(kind: str) -> None:
    """Tile rows: the float64 product of the bfloat16 inputs and the decoded
    weights, to the GEMM's roundings — float32 sums (at most ``COLS * 2^-24``
    of the sum of magnitudes) and the bfloat16 output (2^-8 of the value).
    The other rows: the int4pack kernel's very bits."""
    matrix, _ = _matrix(kind)
    weights = _dense(matrix, torch.eye(COLS, dtype=torch.bfloat16), _all_tiles(COLS))
    w = weights.double().numpy()  # [COLS, ROWS]: W.T
    x = torch.randn(200, COLS, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tiles = [(0, 64), (128, 192)]
    got = _dense(matrix, x, tiles).double().numpy()
    xs = x.double().numpy()
    want, magnitude = xs @ w, np.abs(xs) @ np.abs(w)
    for lo, hi in tiles:
        bound = BF16_EPS * np.abs(want[lo:hi]) + COLS * F32_EPS * magnitude[lo:hi] * 2
        assert np.all(np.abs(got[lo:hi] - want[lo:hi]) <= bound)
    alone = matrix.matmul(torch, x).double().numpy()
    assert np.array_equal(got[64:128], alone[64:128])
    assert np.array_equal(got[192:], alone[192:])


def test_a_tile_has_the_same_bits_whatever_the_thread_count() -> None:
    """Each worker computes single-threaded, so a step granted 1 or 2 threads
    (the core ledger changes it from step to step) gives the same bits."""
    matrix, _ = _matrix("Q4_1")
    x = torch.randn(128, COLS, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    kernel, before = DenseTiles(int4pack_block(torch) or 64), torch.get_num_threads()
    products = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            rows = StepRows([(0, 128)], [(0, 64), (64, 128)], kernel)
            products.append(matrix.matmul(torch, x, rows))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(products[0], p) for p in products[1:])


def _entry(position: int, tokens: int, batch: int = 1, logit_rows: int = 1) -> BatchEntry:
    cache = _Cache(position)
    ids = np.zeros((batch, tokens), np.int32)
    return BatchEntry(ids, cache, position, logit_rows=logit_rows)  # type: ignore[arg-type]


class _Cache:
    """The little of a KV cache ``PackedBatch`` asks of its entries."""

    def __init__(self, length: int) -> None:
        self.length = length

    def reserve(self, positions: int) -> None:
        pass


def test_tiles_are_whole_aligned_blocks_of_positions_never_in_a_window() -> None:
    batch = PackedBatch([
        _entry(5, 1),  # a decode row: row 0
        _entry(30, 170),  # rows 1..171: positions 64..128 and 128..192 whole
        _entry(64, 65, logit_rows=65),  # a verify window: none
        _entry(0, 64, batch=2),  # each batch row's [0, 64)
    ])  # fmt: skip
    assert dense_tile_rows(batch) == [(35, 99), (99, 163), (236, 300), (300, 364)]


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_model("llama", layers=3, hidden=128)
    return write_model_gguf(tmp_path_factory.mktemp("q4"), model, "Q4_0")


def _stage(path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch) -> StageRunner:
    monkeypatch.setenv(ENV, kernel)
    return load_torch_runner(path, range(0, 2), threads=1)  # a middle stage: all int4pack


def _ids(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 250, (1, count)).astype(np.int32)


def test_a_chunk_with_dense_tiles_has_its_bits_alone_batched_and_in_pieces(
    q4_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _stage(q4_gguf, "dense", monkeypatch)
    assert runner.model.row_invariant and runner.model.piece_tile == TILE_ROWS
    chunk = _ids(150)  # positions 0..150: two whole tiles, then 22 rows of int4pack
    alone = runner.run("alone", 0, chunk)
    # Batched beside another session's decode row.
    runner.run("decoder", 0, _ids(5, 1))
    works = [
        StageWork(runner.admit("decoder"), 5, _ids(1, 2)),
        StageWork(runner.admit("batched"), 0, chunk),
    ]
    runner.run_batch(works)
    assert np.array_equal(works[1].result(), alone)
    # In pieces cut between tiles (as the scheduler cuts them).
    pieces = [
        runner.run("pieces", lo, chunk[:, lo:hi]) for lo, hi in ((0, 64), (64, 136), (136, 150))
    ]
    assert np.array_equal(np.concatenate(pieces, axis=1), alone)
    # The tiles did go through the dense GEMM: other bits than int4pack's.
    int4pack = _stage(q4_gguf, "int4pack", monkeypatch).run("alone", 0, chunk)
    assert not np.array_equal(int4pack, alone)
    assert np.allclose(int4pack, alone, atol=0.1)


@pytest.mark.anyio
async def test_the_scheduler_cuts_a_dense_stage_between_tiles_beside_decoders(
    q4_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 150-token prompt beside a decoding session, on a stage whose steps
    take 16 rows: its pieces end on 8-aligned positions outside the whole
    tiles (a tile is one piece), so its output is the chunk's whole bits."""
    whole = _stage(q4_gguf, "dense", monkeypatch).run("w", 0, _ids(150))
    stage = ModelStage(_stage(q4_gguf, "dense", monkeypatch), max_batch_tokens=16)
    assert stage.scheduler.tile == TILE_ROWS
    done = anyio.Event()

    def ctx(session: str, position: int, tokens: int) -> StageContext:
        return StageContext(session=session, position=position, tokens=tokens, index=0, total=1)

    async def decoder() -> None:
        await stage(_ids(5, 1), ctx("d", 0, 5))
        position = 5
        while not done.is_set() and position < 40:
            await stage(_ids(1, position), ctx("d", position, 1))
            position += 1

    got: list[np.ndarray] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(decoder)
        got.append(await stage(_ids(150), ctx("p", 0, 150)))
        done.set()
    assert stage.scheduler.steps > 3  # cut into pieces beside the decode steps
    assert np.array_equal(got[0], whole)


def test_the_choice_is_forced_by_the_environment_or_calibrated() -> None:
    for kernel in ("dense", "int4pack"):
        choice = choose_kernels(torch, {ENV: kernel})
        assert choice.dense == (kernel == "dense") and choice.calibration is None
        assert choice.describe()["chosen_by"] == f"{ENV}={kernel}"
    with pytest.raises(ValueError, match=ENV):
        choose_kernels(torch, {ENV: "amx"})
    auto = choose_kernels(torch, {}).describe()
    assert "amx" in auto["cpu"]
    if bfloat16_units(auto["cpu"]):
        assert auto["chosen_by"] == "calibration" and "calibration" in auto
        assert auto["prompt_tiles"] in ("dense", "int4pack")
    else:  # no timing where no unit multiplies bfloat16: int4pack at once
        assert auto == {
            "prompt_tiles": "int4pack",
            "tile_rows": TILE_ROWS,
            "chosen_by": "cpu: no bfloat16 GEMM units",
            "cpu": auto["cpu"],
        }


def test_the_calibration_times_both_kernels_in_turns() -> None:
    """On a small matrix (the stage's own is 2,048 x 2,048): every row count,
    both kernels, their ratio; the tiles win only below 1."""
    block = int4pack_block(torch) or 64
    figures = _calibrate(torch, 1, block, (256, 256))
    assert figures["shape"] == [256, 256] and figures["threads"] == 1
    assert figures["rows"] == [64, 128, 256] and len(figures["dense_ms"]) == 3
    assert all(ms > 0 for ms in figures["dense_ms"] + figures["int4pack_ms"])
    ratios = figures["dense_over_int4pack"]
    assert len(ratios) == 3 and all(r > 0 for r in ratios)
    wins = [rows for rows, r in zip(figures["rows"], ratios, strict=True) if r < 1]
    assert figures["crossover_rows"] == (wins[0] if wins else None)


def test_only_avx512_bf16_or_amx_counts_as_bfloat16_units() -> None:
    assert bfloat16_units("avx512_bf16, no amx") and bfloat16_units("avx512_bf16, amx")
    assert bfloat16_units("avx512, amx") and bfloat16_units("avx2, amx unknown")
    assert not bfloat16_units("avx2, no amx") and not bfloat16_units("avx512, no amx")


def test_describe_shows_the_kernels_of_a_quantized_stage_only(
    q4_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = _stage(q4_gguf, "dense", monkeypatch).model.describe()["kernels"]
    assert kernels["prompt_tiles"] == "dense" and kernels["tile_rows"] == TILE_ROWS
    floats = load_torch_runner(q4_gguf, range(0, 2), dtype="float32", threads=1)
    assert "kernels" not in floats.model.describe()


def test_the_footprint_counts_the_decode_buffer(q4_gguf: Path) -> None:
    def scratch(engine: str) -> int:
        return stage_footprint(q4_gguf, range(0, 2), engine=engine, dtype="keep",
                               kv_budget_bytes=1 << 20, max_chunk_tokens=64,
                               max_compute_bytes=1 << 30).scratch  # fmt: skip

    config = build_model("llama", layers=3, hidden=128).config
    cols = max(config["hidden_size"], config["intermediate_size"])
    assert scratch("torch") - scratch("numpy") == scratch_bytes(cols, usable_cores())
    # What a stage holds after a tile (with as many workers as threads): within it.
    kernel = DenseTiles(int4pack_block(torch) or 64)
    matrix, _ = _matrix("Q8_0")
    matrix.matmul(torch, torch.ones(64, COLS), StepRows([(0, 64)], [(0, 64)], kernel))
    assert 0 < kernel.nbytes <= scratch_bytes(COLS, torch.get_num_threads())
