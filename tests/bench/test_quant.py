"""``meshnet bench --only quant`` in its smallest mode: a toy generated GGUF file."""

from __future__ import annotations

import importlib.util

import pytest

from meshnet_bench import quant
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, render

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="the quantized configurations need torch"
)


def test_quant_section_tiny():
    lines: list[str] = []
    result = quant.run(BenchOptions(tiny=True, progress=lines.append))
    keys = result.keys
    assert "quant" in SECTIONS
    for config in ("numpy", "bf16", "keep", "keep1"):
        prefix = f"quant_tiny_{config}_"
        assert keys[prefix + "decode_tokens_per_s"] > 0
        assert keys[prefix + "prefill_tokens_per_s"] > 0
        assert keys[prefix + "rss_over_file"] > 1  # a toy file: the interpreter dominates
        assert keys[prefix + "peak_over_rss"] >= 1
        assert 0 < keys[prefix + "load_s"] < 300
    for config in ("bf16", "keep"):
        assert 0 <= keys[f"quant_tiny_{config}_kl_mean"] < 0.1
        assert 0.5 <= keys[f"quant_tiny_{config}_top1"] <= 1
    for other in ("numpy", "bf16"):
        for what in ("decode", "prefill"):
            assert keys[f"quant_tiny_keep_over_{other}_{what}"] > 0
    assert keys["quant_load_average"] >= 0
    assert not any(k.startswith(("quant_smollm2", "quant_llama1b")) for k in keys)
    assert len(result.rows) == 4
    text = render([result], keys, "header")
    assert "torch quantized (keep)" in text and "numpy float32" in text
    assert any("decode" in line for line in lines)


def test_quant_keys_declared():
    assert len(set(quant.KEYS)) == len(quant.KEYS)
    assert "quant_smollm2_keep_over_llama_cpp_decode" in quant.KEYS
    assert "quant_llama1b_keep_kl_mean" in quant.KEYS
