"""The serve section's processes: the model file it serves (a tiny random
GGUF with a tokenizer, or the real model), and two node processes and a
gateway configured as ``meshnet run --stages 2`` would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._support import server_process

__all__ = ["GATEWAY_FLAGS", "Chain", "byte_level_gguf", "long_ids", "model_file", "start_chain"]

# meshnet run's gateway flags (its --chunk-tokens and --inflight defaults),
# speculation off: the serve section sets meshnet against llama.cpp's server,
# which decodes one token a step unless told to draft (--only spec measures
# speculation against itself off).
GATEWAY_FLAGS = ("--chunk-tokens", "128", "--inflight", "4", "--speculate", "off")


def tiny_model(directory: Path) -> Path:
    """A 2-layer random llama GGUF with a byte-level vocabulary (the gateway
    needs a tokenizer; ``random_gguf`` files have none)."""
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    words = ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    return byte_level_gguf(directory / "tiny-serve.gguf", words, merges, shape)


def byte_level_gguf(
    path: Path, words: list[str], merges: list[str], shape: dict[str, Any], qtype: str = "F32"
) -> Path:
    """A random llama GGUF of ``shape`` whose vocabulary is the 256 byte tokens
    then ``words`` (the last one its bos and eos), with ``merges``."""
    from meshnet_model.formats.gguf.tokenizer import byte_alphabet
    from meshnet_model.testing import random_weights, small_config
    from meshnet_model.testing.gguf import GGUFVocab, write_gguf

    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)] + words
    end = len(tokens) - 1
    vocab = GGUFVocab(
        model="gpt2",
        tokens=tokens,
        token_types=[1] * end + [3],
        merges=merges,
        pre="gpt-2",
        bos_id=end,
        eos_id=end,
        add_bos=False,
    )
    shape = {**shape, "vocab_size": len(tokens)}
    weights = random_weights(small_config(**shape), seed=0)
    return write_gguf(path, {"model_type": "llama", **shape}, weights, vocab=vocab, qtype=qtype)


def model_file(model: str, directory: Path) -> Path:
    """The file the section serves: the tiny one, or the real model (``model``: a plan's)."""
    if model == "tiny":
        return tiny_model(directory)
    from meshnet_model.source import packaged_model_path

    from ._needs import Need

    path = packaged_model_path()
    if path is None:
        raise RuntimeError(f"the serve section needs the real model: {Need.MODEL.install}")
    return path


def long_ids(path: Path, count: int) -> list[int]:
    """``count`` token ids of English prose (PROSE, repeated as needed)."""
    from meshnet_model.formats.gguf.tokenizer import load_gguf_tokenizer
    from meshnet_model.testing.quality import PROSE

    tokenizer = load_gguf_tokenizer(path).tokenizer
    ids: list[int] = []
    while len(ids) < count:
        ids += tokenizer.encode(PROSE).ids
    return ids[:count]


@dataclass(frozen=True, slots=True)
class Chain:
    gateway: str
    nodes: list[str]  # first stage first
    pids: list[int]  # the nodes', then the gateway's


@contextlib.contextmanager
def start_chain(path: Path, layers: int) -> Iterator[Chain]:
    """Two node processes and a gateway, as ``meshnet run --stages 2`` would
    configure them."""
    from meshnet_model.engines.choice import share_cores
    from meshnet_node.model_chain import even_splits

    quiet = ("--host", "127.0.0.1", "--port", "0", "--log-level", "warning")
    threads = ("--threads", str(share_cores(2)))  # meshnet run's split of the cores
    with contextlib.ExitStack() as stack:
        urls: list[str] = []
        pids: list[int] = []
        for a, b in reversed(even_splits(layers, 2)):
            argv = [*quiet, "--model", str(path), "--layers", f"{a}:{b}", *threads]
            if urls:
                argv += ["--next", urls[0]]
            proc, url = stack.enter_context(server_process("meshnet_node", *argv, timeout=300.0))
            urls.insert(0, url)
            pids.insert(0, proc.pid)
        proc, gateway = stack.enter_context(
            server_process(
                "meshnet_gateway",
                *quiet,
                "--entry",
                urls[0],
                "--model",
                str(path),
                *GATEWAY_FLAGS,
                timeout=300.0,
            )
        )
        yield Chain(gateway, urls, [*pids, proc.pid])
