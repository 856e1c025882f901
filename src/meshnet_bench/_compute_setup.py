"""The compute section's processes and files: ``meshnet run`` and a node
pinned to the cores llama.cpp gets, busy loops beside them, and random GGUF
files with a vocabulary (llama.cpp loads no file without one).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._llama_cpp import pin
from ._support import server_process

__all__ = ["MeshnetRun", "busy_loops", "meshnet_node", "meshnet_run", "vocab_gguf"]

LOOPBACK = ("--host", "127.0.0.1", "--port", "0", "--log-level", "warning")
# Speculation off: llama.cpp decodes one token a step unless told to draft
# (the serve section's reason, _serve_chain.GATEWAY_FLAGS).
RUN_FLAGS = ("--speculate", "off")
START_TIMEOUT_S = 300.0  # a 1B load on a loaded 2-core machine


def vocab_gguf(path: Path, config: Mapping[str, Any], qtype: str, weight_std: float) -> Path:
    """A random ``config``-shaped GGUF (``testing.random_gguf``) with a
    byte-level BPE vocabulary of its ``vocab_size``: the 256 byte tokens,
    filler words, and an end token last (its bos and eos). Both meshnet's
    gateway and llama.cpp load it; random ids are what either feeds it."""
    from meshnet_model.formats.gguf.tokenizer import byte_alphabet
    from meshnet_model.testing.gguf import GGUFVocab
    from meshnet_model.testing.random_gguf import write_random_gguf

    size = int(config["vocab_size"])
    alphabet = byte_alphabet()
    words = ["Ġt", *(f"Ġw{i}" for i in range(size - 258))]
    tokens = [alphabet[b] for b in range(256)] + words + ["<|endoftext|>"]
    end = len(tokens) - 1
    vocab = GGUFVocab(
        model="gpt2",
        tokens=tokens,
        token_types=[1] * end + [3],
        merges=["Ġ t"],
        pre="gpt-2",
        bos_id=end,
        eos_id=end,
        add_bos=False,
    )
    return write_random_gguf(path, config, qtype, weight_std=weight_std, vocab=vocab)


@dataclass(frozen=True, slots=True)
class MeshnetRun:
    url: str  # the gateway (OpenAI API under /v1)
    node_urls: list[str]  # entry first
    pid: int
    ready_s: float  # exec -> the ready line


def _node_lines(proc: subprocess.Popen[str], count: int) -> list[str]:
    """The URL of each ``meshnet run node i/N at URL: …`` line after the ready line."""
    assert proc.stdout is not None
    urls = []
    for _ in range(count):
        # Printed with the ready line, so likely in the reader's buffer already
        # (select on the pipe would not see them): read, not wait.
        line = proc.stdout.readline()
        if " at " not in line:
            raise RuntimeError(f"meshnet run: no node line ({line!r})")
        urls.append(line.split(" at ", 1)[1].split()[0].rstrip(":"))
    return urls


@contextlib.contextmanager
def meshnet_run(model: Path, stages: int, *flags: str) -> Iterator[MeshnetRun]:
    """``meshnet run --model model --stages N`` at its defaults (torch stages
    share the pinned cores by who is busy) until the block ends."""
    argv = ["run", "--model", str(model), "--stages", str(stages), *LOOPBACK, *RUN_FLAGS, *flags]
    started = time.perf_counter()
    with server_process("meshnet_cli", *argv, timeout=START_TIMEOUT_S, preexec_fn=pin) as (
        proc,
        url,
    ):
        ready_s = time.perf_counter() - started
        yield MeshnetRun(url, _node_lines(proc, stages), proc.pid, ready_s)


@contextlib.contextmanager
def meshnet_node(model: str, *flags: str) -> Iterator[tuple[str, int]]:
    """One ``meshnet_node`` serving every layer of ``model``: (URL, pid)."""
    argv = ["--model", model, *LOOPBACK, *flags]
    with server_process("meshnet_node", *argv, timeout=START_TIMEOUT_S, preexec_fn=pin) as (
        proc,
        url,
    ):
        yield url, proc.pid


@contextlib.contextmanager
def busy_loops(count: int = 2) -> Iterator[list[int]]:
    """``count`` CPU-bound Python loops on the pinned cores until the block
    ends (then killed, by their own ids): the neighbours a shared machine has."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(
                subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
            )
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
