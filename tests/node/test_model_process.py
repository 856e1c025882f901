"""meshnet-node --model as a user starts it: subprocesses, ready lines, exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_model import StageRunner
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.__main__ import main as node_main
from meshnet_node.model_chain import ModelSession
from meshnet_proto import Response
from meshnet_runtime.deadlines import Deadline
from meshnet_runtime.downstream import DownstreamPool
from support.gateway import clean_env, spawn, stop

pytestmark = pytest.mark.slow


def test_two_node_processes_split_the_model(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path, small_config(), seed=9, shards=2, dtype="bfloat16")
    ids = np.random.default_rng(1).integers(0, 256, (1, 12)).astype(np.int32)
    want = StageRunner.load(checkpoint).run("s", 0, ids)
    procs = []
    try:
        model = ["--model", str(checkpoint), "--dtype", "keep"]  # bf16, memory-mapped
        last, last_url = spawn("meshnet_node", *model, "--layers", "1:4")
        procs.append(last)
        first, url = spawn("meshnet_node", *model, "--layers", "0:1", "--next", last_url)
        procs.append(first)

        async def drive() -> tuple[np.ndarray, dict]:  # type: ignore[type-arg]
            pool = DownstreamPool(url)
            try:
                logits = await ModelSession(pool).run(ids, chunk_tokens=5)
                response = await pool.request("GET", "/info", Deadline.after(10))
                assert isinstance(response, Response)
                return logits, json.loads(response.body)
            finally:
                await pool.aclose()

        logits, info = anyio.run(drive)
        chunked = StageRunner.load(checkpoint)
        for lo in range(0, 12, 5):
            expected = chunked.run("s", lo, ids[:, lo : lo + 5])
        assert np.array_equal(logits, expected)
        assert np.abs(logits - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
        stage = info["stage"]
        assert (stage["backend"], stage["layers"], stage["weights_dtype"]) == (
            "model", [0, 1], "bfloat16",
        )  # fmt: skip
        assert stage["model_path"] == str(checkpoint) and stage["kv_bytes_in_use"] > 0
    finally:
        assert [stop(p) for p in procs] == [0] * len(procs)


def test_a_model_it_cannot_load_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_checkpoint(tmp_path, small_config(), seed=1)
    # As a user runs it: a process, its exit status, no traceback.
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--port", "0", "--model", str(tmp_path),
         "--layers", "2:9"],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "meshnet-node: cannot load --model" in done.stderr
    assert "the model has 4 layers" in done.stderr and "Traceback" not in done.stderr
    # The same entry point in process, for another bad directory.
    assert node_main(["--port", "0", "--model", str(tmp_path / "nowhere")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
