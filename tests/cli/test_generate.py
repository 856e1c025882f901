"""``meshnet generate`` against a gateway serving the OpenAI API over model nodes."""

from __future__ import annotations

import http.client
import io
import json
import select
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from meshnet_cli.__main__ import build_parser
from meshnet_cli.generate import run_generate
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from support.gateway import clean_env, closed_port_url, spawn, stop
from support.openai import reference_greedy, serve_openai, write_model_dir

pytestmark = pytest.mark.anyio

LIMIT = 30


async def generate(argv: list[str]) -> tuple[int, str]:
    args = build_parser().parse_args(["generate", *argv])
    out = io.StringIO()
    with anyio.fail_after(LIMIT):
        code = await anyio.to_thread.run_sync(run_generate, args, out)
    return code, out.getvalue()


async def test_generate_streams_the_greedy_text(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    tokenizer = ModelTokenizer.load(model_dir)
    prompt = "hello world"
    expected = tokenizer.decode(reference_greedy(model_dir, tokenizer.encode(prompt), 10))
    async with serve_openai(model_dir) as served:
        code, out = await generate(
            ["--gateway", served.url, "--prompt", prompt, "--max-tokens", "10",
             "--temperature", "0"]
        )  # fmt: skip
        assert (code, out) == (0, expected + "\n")
        assert "[finish_reason length" in capfd.readouterr().err
        # Chat, seeded: the same seed twice gives the same text.
        chat = ["--gateway", served.url, "--prompt", "hi", "--chat", "--seed", "3",
                "--max-tokens", "8"]  # fmt: skip
        first, second = await generate(chat), await generate(chat)
        assert first[0] == 0 and first == second and first[1].strip()


async def test_generate_reports_the_gateways_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    async with serve_openai(write_model_dir(tmp_path / "tiny")) as served:
        code, out = await generate(["--gateway", served.url, "--prompt", "hi", "--model", "nope"])
    assert code == 1 and out == ""
    assert "model_not_found" in capfd.readouterr().err


def test_generate_to_a_closed_port_is_one_line_exit_1(capfd: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["generate", "--gateway", "http://127.0.0.1:1", "--prompt", "x", "--timeout", "5"]
    )
    assert run_generate(args, io.StringIO()) == 1
    err = capfd.readouterr().err
    assert err.startswith("meshnet generate: http://127.0.0.1:1") and err.count("\n") == 1


def test_meshnet_run_serves_a_split_checkpoint_in_one_process(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``meshnet run --model DIR --stages 3`` as a user runs it: a ready line
    with the URL, the OpenAI API answering through 3 nodes, exit 0 on SIGTERM."""
    model_dir = write_model_dir(tmp_path / "tiny")
    tokenizer = ModelTokenizer.load(model_dir)
    argv = [sys.executable, "-m", "meshnet_cli", "run", "--model", str(model_dir),
            "--stages", "3", "--port", "0", "--chunk-tokens", "2"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no ready line within 60 s"
        line = proc.stdout.readline()
        assert line.startswith("meshnet run listening on http://127.0.0.1:"), line
        assert "3 nodes, layers 0:1, 1:3, 3:4" in line and "model tiny" in line
        url = line.split(" listening on ", 1)[1].split()[0]
        args = build_parser().parse_args(
            ["generate", "--gateway", url, "--prompt", "the fox", "--max-tokens", "6",
             "--temperature", "0", "--timeout", "30"]
        )  # fmt: skip
        out = io.StringIO()
        assert run_generate(args, out) == 0
        expected = reference_greedy(model_dir, tokenizer.encode("the fox"), 6)
        assert out.getvalue() == tokenizer.decode(expected) + "\n"
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_meshnet_run_refuses_more_stages_than_layers(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    result = subprocess.run(
        [sys.executable, "-m", "meshnet_cli", "run", "--model", str(model_dir), "--stages", "9",
         "--port", "0"],
        capture_output=True, text=True, timeout=60, env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 2  # a refused setting, as the servers' (issue 22)
    assert result.stderr.strip() == (
        "meshnet run: --stages 9: the model has 4 layers, so at most 4 stages "
        "(pass --stages 1..4, or --split)"
    )


def test_gateway_process_with_model_serves_v1_and_refuses_a_bad_directory(tmp_path: Path) -> None:
    model_dir = write_model_dir(tmp_path / "tiny")
    proc, url = spawn("meshnet_gateway", "--entry", closed_port_url(), "--model", str(model_dir))
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["data"][0]["id"] == "tiny"
        conn.close()
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not a tokenizer")
    for bad in (tmp_path / "missing", tmp_path / "broken"):
        result = subprocess.run(
            [sys.executable, "-m", "meshnet_gateway", "--entry", "http://127.0.0.1:1",
             "--model", str(bad)],
            capture_output=True, text=True, timeout=60, env=clean_env(),
        )  # fmt: skip
        assert result.returncode == 2
        assert result.stderr.startswith(f"meshnet-gateway: cannot load --model {bad}: ")
        assert result.stderr.count("\n") == 1
