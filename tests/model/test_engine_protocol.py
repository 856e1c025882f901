"""Both engines are an ``Engine`` (``meshnet_model.engines.base``), each over its own cache.

The annotated assignments are the typing check (a type checker reads
``Engine[KVCache]`` / ``Engine[TorchKVCache]``); ``isinstance`` is the one at
run time: every member the runner uses is there.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnet_model import KVBudget, KVCache, StageModel, StageRunner
from meshnet_model.engines.base import Engine
from meshnet_model.stage.batch import ATTENTION_BLOCK
from meshnet_model.testing import small_config, write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt"), small_config(), seed=1)


def _check(engine: Engine[KVCache]) -> None:
    assert isinstance(engine, Engine)
    cache = engine.new_cache(KVBudget(1 << 24), 1)
    assert isinstance(cache, KVCache)
    out = engine.forward(np.array([[1, 2, 3]], dtype=np.int32), cache, 0)
    assert out.shape[0] == 1 and np.isfinite(out).all()
    assert isinstance(engine.describe(), dict)
    cache.close()


def test_the_numpy_engine_is_an_engine_and_the_runners_default(checkpoint: Path) -> None:
    runner = StageRunner.load(checkpoint)
    assert isinstance(runner.model, StageModel)
    engine: Engine[KVCache] = StageModel(runner.weights)
    assert engine.query_block is not None
    _check(engine)


def test_load_takes_the_limits_by_name_and_no_engine(checkpoint: Path) -> None:
    # load's limits were a ``**limits: int`` forwarded to the constructor, so
    # ``model=`` slipped through as the engine, unchecked (mypy found it).
    runner = StageRunner.load(checkpoint, max_chunk_tokens=64, max_compute_bytes=1 << 20)
    assert (runner.max_chunk_tokens, runner.max_compute_bytes) == (64, 1 << 20)
    with pytest.raises(TypeError, match="model"):
        StageRunner.load(checkpoint, model=object())  # type: ignore[call-arg]


def test_the_torch_engine_is_an_engine(checkpoint: Path) -> None:
    pytest.importorskip("torch")
    from meshnet_model.engines.torch import load_torch_runner
    from meshnet_model.engines.torch.engine import TorchStageModel
    from meshnet_model.engines.torch.kv_cache import TorchKVCache

    runner = StageRunner.load(checkpoint)  # the reference's shape, for the check below
    torch_runner = load_torch_runner(checkpoint, dtype="float32")
    assert isinstance(torch_runner.model, TorchStageModel)
    engine: Engine[TorchKVCache] = torch_runner.model
    assert engine.query_block == ATTENTION_BLOCK  # aligned query blocks, as numpy's
    assert isinstance(engine.new_cache(KVBudget(1 << 24), 1), TorchKVCache)
    _check(engine)
    assert runner.config == torch_runner.config
