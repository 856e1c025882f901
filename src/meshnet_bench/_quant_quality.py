"""``meshnet bench --only quant``: the quality half, in this process.

``meshnet_model.testing.quality.compare`` of each torch configuration
(bf16 dequantized, held quantized) against numpy float32 on the same file:
the real model on ``PROSE`` (all its tokens), a generated file on random ids.
The chains' speed and memory are ``quant``'s own.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # typing only: quant imports this module
    from meshnet_bench.quant import _Model, _Plan

__all__ = ["quality", "quality_ids", "torch_available"]


def torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


class _Fixed:
    """An engine whose ``score`` is logits computed once (the reference, so
    that ``compare`` against two candidates scores it only once)."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits = logits

    def new_cache(self, budget: Any, batch: int) -> _Fixed:
        return self

    def close(self) -> None:
        pass

    def score(self, ids: np.ndarray, cache: Any) -> np.ndarray:
        return self.logits


def quality(model: _Model, ids: np.ndarray, progress: Callable[[str], None]) -> None:
    """KL / top-1 of each torch configuration against numpy float32, in process."""
    import gc

    from meshnet_model import StageModel, StageRunner
    from meshnet_model.stage.kv_cache import KVBudget
    from meshnet_model.testing.quality import compare

    progress(f"quant: {model.label}: numpy float32 reference over {ids.shape[1]} positions")
    reference = StageRunner.load(model.path).model
    assert isinstance(reference, StageModel)  # load's default engine, the one that scores
    cache = reference.new_cache(KVBudget(1 << 40), 1)
    try:
        logits = np.asarray(reference.score(ids, cache))
    finally:
        cache.close()
    del reference, cache
    gc.collect()
    fixed = _Fixed(logits)
    if not torch_available():
        return
    import torch

    from meshnet_model.engines.torch.engine import load_torch_runner

    torch.set_num_threads(os.cpu_count() or 1)
    for name, dtype in (("bf16", "bfloat16"), ("keep", "keep")):
        progress(f"quant: {model.label}: torch {dtype} against it")
        candidate = load_torch_runner(model.path, dtype=dtype).model
        model.quality[name] = compare(fixed, candidate, ids)
        del candidate
        gc.collect()


def quality_ids(model: _Model, plan: _Plan) -> np.ndarray:
    if model.key == "smollm2":
        from meshnet_model.formats.gguf.tokenizer import load_gguf_tokenizer
        from meshnet_model.testing.quality import PROSE

        ids = load_gguf_tokenizer(model.path).tokenizer.encode(PROSE).ids
        if not plan.kl_positions >= 512:
            ids = ids[: plan.kl_positions]
        return np.asarray([ids], np.int32)
    rng = np.random.default_rng(1)
    return rng.integers(0, model.vocab, (1, plan.kl_positions)).astype(np.int32)
