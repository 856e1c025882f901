"""``meshnet run`` refuses in one line naming the cause and the fix, exit 2,
before anything listens or loads (issue 22, "Why" 1, 2 and 9).

Each case is a real ``python -m meshnet_cli run`` as a user types it. Before
the fix: a taken port was a 100-line ExceptionGroup and exit 1, ``--model
README.md`` blamed ``README.md/config.json``, ``--stages 90`` and a missing
CUDA device exited 1, and a bad flag printed its 25 lines of usage first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.gateway import clean_env
from support.gguf import build_model, write_model_gguf

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer GGUF file: every check before the load passes on it."""
    return write_model_gguf(tmp_path_factory.mktemp("gguf"), build_model("llama", 4, seed=3))


def refused(*args: str) -> str:
    """``meshnet run ARGS``: exit 2, nothing on stdout, one line on stderr — that line."""
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "run", *args],
        capture_output=True, text=True, timeout=120, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == "", result.stdout  # no ready line: nothing started
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip()


def test_a_taken_port_is_one_line_naming_the_fix(gguf: Path, taken_port: int) -> None:
    line = refused("--model", str(gguf), "--port", str(taken_port))
    assert line == (
        f"meshnet run: cannot listen on 127.0.0.1:{taken_port}: address already in use "
        "(another process listens there: stop it, or choose another --port, 0 for a free one)"
    )


def test_a_file_that_is_no_model_says_what_a_model_is(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# not a model\n")
    line = refused("--model", str(readme))
    assert line == (
        f"meshnet run: cannot load --model {readme}: a file but not a .gguf file "
        "(give a .gguf file or a checkpoint directory with config.json, HF layout)"
    )
    assert "config.json is not valid JSON" not in line
    assert "no such file or directory" in refused("--model", str(tmp_path / "missing"))
    assert "a directory without config.json" in refused("--model", str(tmp_path))


def test_more_stages_than_layers_is_exit_2(gguf: Path) -> None:
    line = refused("--model", str(gguf), "--stages", "9")
    assert line == (
        "meshnet run: --stages 9: the model has 4 layers, so at most 4 stages "
        "(pass --stages 1..4, or --split)"
    )


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("0:1,2:4", "--split 0:1,2:4: layers 1..1 are in no stage"),
        ("0:2,1:4", "--split 0:2,1:4: layer 1 is in two stages"),
        ("1:4", "--split 1:4: layers 0..0 are in no stage"),
        ("0:2,2:3", "--split 0:2,2:3: the model has 4 layers, so the last range ends at 4"),
        ("0:2,2:2,2:4", "--split 0:2,2:2,2:4: 2:2 is empty"),
        ("0-2,2:4", "argument --split: expected layer ranges A:B,B:C,..."),
    ],
)
def test_a_bad_split_is_one_line(gguf: Path, split: str, message: str) -> None:
    assert message in refused("--model", str(gguf), "--split", split)


def test_a_split_and_a_stage_count_that_disagree(gguf: Path) -> None:
    line = refused("--model", str(gguf), "--stages", "3", "--split", "0:2,2:4")
    assert "--stages 3 but --split 0:2,2:4 names 2 ranges" in line


def test_a_cuda_device_this_machine_lacks_is_exit_2(gguf: Path) -> None:
    # cuda:999: missing here whether the machine has CUDA or not.
    line = refused("--model", str(gguf), "--device", "cuda:999")
    assert line.startswith("meshnet run: --device cuda:999: "), line
    assert "--device cpu" in line  # the fix


def test_too_little_memory_is_one_line(gguf: Path) -> None:
    line = refused("--model", str(gguf), "--memory-limit", "1MiB")
    assert line.startswith("meshnet run: layers 0:2, 2:4 of "), line
    assert "but this process may use 1 MiB (--memory-limit)" in line


def test_a_bad_flag_is_one_line_not_the_usage_block(gguf: Path) -> None:
    line = refused("--model", str(gguf), "--threads", "0")
    assert line == (
        "meshnet run: error: argument --threads: expected a positive integer, got '0' "
        "(see meshnet run --help)"
    )
    assert "usage:" not in line


def test_a_bad_environment_value_names_the_variable(gguf: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "run", "--model", str(gguf)],
        capture_output=True, text=True, timeout=120,
        env={**clean_env(), "MESHNET_SHUTDOWN_TIMEOUT": "soon"},
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == "meshnet run: MESHNET_SHUTDOWN_TIMEOUT: expected seconds, got 'soon'\n"


def test_a_checkpoint_without_a_tokenizer_is_refused_before_any_stage_loads(
    tmp_path: Path,
) -> None:
    """The gateway's side is checked first too: before, every stage loaded and
    only then did the gateway fail on the missing tokenizer."""
    from meshnet_model.testing import small_config, write_checkpoint

    directory = write_checkpoint(tmp_path / "no-tokenizer", small_config(vocab_size=320))
    line = refused("--model", str(directory))
    assert line.startswith(f"meshnet run: cannot load --model {directory}: "), line
