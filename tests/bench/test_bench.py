"""``meshnet bench``: the machinery runs end to end at tiny sizes.

No timing is asserted (the machine is shared): only that every section runs,
every key of the issue is in the one JSON object with a sane type, the
table names every section, and the pieces the figures rest on behave
(wire 1 round-trips, a failing section is reported, --plot explains a
missing matplotlib).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meshnet_bench import BenchOptions, SectionResult, runner
from meshnet_bench._support import percentile
from meshnet_bench._wire1 import Wire1Client, decode_body, encode_body, serve_wire1
from support.gateway import clean_env

pytestmark = pytest.mark.slow

# The keys, each with the type its value must have (the sections
# with tests of their own check theirs there).
KEYS = {
    "wire1_over_wire2_time": float,
    "wire2_over_wire1_bytes": float,
    "hop_over_raw_throughput": float,
    "decode_p50_us": float,
    "decode_p99_us": float,
    "decode_over_bare_h11_p50": float,
    "pipeline_efficiency": float,
    "identity_decode_us_64mib": float,
    "zstd_ratio_bf16": float,
    "relay_rss_over_payload": float,
    "failover_recovery_over_step": float,
    "failover_extra_over_prefill": float,
    "failover_replayed_tokens": int,
}


# Sections with a test file of their own (tests/bench/test_<section>.py) run
# there; this test runs the others, through the CLI, in one process.
OWN_TESTS = {path.stem.removeprefix("test_") for path in Path(__file__).parent.glob("test_*.py")}
HERE = [name for name in runner.SECTIONS if name not in OWN_TESTS]


def test_every_section_is_run_by_a_test() -> None:
    # A section left out of the CLI run below is one its own file imports and runs.
    here = Path(__file__).parent
    for name in set(runner.SECTIONS) & OWN_TESTS:
        source = (here / f"test_{name}.py").read_text()
        imports = (f"from meshnet_bench import {name}\n", f"from meshnet_bench.{name} import ")
        assert any(line in source for line in imports), f"test_{name}.py does not import {name}"
        assert "tiny=True" in source, f"test_{name}.py does not run {name} at tiny sizes"
    assert {"wire", "hop", "decode", "pipeline", "codec", "memory", "failover"} <= set(HERE)


def test_tiny_bench_json_has_every_key_with_a_sane_value() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshnet_cli",
            "bench",
            "--tiny",
            "--json",
            "--only",
            ",".join(HERE),
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    keys = json.loads(done.stdout)  # stdout is the JSON object alone
    assert "failed" not in keys
    for key, kind in KEYS.items():
        assert isinstance(keys[key], kind), (key, keys[key])
        assert math.isfinite(keys[key]) and keys[key] > 0, (key, keys[key])
    # Ratios of sizes do not depend on timing: wire 2 bf16+zstd is well under wire 1.
    assert keys["wire2_over_wire1_bytes"] < 0.5
    assert keys["zstd_ratio_bf16"] < 1.0
    # Progress went to stderr, one line per section at least.
    for section in HERE:
        assert f"{section}: done in" in done.stderr


def test_the_table_names_every_section_and_marks_targets() -> None:
    results = [SectionResult("one", keys={"pipeline_efficiency": 0.5},
                             rows=[{"a": "1", "b": "22"}], notes=["a note"])]  # fmt: skip
    text = runner.render(results, {"pipeline_efficiency": 0.5, "other": 1}, "header")
    assert "one" in text and "a note" in text
    assert "pipeline_efficiency" in text and "not met" in text
    assert runner.verdict("pipeline_efficiency", 0.9) == "met"
    assert runner.verdict("relay_rss_over_payload", 2.0) == "met"
    assert runner.verdict("relay_rss_over_payload", None) == "n/a"


def test_a_failing_section_is_reported_and_its_keys_are_null(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Broken:
        KEYS = ("broken_key",)

        @staticmethod
        def run(options: BenchOptions) -> SectionResult:
            raise RuntimeError("boom")

    monkeypatch.setattr(runner, "load_section", lambda name: Broken)
    lines: list[str] = []
    results, keys = runner.run_sections(BenchOptions(tiny=True, progress=lines.append), ["x"])
    assert keys == {"broken_key": None, "failed": "x"}
    assert "FAILED" in results[0].title
    # One line, no traceback (MESHNET_BENCH_TRACEBACK=1 asks for one).
    assert [line for line in lines if "boom" in line] == ["x: FAILED: RuntimeError: boom"]
    assert not any("Traceback" in line for line in lines)


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "plot_available", lambda: False)
    assert runner.main(tiny=True, plot=runner.DEFAULT_PLOT, only=["codec"]) == 2


def test_plot_draws_a_png(tmp_path: Path) -> None:
    lines: list[str] = []
    path = runner.draw_plot(BenchOptions(tiny=True, progress=lines.append), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(line.startswith("plot: ") for line in lines)


def test_wire1_body_round_trips_and_grows_by_a_third() -> None:
    array = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)
    body = encode_body(array)
    assert np.array_equal(decode_body(body), array)
    assert len(body) > array.nbytes * 4 / 3
    assert json.loads(body)["dtype"] == "float32"


@pytest.mark.anyio
async def test_a_wire1_chain_relays_the_stage_output() -> None:
    array = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 4, 16)
    async with serve_wire1(stage=lambda a: a * 2) as last, serve_wire1(last.url) as entry:
        client = Wire1Client.for_url(entry.url)
        try:
            for _ in range(2):  # keep-alive: the second request reuses the connection
                assert np.array_equal(decode_body(await client.post(encode_body(array))),
                                      array * 2)  # fmt: skip
        finally:
            await client.aclose()


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([7.0], 0.99) == 7
