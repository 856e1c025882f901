"""docs/across-machines.md's commands, run on one machine's loopback as the
page says they were (issue 43, point 2): ``machine-a`` and ``machine-b``
both 127.0.0.1, the ports moved to free ones, the real SmolLM2 GGUF file.
A command the page gets wrong (a missing flag, a 401 from the health check)
fails here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from repo.test_readme_walkthrough import BIN, free_ports
from support.gateway import clean_env
from support.smollm2 import GGUF_NAME, smollm2_gguf

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "across-machines.md"


def page_script() -> str:
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    commands = [line[4:] for line in lines if line.startswith("    ")]
    return "\n".join(line for line in commands if not line.startswith("kill "))


def test_the_across_machines_page_runs_on_loopback(tmp_path: Path) -> None:
    gguf = smollm2_gguf()
    script = page_script().replace(".venv/bin/", f"{BIN}/").replace(GGUF_NAME, str(gguf))
    script = re.sub(r"machine-[ab]|0\.0\.0\.0", "127.0.0.1", script)
    for old, new in zip(("9001", "9002", "8500"), free_ports(3), strict=True):
        script = re.sub(rf"\b{old}\b", str(new), script)
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=tmp_path,
        env=clean_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out: {stdout!r} {stderr!r}") from None
    assert proc.returncode == 0, (stdout, stderr)
    rows = [line.split() for line in stdout.splitlines() if re.match(r"[01] +http", line)]
    assert [(row[0], row[2], row[6]) for row in rows] == [("0", "0:15", "ok"), ("1", "15:30", "ok")]
    assert "Paris" in stdout, stdout
