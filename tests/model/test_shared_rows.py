"""Dense products shared across a step's small entries (issue 39, part 4).

``stage.batch`` shares fixed tiles of ``SHARED_ROWS`` rows among the entries
of at most that many rows, on engines whose kernels are not row-invariant
across row counts (numpy's BLAS, torch's oneDNN). That keeps failover
replays exact only if a product of exactly ``SHARED_ROWS`` rows gives each
row the same bits whatever its tile-mates hold and wherever it sits: checked
here on the machine the tests run on, for each kernel the engines use. And
the sharing itself: sixteen decode rows take two products, not sixteen.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from meshnet_model import StageRunner
from meshnet_model.engines.numpy import model as numpy_model
from meshnet_model.engines.torch import layers
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.stage.batch import SHARED_ROWS, product_segments
from meshnet_model.stage.runner import StageWork
from meshnet_model.testing import small_config, write_checkpoint

SHAPES = [(96, 64), (1536, 576), (576, 1536)]


def _kernel(kind: str, w: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    if kind == "numpy":
        return lambda rows: rows @ w.T
    dtype = torch.float32 if kind == "torch-float32" else torch.bfloat16
    weight = torch.from_numpy(w).to(dtype)

    def run(rows: np.ndarray) -> np.ndarray:
        out = torch.nn.functional.linear(torch.from_numpy(rows).to(dtype), weight)
        return out.float().numpy()

    return run


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["numpy", "torch-float32", "torch-bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_in_a_tile_has_the_same_bits_whatever_its_tile_mates(
    kind: str, shape: tuple[int, int], threads: int
) -> None:
    rng = np.random.default_rng(shape[0] + threads)
    w = rng.standard_normal(shape).astype(np.float32)
    row = rng.standard_normal((1, shape[1])).astype(np.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        product = _kernel(kind, w)
        alone = product(np.concatenate([row, np.zeros((SHARED_ROWS - 1, shape[1]), np.float32)]))
        for place in range(SHARED_ROWS):
            tile = rng.standard_normal((SHARED_ROWS, shape[1])).astype(np.float32)
            tile[place] = row[0]
            assert np.array_equal(product(tile)[place], alone[0]), (kind, place)
    finally:
        torch.set_num_threads(before)


def test_segments_tile_the_small_entries_and_leave_the_large_alone() -> None:
    decode = [(i, i + 1) for i in range(16)]
    assert product_segments(decode) == [(0, 8, True), (8, 16, True)]
    mixed = [(0, 1), (1, 4), (4, 40), (40, 41)]
    assert product_segments(mixed) == [(0, 4, True), (4, 40, False), (40, 41, True)]
    assert product_segments([(0, 9)]) == [(0, 9, False)]
    assert product_segments([]) == []


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=39)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sixteen_decode_rows_take_two_products_per_matrix(
    checkpoint: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = load_torch_runner(checkpoint, dtype=dtype, threads=1)
    lives = [runner.admit(f"s{i}") for i in range(16)]
    runner.run_batch([StageWork(life, 0, np.asarray([[3, 5, 7]], np.int32)) for life in lives])
    calls: list[int] = []
    real = layers.linear

    def counted(torch_: object, x: torch.Tensor, weight: object, bias: object = None) -> object:
        calls.append(x.shape[0])
        return real(torch_, x, weight, bias)

    monkeypatch.setattr(layers, "linear", counted)
    works = [StageWork(life, 3, np.asarray([[11]], np.int32)) for life in lives]
    runner.run_batch(works)
    assert all(w.result().shape[0] == 1 for w in works)
    config = small_config()
    matrices = 7 * config.num_hidden_layers + 1  # q, k, v, o, gate, up, down; the head
    assert calls == [SHARED_ROWS] * 2 * matrices


def test_the_numpy_engine_shares_its_tiles_too(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = StageRunner.load(checkpoint)
    lives = [runner.admit(f"n{i}") for i in range(16)]
    prompt = np.asarray([[3, 5, 7]], np.int32)
    runner.run_batch([StageWork(life, 0, prompt) for life in lives])
    planned: list[list[tuple[int, int, bool]]] = []

    def recorded(entry_rows: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        planned.append(product_segments(entry_rows))
        return planned[-1]

    monkeypatch.setattr(numpy_model, "product_segments", recorded)
    works = [StageWork(life, 3, np.asarray([[11]], np.int32)) for life in lives]
    runner.run_batch(works)
    assert planned and all(p == [(0, 8, True), (8, 16, True)] for p in planned)
    alone = StageRunner.load(checkpoint)
    alone.run("a", 0, prompt)
    assert np.array_equal(works[5].result(), alone.run("a", 3, np.asarray([[11]], np.int32)))
