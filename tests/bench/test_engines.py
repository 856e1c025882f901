"""The engines section of ``meshnet bench`` runs end to end (tiny mode).

No timing is asserted (a shared machine): the section must measure every
engine on node processes (1 node each in tiny mode; 1 and 2 in a real run),
report each stage's resident memory, the transformers reference and the
bandwidth limit, and own its keys.
"""

from __future__ import annotations

import math

from meshnet_bench import BenchOptions
from meshnet_bench.engines import KEYS, run, weight_bytes_per_step
from meshnet_model.testing import smollm_135m_config


def test_engines_section_measures_every_engine_with_rss_and_references() -> None:
    lines: list[str] = []
    result = run(BenchOptions(tiny=True, progress=lines.append))
    assert set(result.keys) == set(KEYS)
    # Tiny mode runs one node per engine: no split ratio (the full run has it).
    assert result.keys["engines_torch_f32_split2_over_single_decode"] is None
    for key in set(KEYS) - {"engines_torch_f32_split2_over_single_decode"}:
        value = result.keys[key]
        assert isinstance(value, float) and math.isfinite(value) and value >= 0, (key, value)
    engines = [(row["engine"], row["nodes"]) for row in result.rows]
    assert engines[:3] == [(e, "1") for e in ("numpy float32", "torch float32", "torch bfloat16")]
    assert engines[3][0] == "transformers generate float32"
    assert [e for e, _ in engines[4:]] == [f"limit: {d} weights / bandwidth"
                                           for d in ("float32", "bfloat16")]  # fmt: skip
    for row in result.rows[:3]:
        stages = row["RSS per stage MiB"].split(" + ")
        assert len(stages) == int(row["nodes"]) and all(int(s) > 0 for s in stages)
        assert float(row["prefill tok/s"]) > 0 and float(row["decode tok/s"]) > 0
    assert any("llama.cpp" in note for note in result.notes)
    assert lines and all(line.startswith("engines:") for line in lines)


def test_the_decode_limit_counts_every_matrix_once() -> None:
    # SmolLM-135M: 30 layers of q,k,v,o and the MLP, plus the tied head: 134.5M numbers.
    config = smollm_135m_config()
    assert weight_bytes_per_step(config, 4) == 4 * (30 * 3_538_944 + 49152 * 576)
