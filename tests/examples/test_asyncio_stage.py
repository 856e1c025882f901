"""examples/asyncio_stage.py: a node with a custom stage embedded in asyncio.

Run as a user runs it (a subprocess, plain ``asyncio.run``): the stage
computes, chunks of 128 go through it over loopback, the output is checked
bit for bit by the example itself, and its exit status says so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "asyncio_stage.py"


def test_asyncio_program_embeds_a_node_with_its_own_stage() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("node with stage 'affine' listening on http://127.0.0.1:")
    assert [line.split()[1] for line in lines if line.lstrip().startswith("chunk")] == [
        "0/3",
        "1/3",
        "2/3",
    ]
    assert "position 256  shape 1x44x64  float32 zstd" in result.stdout
    assert lines[-1] == "output == x * 2 + 1, bit for bit: yes"
