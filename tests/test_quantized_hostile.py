"""Bad configuration and bad files on the new surfaces of issue 18, over real
node processes: every one is one line on stderr and exit 2, before anything
listens — the new flags' values, a quantized file whose tensor disagrees with
its own metadata, one cut short, and a memory limit that a stage cannot meet.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from gguf_support import build_model, write_model_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hostile")
    return write_model_gguf(directory, build_model("llama", layers=2, hidden=128), "Q4_0")


def _node(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    return subprocess.run([sys.executable, "-m", "meshnet_node", "--port", "0", *argv],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "listening" not in done.stdout, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    last = lines[-1]  # argparse prints its usage first; our own refusals are one line
    assert len(lines) == 1 or last.startswith("meshnet-node: error:"), done.stderr
    for word in words:
        assert word in last, last


@pytest.mark.parametrize(
    ("flags", "word"),
    [
        (["--engine", "gpu"], "--engine"),
        (["--dtype", "int4"], "--dtype"),
        (["--threads", "0"], "--threads"),
        (["--threads", "-2"], "--threads"),
        (["--threads", "99999999999999999999"], "--threads"),
        (["--memory-limit", "0"], "--memory-limit"),
        (["--memory-limit", "-1GiB"], "--memory-limit"),
        (["--memory-limit", "4 parsecs"], "--memory-limit"),
        (["--kv-budget-bytes", "autox"], "--kv-budget-bytes"),
        (["--engine", "numpy", "--device", "cuda"], "--device"),
    ],
)
def test_a_bad_value_of_a_new_flag_is_one_line(q4: Path, flags: list[str], word: str) -> None:
    _refused(_node("--model", str(q4), *flags), word)


def test_a_limit_the_stage_cannot_meet_is_one_line(q4: Path) -> None:
    _refused(_node("--model", str(q4), "--memory-limit", "64MiB"), "need", "may use")


def _rewrite(source: Path, target: Path, mutate) -> Path:  # type: ignore[no-untyped-def]
    data = bytearray(source.read_bytes())
    mutate(data, gguf.GGUFReader(source))
    target.write_bytes(bytes(data))
    return target


def test_a_quantized_file_cut_short_is_one_line(q4: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.gguf"
    short.write_bytes(q4.read_bytes()[: q4.stat().st_size - 4096])
    done = _node("--model", str(short))
    _refused(done, "short.gguf")


def test_a_tensor_whose_shape_disagrees_with_the_metadata_is_one_line(
    q4: Path, tmp_path: Path
) -> None:
    """attn_q's rows (a u64 in its tensor info) halved: the config says
    otherwise, and the quantized loader refuses the tensor by name."""

    def halve(data: bytearray, reader: gguf.GGUFReader) -> None:
        tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
        dims = tensor.field.parts[3]  # the dimensions of the tensor info
        offset = int(dims.ctypes.data - reader.data.ctypes.data) + 8  # the second (rows)
        rows = int.from_bytes(data[offset : offset + 8], "little")
        data[offset : offset + 8] = (rows // 2).to_bytes(8, "little")

    bad = _rewrite(q4, tmp_path / "bad-shape.gguf", halve)
    _refused(_node("--model", str(bad)), "q_proj", "shape [64, 128]")
