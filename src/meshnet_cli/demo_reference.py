"""``meshnet demo``'s reference: the same model file run whole in this
process, greedy, with no wire, no gateway and no node in between.

The stage is built as the chain's nodes build theirs — the same node flags
(so the same engine, dtype and threads: ``--engine auto`` is torch where it
is installed, numpy otherwise), only without ``--layers`` — and its runner
is called directly: the prompt in the gateway's chunks, then one token a
step, the argmax each time (ties to the lowest id, as the gateway's greedy
sampler), until a stop id or ``max_tokens``. The split answer must equal
this one: what the chain adds (two stages, float32 activations on the wire,
the gateway's speculative windows) may not change a greedy answer.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model import StageRunner
from meshnet_node.config import NodeConfig
from meshnet_node.model_stage import stage_from_config

from .run import core_flags

__all__ = ["Reference", "chat_ids", "greedy", "whole_model_answer"]

SESSION = "meshnet-demo-reference"


@dataclass(frozen=True, slots=True)
class Reference:
    text: str
    ids: list[int]  # the answer's ids, a stop id not among them
    prompt_tokens: int
    engine: str  # what the stage computed with, as its runner describes it


def chat_ids(tokenizer: ModelTokenizer, question: str) -> list[int]:
    """The prompt ids of one user message, as the gateway renders and
    encodes a chat without special-token text in it."""
    messages = [{"role": "user", "content": question}]
    return tokenizer.encode(tokenizer.render_chat(messages), chat=True)


def greedy(
    runner: StageRunner,
    prompt: Sequence[int],
    max_tokens: int,
    stop_ids: frozenset[int],
    chunk_tokens: int,
) -> list[int]:
    """Greedy ids after ``prompt`` from a runner holding every layer."""
    ids: list[int] = []
    try:
        logits = np.empty(0)
        for start in range(0, len(prompt), chunk_tokens):
            chunk = np.asarray([prompt[start : start + chunk_tokens]], dtype=np.int32)
            logits = runner.run(SESSION, start, chunk)
        position = len(prompt)
        while len(ids) < max_tokens:
            token = int(np.argmax(logits[0]))
            if token in stop_ids:
                break
            ids.append(token)
            if len(ids) < max_tokens:  # the last one's logits would go unread
                logits = runner.run(SESSION, position, np.asarray([[token]], dtype=np.int32))
                position += 1
    finally:
        runner.end_session(SESSION)
    return ids


def whole_model_answer(
    model: str,
    tokenizer: ModelTokenizer,
    question: str,
    max_tokens: int,
    *,
    node_flags: Sequence[str],
    stages: int,
    chunk_tokens: int,
) -> Reference:
    """Load every layer of ``model`` as a node of the chain would (its
    ``node_flags`` and the core share of ``stages`` stages in one process)
    and answer ``question`` greedily. Blocking: run it in a worker thread."""
    with tempfile.TemporaryDirectory(prefix="meshnet-demo-") as scratch:
        flags = [*node_flags, *core_flags(model, node_flags, stages, Path(scratch) / "cores")]
        stage = stage_from_config(NodeConfig.load(["--model", model, *flags], {}))
        runner = stage.runner
        prompt = chat_ids(tokenizer, question)
        ids = greedy(runner, prompt, max_tokens, tokenizer.stop_ids, chunk_tokens)
        engine = str(runner.describe().get("engine", "?"))
    return Reference(tokenizer.decode(ids), ids, len(prompt), engine)
