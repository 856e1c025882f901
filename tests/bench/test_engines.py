"""The engines section of ``meshnet bench`` runs end to end (tiny mode).

No timing is asserted (a shared machine): the section must measure every
engine on node processes (1 node each in tiny mode; 1 and 2 in a real run),
report each stage's resident memory, the transformers reference and the
bandwidth limit, and own its keys.
"""

from __future__ import annotations

import math

from meshnet_bench import BenchOptions
from meshnet_bench.engines import KEYS, decode_tokens_per_s, run, weight_bytes_per_step
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


def test_a_decode_rate_is_the_tokens_after_the_first_over_their_interval() -> None:
    # Four tokens stamped in one run: three decode steps in 1.5 s.
    assert decode_tokens_per_s([10.0, 10.5, 11.0, 11.5]) == 2.0
    assert decode_tokens_per_s([3.0, 3.25]) == 4.0


def test_a_decode_rate_that_cannot_be_measured_is_none_not_a_huge_number() -> None:
    """Issue 22: ``bench --quick`` printed ``engines_transformers_decode_tokens_per_s
    6000000000.0`` — 6 tokens over ``max(total - first, 1e-9)``, the interval of
    two separately timed runs, which load noise made zero or negative. With
    fewer than two tokens timed, or no time between the first and the last,
    there is no rate: ``None`` (printed "n/a"), never 6 / 1e-9."""
    assert decode_tokens_per_s([]) is None
    assert decode_tokens_per_s([7.0]) is None  # one token is the prefill's, no decode step
    assert decode_tokens_per_s([7.0, 7.0, 7.0]) is None  # the clock did not advance
    assert decode_tokens_per_s([7.0, 6.5]) is None  # not one run's monotonic stamps
