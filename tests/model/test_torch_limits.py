"""Issue 13's limits on the torch engine (issue 15) and on every family (issue 11).

The runner owns the deadline and the session's life for whichever engine
computes: the torch engine stops between layers exactly as the numpy one
does. The cost check reads the shapes from ``ModelConfig`` (qwen3's
``head_dim`` is not ``hidden / heads``), also for a stage loaded from a GGUF
file, and prices the torch engine's attention, which scores the whole chunk
at once, above the numpy engine's 128-row blocks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.engines.torch import load_torch_runner
from meshnet_model.errors import ChunkTooLarge
from meshnet_model.stage.costs import QUERY_BLOCK, chunk_cost
from meshnet_model.testing import small_config, write_checkpoint
from support.gguf import build_model, write_model_gguf
from support.torch import CUDA


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=4)


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 128 with hidden 64 and 4 heads: a cost from hidden / heads is 8x short.
    return write_model_gguf(tmp_path_factory.mktemp("gguf"), build_model("qwen3", layers=2))


def ids(count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.int32).reshape(1, count) * 7) % 256


# The deadline and a session ended mid-compute, on the torch engine as on the
# numpy one: test_surface_units.py runs them on both (the ``engine`` fixture).


def test_both_engines_are_costed_for_their_aligned_query_blocks(checkpoint: Path) -> None:
    """Both attend QUERY_BLOCK queries at a time (stage.batch): a limit below
    the cost of scoring a 512-token chunk at once takes it on either engine."""
    config = small_config()
    blocked = chunk_cost(config, batch=1, tokens=512, context=512, last=True)
    whole = chunk_cost(config, batch=1, tokens=512, context=512, last=True, query_block=None)
    heads = config.num_attention_heads
    assert whole.attention - blocked.attention == heads * (512 - QUERY_BLOCK) * 512 * 5
    limit = (blocked.total + whole.total) // 2
    StageRunner.load(checkpoint, max_compute_bytes=limit).check_head((1, 512), "int32")
    torch_runner = load_torch_runner(checkpoint, dtype="float32", max_compute_bytes=limit)
    torch_runner.check_head((1, 512), "int32")
    tight = load_torch_runner(checkpoint, dtype="float32", max_compute_bytes=blocked.total - 1)
    with pytest.raises(ChunkTooLarge, match="--max-compute-bytes"):
        tight.check_head((1, 512), "int32")


@pytest.mark.parametrize("engine", ["numpy", "torch", pytest.param("torch-cuda", marks=CUDA)])
def test_costs_of_a_gguf_stage_use_its_config_head_dim(qwen3_gguf: Path, engine: str) -> None:
    if engine.startswith("torch"):
        device = "cuda" if engine == "torch-cuda" else "cpu"
        runner = load_torch_runner(qwen3_gguf, dtype="float32", device=device)
    else:
        runner = StageRunner.load(qwen3_gguf)
    c = runner.config
    assert (c.model_type, c.head_dim, c.hidden_size // c.num_attention_heads) == ("qwen3", 128, 16)
    block = QUERY_BLOCK  # both engines
    cost = chunk_cost(c, batch=1, tokens=256, context=c.max_position_embeddings, last=True,
                      query_block=block)  # fmt: skip
    qkv = 256 * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * 128 * 4
    assert cost.attention >= qkv
    runner.max_compute_bytes = cost.total
    runner.check_head((1, 256), "int32")  # exactly at the limit: taken
    runner.max_compute_bytes = cost.total - 1
    with pytest.raises(ChunkTooLarge, match="--max-compute-bytes"):
        runner.check_head((1, 256), "int32")


def test_a_sliding_window_does_not_shrink_the_cost() -> None:
    # Both engines score every cached key and mask those outside the window.
    plain = chunk_cost(small_config(), batch=1, tokens=300, context=512, last=False)
    windowed = chunk_cost(small_config(model_type="mistral", sliding_window=8), batch=1,
                          tokens=300, context=512, last=False)  # fmt: skip
    assert windowed == plain
