"""``meshnet generate`` against a gateway serving the OpenAI API over model nodes."""

from __future__ import annotations

import io
from pathlib import Path

import anyio
import pytest

from meshnet_cli.__main__ import build_parser
from meshnet_cli.generate import run_generate
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from openai_support import reference_greedy, serve_openai, write_model_dir

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
