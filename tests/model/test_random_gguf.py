"""Random GGUF files of real shapes (meshnet_model.testing.random_gguf)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.formats.gguf.checkpoint import GGUFCheckpoint
from meshnet_model.formats.gguf.file import GGUFFile
from meshnet_model.stage.kv_cache import KVBudget
from meshnet_model.testing.quality import log_softmax
from meshnet_model.testing.random_gguf import (
    LLAMA_3_2_1B,
    LLAMA_3_2_3B,
    QTYPES,
    TINY,
    TINY_WEIGHT_STD,
    WEIGHT_STD,
    tensor_plan,
    write_random_gguf,
)

# Bytes per 256 values of each encoding.
_PER_256 = {"F32": 1024, "F16": 512, "Q4_0": 144, "Q4_1": 160, "Q8_0": 272, "Q4_K": 144,
            "Q6_K": 210}  # fmt: skip


def _logits(path, tokens: int = 12) -> np.ndarray:
    model = StageRunner.load(path).model
    cache = model.new_cache(KVBudget(1 << 30), 1)
    ids = np.random.default_rng(1).integers(0, TINY["vocab_size"], (1, tokens)).astype(np.int32)
    try:
        return np.asarray(model.score(ids, cache))[0]
    finally:
        cache.close()


@pytest.mark.parametrize("qtype", QTYPES)
def test_tiny_file_reads_back_and_computes(tmp_path, qtype):
    path = write_random_gguf(tmp_path / f"tiny-{qtype}.gguf", TINY, qtype,
                             weight_std=TINY_WEIGHT_STD)  # fmt: skip
    file = GGUFFile(path)
    plan = list(tensor_plan(TINY))
    assert len(file.tensors) == len(plan)  # tied, no rope scaling: no output/rope_freqs
    for name, shape, _std in plan:
        tensor = file.tensors[name]
        expected = "F32" if len(shape) == 1 else qtype
        assert tensor.tensor_type.name == expected, name
        assert tuple(int(x) for x in tensor.shape.tolist()[::-1]) == shape, name
    checkpoint = GGUFCheckpoint(path)
    up = np.asarray(checkpoint.tensor("model.layers.0.mlp.up_proj.weight"), np.float32)
    assert up.std() == pytest.approx(TINY_WEIGHT_STD, rel=0.15)
    assert abs(float(up.mean())) < 0.05 * TINY_WEIGHT_STD
    norm = np.asarray(checkpoint.tensor("model.norm.weight"), np.float32)
    assert np.all(norm == 1.0)
    logits = _logits(path)
    assert np.isfinite(logits).all()
    logp = log_softmax(logits)
    entropy = -(np.exp(logp) * logp).sum(-1)
    # Peaked but not one-hot, and not the same token everywhere.
    assert np.all(entropy < 0.9 * math.log(TINY["vocab_size"]))
    assert entropy.mean() > 0.3
    assert len(set(logits.argmax(-1).tolist())) > 3


def test_same_seed_same_file(tmp_path):
    a = write_random_gguf(tmp_path / "a.gguf", TINY, "Q4_1", seed=3)
    b = write_random_gguf(tmp_path / "b.gguf", TINY, "Q4_1", seed=3)
    c = write_random_gguf(tmp_path / "c.gguf", TINY, "Q4_1", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_llama_1b_shape_header_and_bytes(tmp_path):
    path = write_random_gguf(tmp_path / "llama-1b-q4_0.gguf", LLAMA_3_2_1B, "Q4_0")
    file = GGUFFile(path)
    config = LLAMA_3_2_1B
    # embedding + 9 per layer + output norm + rope_freqs (tied: no output.weight)
    assert len(file.tensors) == 1 + 9 * config["num_hidden_layers"] + 1 + 1
    matrices = sum(math.prod(s) for _, s, _ in tensor_plan(config) if len(s) == 2)
    vectors = sum(math.prod(s) for _, s, _ in tensor_plan(config) if len(s) == 1)
    assert matrices + vectors == 1_235_814_400  # Llama 3.2 1B's published parameter count
    data = sum(int(t.n_bytes) for t in file.tensors.values())
    assert data == matrices // 256 * _PER_256["Q4_0"] + 4 * vectors + 4 * 32
    assert path.stat().st_size == pytest.approx(data, rel=0.001)
    runner = StageRunner.load(path, range(0, 1))
    c = runner.model.config if hasattr(runner.model, "config") else runner.config
    assert c.hidden_size == 2048 and c.num_key_value_heads == 8 and c.head_dim == 64
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.factor == 32.0
    assert c.rope_scaling.original_max_position_embeddings == 8192
    assert c.tie_word_embeddings


def test_llama_3b_shape_plan():
    """The 3B shape's tensors (not written: 1.8 GB)."""
    plan = list(tensor_plan(LLAMA_3_2_3B))
    assert len(plan) == 1 + 9 * 28 + 1
    params = sum(math.prod(s) for _, s, _ in plan)
    assert params == pytest.approx(3.21e9, rel=0.01)
    assert {std for n, s, std in plan if len(s) == 2 and n != "token_embd.weight"} == {WEIGHT_STD}
