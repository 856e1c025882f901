"""The engines section of ``meshnet bench`` runs end to end (tiny mode).

No timing is asserted (a shared machine): the section must measure every
engine on 1 and 2 node processes, report each stage's resident memory, the
transformers reference and the bandwidth limit, and own its keys.
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
    for key in KEYS:
        value = result.keys[key]
        assert isinstance(value, float) and math.isfinite(value) and value >= 0, (key, value)
    engines = [(row["engine"], row["nodes"]) for row in result.rows]
    assert engines[:6] == [(e, n) for e in ("numpy float32", "torch float32", "torch bfloat16")
                           for n in ("1", "2")]  # fmt: skip
    assert engines[6][0] == "transformers generate float32"
    for row in result.rows[:6]:
        stages = row["RSS per stage MiB"].split(" + ")
        assert len(stages) == int(row["nodes"]) and all(int(s) > 0 for s in stages)
        assert float(row["prefill tok/s"]) > 0 and float(row["decode tok/s"]) > 0
    assert any("llama.cpp" in note for note in result.notes)
    assert lines and all(line.startswith("engines:") for line in lines)


def test_the_decode_limit_counts_every_matrix_once() -> None:
    # SmolLM-135M: 30 layers of q,k,v,o and the MLP, plus the tied head: 134.5M numbers.
    config = smollm_135m_config()
    assert weight_bytes_per_step(config, 4) == 4 * (30 * 3_538_944 + 49152 * 576)
