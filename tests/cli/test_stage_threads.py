"""Compute threads per stage: ``meshnet run`` shares the cores between its stages.

Its stages share one process: torch stages share the cores by who is busy (a
core ledger, ``tests/model/test_core_ledger.py``), numpy stages get
``cores // stages`` threads each unless ``--threads`` says otherwise; the node
reports the count it computes with (``/info``), numpy's BLAS pool is set
process-wide through threadpoolctl, and torch's count is applied in the worker
thread that computes (under OpenMP it is a setting of the calling thread).
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from meshnet_cli.run import serve_local
from meshnet_model.engines.choice import blas_threads, choose_engine, share_cores, usable_cores
from support.gguf import build_model, write_model_gguf


def test_the_cores_are_shared_between_stages() -> None:
    assert share_cores(2, cores=2) == 1
    assert share_cores(2, cores=16) == 8
    assert share_cores(3, cores=8) == 2
    assert share_cores(4, cores=2) == 1  # never none
    assert share_cores(1) == usable_cores()


def test_auto_picks_torch_quantized_for_gguf_and_numpy_for_a_directory(tmp_path: Path) -> None:
    assert choose_engine(tmp_path / "m.gguf", "auto", "auto") == ("torch", "keep")
    assert choose_engine(tmp_path, "auto", "auto") == ("numpy", "float32")
    assert choose_engine(tmp_path, "auto", "auto", "cuda") == ("torch", "keep")
    assert choose_engine(tmp_path / "m.gguf", "numpy", "auto") == ("numpy", "float32")
    assert choose_engine(tmp_path / "m.gguf", "torch", "bfloat16") == ("torch", "bfloat16")


def _info(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/info", timeout=60) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def _stage_threads(model: Path, stages: int, flags: list[str]) -> list[dict[str, Any]]:
    gateway = ["--port", "0", "--log-level", "warning"]
    async with serve_local(str(model), stages, gateway_flags=gateway,
                           node_flags=["--log-level", "warning", *flags]) as run:  # fmt: skip
        infos = [await anyio.to_thread.run_sync(_info, url) for url in run.node_urls]
    return [info["stage"] for info in infos]


def _gguf(tmp_path: Path) -> Path:
    """A small Q4_0 file with a tokenizer (the gateway of meshnet run loads it)."""
    return write_model_gguf(tmp_path, build_model("llama", layers=2, hidden=128), "Q4_0")


def test_meshnet_run_s_torch_stages_share_the_cores_by_who_is_busy(tmp_path: Path) -> None:
    stages = anyio.run(_stage_threads, _gguf(tmp_path), 2, [])
    assert [s["engine"] for s in stages] == ["torch", "torch"]
    ledgers = [s["cores"] for s in stages]  # one file; each stage may take every core
    assert ledgers[0]["file"] == ledgers[1]["file"]
    assert [(c["members"], c["most"]) for c in ledgers] == [(2, usable_cores())] * 2
    # An operator's --threads is each stage's most.
    stages = anyio.run(_stage_threads, _gguf(tmp_path), 2, ["--threads", "1"])
    assert [(s["threads"], s["cores"]["most"]) for s in stages] == [(1, 1), (1, 1)]


def test_meshnet_run_sets_numpy_s_blas_pool_to_the_share(tmp_path: Path) -> None:
    try:
        stages = anyio.run(_stage_threads, _gguf(tmp_path), 2, ["--engine", "numpy"])
        assert [s["engine"] for s in stages] == ["numpy", "numpy"]
        assert [s["threads"] for s in stages] == [share_cores(2)] * 2
        assert blas_threads() == share_cores(2)  # process-wide, read back by threadpoolctl
    finally:
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=usable_cores(), user_api="blas")


def test_the_torch_engine_applies_its_count_in_the_computing_thread(tmp_path: Path) -> None:
    from meshnet_model.engines.torch.engine import load_torch_runner

    runner = load_torch_runner(_gguf(tmp_path), threads=1)
    seen: list[int] = []

    def compute() -> None:
        torch.set_num_threads(usable_cores())  # a worker thread starts with another count
        runner.run("s", 0, np.array([[1, 2, 3]], np.int32))
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=compute)
    worker.start()
    worker.join()
    assert seen == [1]
    assert runner.describe()["threads"] == 1


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
