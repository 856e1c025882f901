"""The quantized error budget (issue 18, test_quantized_budget) with every
whole tile of 64 positions forced through the dense GEMM
(``MESHNET_QUANT_KERNEL=dense``, engines/torch/dense_tiles): against the
float32 reference (the numpy engine on the same file), over every position
of a teacher-forced sequence of 512+ tokens — 8 whole tiles and the rest.

The tiles round each weight once more, to bfloat16 (a relative 2^-9 at
most, against the 4-bit grid's steps of 1/16 of a block's range): the
budget is the same as int4pack's. The real model's test runs only where
the CPU multiplies bfloat16 (``bf16_units``); the random files' run everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.engines.torch.calibrate import ENV
from meshnet_model.engines.torch.engine import load_torch_runner
from meshnet_model.formats.gguf.tokenizer import load_gguf_tokenizer
from meshnet_model.testing.quality import PROSE, compare
from support.gguf import build_model, write_k_quant_gguf, write_model_gguf
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow

KL_BUDGET = 0.005  # nats, mean over positions (test_quantized_budget)
REAL_TOP1 = 0.95
RANDOM_TOP1 = 0.90


def _dense(path: Path, monkeypatch: pytest.MonkeyPatch) -> StageRunner:
    monkeypatch.setenv(ENV, "dense")
    runner = load_torch_runner(path, dtype="keep")
    assert runner.model.describe()["kernels"]["prompt_tiles"] == "dense"
    return runner


@pytest.mark.bf16_units  # 30 layers of 512 positions, every tile dense: minutes without
def test_the_real_model_with_dense_tiles_is_within_the_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = smollm2_gguf()
    ids = np.array([load_gguf_tokenizer(path).tokenizer.encode(PROSE).ids], np.int32)
    assert ids.shape[1] >= 512
    agreement = compare(StageRunner.load(path).model, _dense(path, monkeypatch).model, ids)
    assert agreement.kl_mean <= KL_BUDGET, agreement
    assert agreement.top1 >= REAL_TOP1, agreement


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K+Q6_K"])
def test_every_int4pack_type_with_dense_tiles_is_within_the_budget(
    tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_model("llama", layers=4, seed=3, hidden=256)
    if qtype == "Q4_K+Q6_K":
        path = write_k_quant_gguf(tmp_path, model)
    else:
        path = write_model_gguf(tmp_path, model, qtype)
    ids = np.random.default_rng(0).integers(0, model.config["vocab_size"], (1, 512))
    reference = StageRunner.load(path).model
    agreement = compare(reference, _dense(path, monkeypatch).model, ids.astype(np.int32))
    assert agreement.kl_mean <= KL_BUDGET, agreement
    assert agreement.top1 >= RANDOM_TOP1, agreement
