"""Torch-engine nodes over real loopback sockets, mixed with numpy nodes.

A numpy node feeds a torch node that feeds a numpy node: the torch node
computes in bfloat16 and, under ``--wire-dtype keep``, sends bfloat16 (no
float32 round trip); the numpy node takes it and widens it exactly. The
chain's logits equal the same runners run in process, bit for bit, and the
KV budget answers 503 ``kv_memory_full`` from a torch node as from a numpy one.
Each runs with the torch node on the CPU and, where a GPU is, on CUDA
(``.ci/gpu-check.sh``); without CUDA that case is skipped, with its reason.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.engines.torch import load_torch_runner
from meshnet_model.stage.runner import StageWork
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ChainError, ModelSession, start_model_chain
from meshnet_runtime.downstream import DownstreamPool
from support.torch import DEVICES, greedy

pytestmark = pytest.mark.anyio

PROMPT = [(5 * i + 2) % 256 for i in range(14)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=11)


def record_inputs(stage: object, seen: list[str]) -> None:
    runner = stage.runner  # type: ignore[attr-defined]
    run_batch = runner.run_batch

    # The node's scheduler runs every chunk through run_batch, one work each.
    def recording(works: list[StageWork]) -> None:
        seen.extend(work.inputs.dtype.name for work in works)
        run_batch(works)

    runner.run_batch = recording


@pytest.mark.parametrize("device", DEVICES)
async def test_numpy_torch_numpy_chain_sends_bf16_and_equals_in_process(
    checkpoint: Path, device: str
) -> None:
    torch_bf16 = ["--engine", "torch", "--dtype", "bfloat16", "--threads", "1", "--device", device]
    per_node = [[], torch_bf16, []]
    splits = [(0, 1), (1, 3), (3, 4)]
    async with start_model_chain(checkpoint, splits, per_node=per_node) as nodes:
        described = nodes[1].app.stage.describe()
        assert (described["engine"], described["device"]) == ("torch", device)
        assert described["output"] == "bfloat16 hidden [batch, tokens, 64]"
        assert nodes[0].app.stage.describe()["engine"] == "numpy"
        middle, last = [], []
        record_inputs(nodes[1].app.stage, middle)
        record_inputs(nodes[2].app.stage, last)
        pool = DownstreamPool(nodes[0].url)
        session = ModelSession(pool)
        logits = await session.run(np.asarray([PROMPT], np.int32), chunk_tokens=5)
        ids, rows = [], []
        for _ in range(8):
            rows.append(logits[0].copy())
            ids.append(int(np.argmax(logits[0])))
            logits = await session.decode(ids[-1])
        assert await session.delete() == 204
        await pool.aclose()
    # numpy sends float32 into the torch node; the torch node sends bf16 on.
    assert set(middle) == {"float32"} and set(last) == {"bfloat16"}
    assert len(last) == 3 + 8
    reference = [StageRunner.load(checkpoint, range(0, 1)),
                 load_torch_runner(checkpoint, range(1, 3), dtype="bfloat16", device=device),
                 StageRunner.load(checkpoint, range(3, 4))]  # fmt: skip
    want_ids, want_rows = greedy(reference, PROMPT, 8)
    assert ids == want_ids
    assert np.array_equal(np.stack(rows), want_rows)


@pytest.mark.parametrize("device", DEVICES)
async def test_a_bf16_torch_node_under_wire_dtype_float32_sends_float32(
    checkpoint: Path, device: str
) -> None:
    torch_bf16 = ["--engine", "torch", "--dtype", "bfloat16", "--wire-dtype", "float32",
                  "--device", device]  # fmt: skip
    async with start_model_chain(checkpoint, [(0, 2), (2, 4)], per_node=[torch_bf16, []]) as nodes:
        seen: list[str] = []
        record_inputs(nodes[1].app.stage, seen)
        pool = DownstreamPool(nodes[0].url)
        logits = await ModelSession(pool).run(np.asarray([PROMPT], np.int32))
        await pool.aclose()
    assert seen == ["float32"]
    reference = load_torch_runner(checkpoint, range(0, 2), dtype="bfloat16", device=device)
    hidden = reference.run("r", 0, np.asarray([PROMPT], np.int32))
    assert hidden.dtype == np.dtype(ml_dtypes.bfloat16)
    want = StageRunner.load(checkpoint, range(2, 4)).run("r", 0, hidden.astype(np.float32))
    assert np.array_equal(logits, want)


@pytest.mark.parametrize("device", DEVICES)
async def test_torch_node_kv_budget_full_is_503(checkpoint: Path, device: str) -> None:
    per_position = 2 * 4 * 2 * 16 * 4  # K and V, 4 layers, 2 KV heads, head_dim 16, float32
    budget = 64 * per_position  # one block: one session
    flags = ["--engine", "torch", "--kv-budget-bytes", str(budget), "--device", device]
    async with start_model_chain(checkpoint, [(0, 4)], extra=flags) as nodes:
        pool = DownstreamPool(nodes[0].url)
        first = ModelSession(pool)
        await first.run(np.asarray([PROMPT], np.int32))
        with pytest.raises(ChainError) as refused:
            await ModelSession(pool).run(np.asarray([PROMPT], np.int32))
        assert (refused.value.status, refused.value.code) == (503, "kv_memory_full")
        assert nodes[0].app.stage.kv_bytes_in_use == budget
        assert await first.delete() == 204
        assert nodes[0].app.stage.kv_bytes_in_use == 0
        await pool.aclose()
