"""A float32 checkpoint held as bfloat16 by the torch engine keeps none of the
file's pages (issue 18): its tensors are read one by one, converted and
dropped, not converted from views of the mapping, whose touched pages stay
counted in the stage's RSS for as long as the mapping lives.

Measured in a node process from /proc/PID/smaps: the resident bytes of every
mapping of the checkpoint's files, after the stage has loaded and computed a prompt.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_bench._support import server_process
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node.model_chain import ModelSession
from meshnet_runtime.downstream import DownstreamPool

pytestmark = pytest.mark.slow


def _mapped_rss(pid: int, directory: Path) -> int:
    """Resident bytes of the process's mappings of files under ``directory``."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = str(directory) in line
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


async def _compute(url: str) -> None:
    """A prompt through the stage: every weight is read once."""
    pool = DownstreamPool(url)
    try:
        session = ModelSession(pool)
        await session.run(np.arange(1, 17, dtype=np.int32)[None])
        await session.delete()
    finally:
        await pool.aclose()


def _loaded_node_mapped_rss(directory: Path, *flags: str) -> int:
    argv = ["--model", str(directory), "--engine", "torch", "--port", "0",
            "--log-level", "warning", *flags]  # fmt: skip
    with server_process("meshnet_node", *argv, timeout=120) as (proc, url):
        anyio.run(_compute, url)
        return _mapped_rss(proc.pid, directory)


def test_a_float32_checkpoint_held_as_bfloat16_maps_nothing(tmp_path: Path) -> None:
    config = small_config(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          vocab_size=4096)  # fmt: skip
    directory = write_checkpoint(tmp_path / "f32", config)
    file_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert _loaded_node_mapped_rss(directory, "--dtype", "bfloat16") == 0
    # Held in its own dtype it is used straight from the mapping, as before
    # (the mapped pages are the weights: no copy at all).
    assert _loaded_node_mapped_rss(directory, "--dtype", "float32") > file_bytes // 2
