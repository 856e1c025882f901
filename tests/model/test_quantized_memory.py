"""What a quantized stage holds, measured from /proc (issue 18's acceptance).

Random-weights GGUF files of Llama 3.2's real shapes (``testing.random_gguf``,
well-formed Q4_0 blocks), node *processes* with the default flags (torch,
held quantized):

* the 1B file over two nodes: each stage's RSS after load is at most
  1.3 x its tensors' bytes in the file + 450 MiB, and its peak during the
  load (VmHWM) at most 1.25 x that RSS — and the chain computes;
* the 3B file whole inside a 4 GiB memory cgroup: it loads and computes;
* inside a 1 GiB cgroup the node exits 2 with one line naming memory,
  before it reads a tensor.

Memory is read from /proc/PID/status, never estimated; nothing is timed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

from meshnet_bench._support import current_rss_bytes, peak_rss_bytes, server_process
from meshnet_model.formats.gguf.checkpoint import hf_name
from meshnet_model.formats.gguf.file import GGUFFile
from meshnet_model.testing.random_gguf import LLAMA_3_2_1B, LLAMA_3_2_3B, write_random_gguf
from meshnet_node.model_chain import ModelSession
from meshnet_runtime.downstream import DownstreamPool
from support.cgroup import memory_cgroup

pytestmark = pytest.mark.slow
MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("llama32")
    out = {}
    for name, config in (("1b", LLAMA_3_2_1B), ("3b", LLAMA_3_2_3B)):
        out[name] = write_random_gguf(directory / f"llama-3.2-{name}-q4_0.gguf", config, "Q4_0")
    return out


def _file_share(path: Path, layers: range, num_layers: int) -> int:
    """Bytes in the file of the tensors a stage of ``layers`` reads."""
    total = 0
    for tensor in GGUFFile(path).tensors.values():
        name = hf_name(tensor.name) or ""
        if name.startswith("model.layers."):
            wanted = int(name.split(".")[2]) in layers
        elif name == "model.embed_tokens.weight":  # the first stage's; the tied head's
            wanted = layers.start == 0 or layers.stop == num_layers
        else:  # the final norm (rope factors: folded into the config)
            wanted = name == "model.norm.weight" and layers.stop == num_layers
        total += int(tensor.n_bytes) if wanted else 0
    return total


@contextmanager
def _node(model: Path, layers: str, *flags: str, preexec_fn=None) -> Iterator[tuple[int, str]]:  # type: ignore[no-untyped-def]
    argv = ["--model", str(model), "--layers", layers, "--port", "0", "--log-level", "warning",
            *flags]  # fmt: skip
    with server_process("meshnet_node", *argv, timeout=600, preexec_fn=preexec_fn) as (proc, url):
        yield proc.pid, url


async def _generate(url: str, vocab: int) -> np.ndarray:
    """A 32-token prompt in one chunk and two greedy decode steps through the chain."""
    pool = DownstreamPool(url)
    try:
        session = ModelSession(pool, timeout=300)
        logits = await session.run(np.arange(1, 33, dtype=np.int32)[None] % vocab)
        for _ in range(2):
            logits = await session.decode(int(np.argmax(logits[0])))
        await session.delete()
        return logits
    finally:
        await pool.aclose()


def test_a_1b_file_over_two_nodes_holds_near_its_share(files: dict[str, Path]) -> None:
    path, layers = files["1b"], LLAMA_3_2_1B["num_hidden_layers"]
    with _node(path, "8:16") as (last_pid, last_url), \
            _node(path, "0:8", "--next", last_url) as (first_pid, first_url):  # fmt: skip
        logits = anyio.run(_generate, first_url, LLAMA_3_2_1B["vocab_size"])
        assert logits.shape == (1, LLAMA_3_2_1B["vocab_size"]) and np.isfinite(logits).all()
        for pid, span in ((first_pid, range(0, 8)), (last_pid, range(8, 16))):
            share = _file_share(path, span, layers)
            rss, peak = current_rss_bytes(pid), peak_rss_bytes(pid)
            report = f"{span}: file share {share / MiB:.0f} MiB, RSS {rss / MiB:.0f} MiB, " \
                     f"peak {peak / MiB:.0f} MiB"  # fmt: skip
            assert rss <= 1.3 * share + 450 * MiB, report
            assert peak <= 1.25 * rss, report


def test_a_3b_file_runs_whole_inside_4_gib(files: dict[str, Path]) -> None:
    path = files["3b"]
    with memory_cgroup(4 * GiB) as (_, _, join), _node(path, "0:28", preexec_fn=join) as (pid, url):
        logits = anyio.run(_generate, url, LLAMA_3_2_3B["vocab_size"])
        assert np.isfinite(logits).all()
        assert peak_rss_bytes(pid) < 4 * GiB


def test_a_3b_file_inside_1_gib_is_refused_before_loading(files: dict[str, Path]) -> None:
    with memory_cgroup(GiB) as (_, name, join):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
        done = subprocess.run(
            [sys.executable, "-m", "meshnet_node", "--model", str(files["3b"]), "--port", "0"],
            capture_output=True, text=True, env=env, timeout=120, preexec_fn=join,
        )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "need" in lines[0] and "may use" in lines[0] and name in lines[0], lines[0]
    assert "listening" not in done.stdout
