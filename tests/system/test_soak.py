"""The soak's short form (issue 6): ~10 s of sessions coming and going through
a gateway and two node processes; throughput and RSS are reported every
second and no process may grow past the bound after the warm-up.

The long form is the same command with a longer ``--seconds`` (docs/multihost.md
has a three-minute run); it is not part of the suite.
"""

from __future__ import annotations

import subprocess
import sys

from support.gateway import clean_env


def test_short_soak_reports_throughput_and_rss_without_growth() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_bench.soak", "--seconds", "8", "--interval", "1",
         "--sessions", "8", "--json"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "soak: ok"
    assert "gateway RSS MiB" in lines[0] and "node1 RSS MiB" in lines[0]
    assert any(line.startswith("gateway: RSS growth after warm-up") for line in lines)
    assert "errors 0, wrong answers 0" in done.stdout
