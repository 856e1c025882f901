"""GGUF files against transformers loading the very same file: the family x
quantization x stages matrix.

Small random models of each family are built by transformers (GQA 4/2 heads, 4
layers, hidden 64), written as llama.cpp's converter writes them (q/k permuted
for llama and mistral, qwen3's q/k norms as ``attn_q_norm``/``attn_k_norm``,
qwen2's q/k/v biases, mistral as architecture ``llama`` with
``llama.attention.sliding_window`` 8 — shorter than the 44 positions decoded,
so the window masks keys), in F32, Q8_0 and Q4_0, then run by our stages —
1, 2 and 3 of them, the prompt in chunks of 5 then one token per run — and by
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``. Both decode the
same quantized bytes, so quantization costs nothing here; what is left is
float32 summation order (numpy vs torch BLAS), hence the tolerance below.

The K-quant file ("Q4_K_M"-like: Q4_K matrices, Q6_K embedding, v and down)
holds random K-quant blocks, since the gguf package cannot encode those types.

Tolerance: greedy tokens identical over 32 steps; every step's logits within
``LOGIT_TOLERANCE`` times max(1, the largest logit) (measured: at most 1.1e-6
relative for F32/Q8_0/Q4_0 at hidden 64, 1.7e-6 for the Q4_K/Q6_K file at
hidden 256 — longer dot products, more rounding; docs/models.md has every
cell). The bound leaves a ~30x margin for other BLAS builds.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from meshnet_model.formats.gguf.checkpoint import GGUFCheckpoint
from meshnet_model.source import load_config
from meshnet_node.model_chain import ModelSession, even_splits, start_model_chain
from meshnet_runtime.downstream import DownstreamPool
from support.gguf import (
    build_model,
    hf_from_gguf,
    hf_greedy,
    hf_reference,
    write_k_quant_gguf,
    write_model_gguf,
)
from support.reference import chain_generate, logit_error

pytest.importorskip("transformers", reason="the reference tests need the test extra")

STEPS = 32
LOGIT_TOLERANCE = 5e-5
PROMPT = [1, 17, 250, 33, 99, 400, 7, 123, 56, 310, 12, 77]
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
QUANTS = ("F32", "Q8_0", "Q4_0")
# (file, stages): every family x quantization through 1, 2 and 3 stages; the
# K-quant file has 2 layers, so 1 and 2.
MATRIX = [(f"{kind}-{q}", n) for kind in FAMILIES for q in QUANTS for n in (1, 2, 3)]
MATRIX += [("llama-Q4_K_M", 1), ("llama-Q4_K_M", 2)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed, kind in enumerate(FAMILIES):
        model = build_model(kind, seed=3 + seed)
        out.update({f"{kind}-{q}": write_model_gguf(root, model, q) for q in QUANTS})
    # K-quants need rows of 256: a wider model, 2 layers.
    out["llama-Q4_K_M"] = write_k_quant_gguf(root, build_model("llama", 2, seed=7, hidden=256))
    return out


@cache
def reference(path: Path) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and per-step logits for one file (once per file)."""
    return hf_greedy(hf_reference(path), PROMPT, STEPS)


def test_the_files_are_the_families_they_claim(files: dict[str, Path]) -> None:
    """The matrix runs what its names say: the family the config reader made of
    each file, with the switch that family exercises."""
    for name, path in files.items():
        config = load_config(path)
        kind = name.split("-")[0]
        assert config.model_type == kind, name
        assert config.qkv_bias == (kind == "qwen2"), name
        assert config.qk_norm == (kind == "qwen3"), name
        windows = {config.layer_window(i) for i in range(config.num_hidden_layers)}
        assert windows == ({8} if kind == "mistral" else {None}), name


@pytest.mark.parametrize(("name", "stages"), MATRIX)
def test_greedy_equals_transformers_on_the_same_gguf(
    files: dict[str, Path], name: str, stages: int
) -> None:
    path = files[name]
    layers = load_config(path).num_hidden_layers
    want, want_logits = reference(path)
    assert len(set(want)) >= 5, f"degenerate reference: {want}"  # not one token
    got, logits = chain_generate(path, even_splits(layers, stages), PROMPT, STEPS)
    assert got == want
    error = logit_error(logits, want_logits)
    print(f"\nGGUF-MATRIX {name} stages={stages} max_logit_error={error:.2e}")
    assert error <= LOGIT_TOLERANCE


def test_weights_equal_transformers_state_dict(files: dict[str, Path]) -> None:
    """Every tensor, under its HF name, equals what transformers loaded from the
    file: names, shapes, dequantization and the q/k un-permutation."""
    for name in ("llama-Q4_0", "llama-Q4_K_M", "qwen2-Q8_0", "qwen3-F32", "mistral-Q4_0"):
        ckpt = GGUFCheckpoint(files[name])
        state = hf_from_gguf(files[name]).state_dict()
        for key, value in state.items():
            if key == "lm_head.weight" and ckpt.config["tie_word_embeddings"]:
                continue
            ours = np.asarray(ckpt.tensor(key), dtype=np.float32)
            assert np.array_equal(ours, value.numpy()), key


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "stages"),
    [("llama-F32", 2), ("llama-Q4_0", 2), ("mistral-Q4_0", 3), ("qwen3-Q8_0", 3)],
)
async def test_loopback_nodes_greedy_equals_transformers(
    files: dict[str, Path], name: str, stages: int
) -> None:
    """The same through real nodes over sockets (wire 2, each node's KV cache)."""
    path = files[name]
    want, want_logits = reference(path)
    splits = even_splits(load_config(path).num_hidden_layers, stages)
    # The numpy engine, the float32 reference that equals transformers' own
    # dequantized load (the default on a GGUF file, torch quantized, is held to
    # an error budget instead: tests/test_quantized_budget.py).
    extra = ["--log-level", "warning", "--engine", "numpy"]
    async with start_model_chain(path, splits, extra=extra) as nodes:
        pool = DownstreamPool(nodes[0].url)
        try:
            session = ModelSession(pool)
            logits = await session.run(np.array([PROMPT], np.int32), chunk_tokens=5)
            got, rows = [], []
            for _ in range(STEPS):
                rows.append(logits[0])
                got.append(int(np.argmax(logits[0])))
                logits = await session.decode(got[-1])
            await session.delete()
        finally:
            await pool.aclose()
    assert got == want
    assert logit_error(np.stack(rows), want_logits) <= LOGIT_TOLERANCE
