"""A GGUF file alone serves the OpenAI API: ``meshnet run --model FILE.gguf``."""

from __future__ import annotations

import io
import select
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_cli.__main__ import build_parser
from meshnet_cli.generate import run_generate
from support.gateway import clean_env, stop
from support.gguf import build_model, hf_from_gguf, write_model_gguf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_meshnet_run_on_a_gguf_file_answers_as_transformers_does(tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path, build_model("llama", seed=11), "Q8_0")
    # The numpy engine: the float32 reference that equals transformers' own
    # dequantized load (the default, torch quantized, is held to an error
    # budget instead: tests/test_quantized_budget.py).
    argv = [sys.executable, "-m", "meshnet_cli", "run", "--model", str(path),
            "--stages", "2", "--port", "0", "--engine", "numpy"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no ready line within 120 s"
        line = proc.stdout.readline()
        assert "2 nodes, layers 0:2, 2:4" in line and "model llama-q8_0" in line, line
        url = line.split(" listening on ", 1)[1].split()[0]
        args = build_parser().parse_args(
            ["generate", "--gateway", url, "--prompt", "Grüß dich, fox", "--max-tokens", "12",
             "--temperature", "0", "--timeout", "60"]
        )  # fmt: skip
        out = io.StringIO()
        assert run_generate(args, out) == 0
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    import torch

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ids = tokenizer("Grüß dich, fox", return_tensors="pt")["input_ids"]
    model = hf_from_gguf(path)
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=12, do_sample=False,
                                   attention_mask=torch.ones_like(ids), pad_token_id=0)  # fmt: skip
    want = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    assert want.strip() and out.getvalue() == want + "\n"


def test_gateway_refuses_a_bad_gguf_file_with_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(64))
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_gateway", "--entry", "http://127.0.0.1:1",
         "--model", str(bad)],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(f"meshnet-gateway: cannot load --model {bad}: ")
    assert result.stderr.count("\n") == 1


def test_meshnet_run_refuses_a_bad_gguf_file_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """Before anything listens, as for a directory: an unreadable header and an
    architecture we do not run are one line each, never a traceback."""
    good = write_model_gguf(tmp_path, build_model("llama", 2, seed=1), "F32")
    other = tmp_path / "other.gguf"
    other.write_bytes(good.read_bytes().replace(b"llama", b"gemma", 1))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + bytes(64))
    cases = {other: "GGUF architecture 'gemma' is not supported", garbage: "GGUF"}
    for bad, message in cases.items():
        result = subprocess.run(
            [sys.executable, "-m", "meshnet_cli", "run", "--model", str(bad), "--stages", "2"],
            capture_output=True, text=True, timeout=60, env=clean_env(),
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"meshnet run: cannot load --model {bad}: ")
        assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
