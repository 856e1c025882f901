"""``meshnet generate`` says how fast it went (issue 22, "Why" 4: it printed
only token counts). Run as a user runs it, in a subprocess, against a gateway
serving a tiny checkpoint over two model nodes; its stderr summary is parsed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from support.gateway import clean_env
from support.openai import serve_openai, write_model_dir

pytestmark = pytest.mark.anyio

SUMMARY = re.compile(
    r"^\[finish_reason (?P<finish>\w+), (?P<prompt>\d+) prompt \+ (?P<completion>\d+) "
    r"completion tokens, TTFT (?P<ttft>\d+\.\d{3}) s, (?P<rate>\d+\.\d) tok/s\]$"
)


async def test_generate_prints_ttft_and_tokens_per_second(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    async with serve_openai(model_dir) as served:
        argv = [sys.executable, "-m", "meshnet_cli", "generate", "--gateway", served.url,
                "--prompt", "hello world", "--max-tokens", "8", "--temperature", "0"]  # fmt: skip
        with anyio.fail_after(120):
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, capture_output=True, text=True, env=clean_env())
            )
    assert done.returncode == 0, done.stderr
    summary = SUMMARY.match(done.stderr.strip().splitlines()[-1])
    assert summary is not None, done.stderr
    assert (summary["finish"], summary["completion"]) == ("length", "8")
    assert float(summary["ttft"]) >= 0 and float(summary["rate"]) > 0
