"""The memory check and ``plan`` against what a real node holds (issue 43,
points 5 and 7): SmolLM2-135M Q4_1 node processes, their RSS read from
/proc after a 1,024-token prompt within a quarter of the need the plan and the
check name; that need the same whatever limit it is checked against; the
flags a refusal advises starting a node under the same limit; the ready line
of a numpy stage of a GGUF file naming the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_bench._support import current_rss_bytes, peak_rss_bytes, server_process
from meshnet_model.engines import choice
from meshnet_model.plan import plan_stages
from meshnet_node.model_chain import ModelSession
from meshnet_runtime.downstream import DownstreamPool
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow
MiB = 1 << 20


@contextmanager
def node(*flags: str) -> Iterator[tuple[int, str]]:
    argv = ["--model", str(smollm2_gguf()), "--port", "0", "--log-level", "warning", *flags]
    with server_process("meshnet_node", *argv, timeout=300) as (proc, url):
        yield proc.pid, url


async def prompt(url: str) -> None:
    """1,024 tokens in one chunk, then two greedy steps: a long chat's session,
    whose KV the least budget (64 MiB) still holds — the need counts that
    budget whole, so a shorter prompt leaves the node further below it."""
    pool = DownstreamPool(url)
    try:
        session = ModelSession(pool, timeout=300)
        logits = await session.run((np.arange(1, 1025, dtype=np.int32) % 49000)[None])
        for _ in range(2):
            logits = await session.decode(int(np.argmax(logits[0])))
        await session.delete()
    finally:
        await pool.aclose()


def refusal(*flags: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    argv = [sys.executable, "-m", "meshnet_node", "--model", str(smollm2_gguf()), "--port", "0"]
    done = subprocess.run([*argv, *flags], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr.strip()


def need_of(line: str) -> int:
    found = re.search(r" need (\d+) MiB ", line)
    assert found, line
    return int(found.group(1)) * MiB


def test_the_plan_and_the_check_are_within_a_quarter_of_the_rss_after_a_prompt() -> None:
    stages = plan_stages(smollm2_gguf(), 2)
    assert [s["layers"] for s in stages] == ["0:15", "15:30"]
    first, last = (int(str(s["need"])) for s in stages)
    with (
        node("--layers", "15:30") as (last_pid, last_url),
        node("--layers", "0:15", "--next", last_url) as (first_pid, first_url),
    ):
        anyio.run(prompt, first_url)
        for pid, need in ((first_pid, first), (last_pid, last)):
            rss = current_rss_bytes(pid)
            assert abs(need - rss) <= rss / 4, (need // MiB, rss // MiB)
    # The whole model under a limit of exactly the need the check names: it
    # starts, holds within a quarter of it, and never went above it.
    need = need_of(refusal("--memory-limit", "50MiB"))
    with node("--memory-limit", f"{need // MiB}MiB") as (pid, url):
        anyio.run(prompt, url)
        rss = current_rss_bytes(pid)
        assert abs(need - rss) <= rss / 4, (need // MiB, rss // MiB)
        assert peak_rss_bytes(pid) <= need


def test_the_need_does_not_move_with_the_limit() -> None:
    needs = {need_of(refusal("--memory-limit", limit)) for limit in ("50MiB", "300MiB", "440MiB")}
    assert len(needs) == 1, needs


def test_the_advised_flags_start_a_node_under_the_same_limit() -> None:
    line = refusal("--memory-limit", "500MiB", "--kv-budget-bytes", "256MiB")
    advice = [part for part in line.split(": ", 1)[1].split(", or ") if part.startswith("--")]
    assert "--max-chunk-tokens 128 --kv-budget-bytes 64MiB" in advice, line
    for flags in advice:
        argv = flags.replace(" (quantized)", "").split()
        with node("--memory-limit", "500MiB", "--kv-budget-bytes", "256MiB", *argv) as (_, url):
            assert url.startswith("http://")


def test_a_numpy_stage_of_a_gguf_file_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    model = smollm2_gguf()
    flags = ["--layers", "0:2", "--engine", "numpy", "--log-level", "warning"]
    with node_line(*flags) as line:
        assert "engine numpy on cpu" in line and "weights float32" in line, line
        assert "numpy holds this GGUF file's matrices as float32" in line, line
        assert "--engine torch holds them" in line, line  # torch is installed here
    assert choice.engine_advice(model, "torch") == ""
    assert choice.engine_advice(Path("/a/checkpoint-directory"), "numpy") == ""
    monkeypatch.setattr(choice, "torch_installed", lambda: False)
    assert "pip install 'torch>=2.4' in this environment" in choice.engine_advice(model, "numpy")


@contextmanager
def node_line(*flags: str) -> Iterator[str]:
    """A node's ready line (the first line it prints), the node stopped after."""
    argv = ["--model", str(smollm2_gguf()), "--port", "0", *flags]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshnet_node", *argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(30)
