"""A chain serving the OpenAI API in-process, for the /v1 tests.

Until real model stages exist the nodes run *fake* stages that honour the
model-stage contract: the first stage takes ``int32`` ids ``[1, tokens]``
and embeds them, the last answers float32 logits of each chunk's last
position ``[1, vocab]``. The logits are a fixed function of the last id (a
random bigram table), so generation is deterministic given the sampler and
the text depends on every token generated.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshnet_gateway import open_gateway
from meshnet_gateway.app import GatewayApp
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_node import serve_node
from meshnet_node.app import NodeApp
from meshnet_node.backends import Stage
from meshnet_runtime.config import load_config

VOCAB = 320
HIDDEN = 8


def fake_embed(tensor: np.ndarray) -> np.ndarray:
    assert tensor.dtype == np.int32 and tensor.ndim == 2, (tensor.dtype, tensor.shape)
    hidden = np.zeros((*tensor.shape, HIDDEN), dtype=np.float32)
    hidden[..., 0] = tensor
    return hidden


def fake_middle(tensor: np.ndarray) -> np.ndarray:
    assert tensor.dtype == np.float32 and tensor.ndim == 3
    return tensor


BIGRAM = np.random.default_rng(7).standard_normal((VOCAB, VOCAB)).astype(np.float32) * 4
EOS_ID = 1  # write_tokenizer's "</s>"
BIGRAM[:, EOS_ID] = -50.0  # never ends by itself: lengths are the request's


def greedy_continuation(prompt_ids: list[int], count: int) -> list[int]:
    """What the fake chain must produce greedily: the bigram argmax walk."""
    ids, last = [], prompt_ids[-1]
    for _ in range(count):
        last = int(np.argmax(BIGRAM[last]))
        ids.append(last)
    return ids


def fake_head(tensor: np.ndarray) -> np.ndarray:
    assert tensor.dtype == np.float32 and tensor.ndim == 3
    last = tensor[:, -1, 0].astype(np.int64)
    return BIGRAM[last]


def fake_stages(count: int) -> list[Stage]:
    if count == 1:
        return [Stage("fake-all", lambda t: fake_head(fake_embed(t)))]
    middle = [Stage("fake-middle", fake_middle) for _ in range(count - 2)]
    return [Stage("fake-embed", fake_embed), *middle, Stage("fake-head", fake_head)]


def write_model_dir(root: Path, vocab: int = VOCAB, context: int = 512) -> Path:
    """A model directory with what the gateway reads: tokenizer files + config.json."""
    write_tokenizer(root, vocab)
    config = {"vocab_size": vocab, "max_position_embeddings": context}
    if not (root / "config.json").exists():
        (root / "config.json").write_text(json.dumps(config))
    return root


@dataclass
class Served:
    url: str  # the gateway
    gateway: GatewayApp
    nodes: list[NodeApp]
    node_urls: list[str]


@asynccontextmanager
async def serve_openai(
    model_dir: Path,
    *,
    stages: list[Stage] | None = None,
    gateway_flags: list[str] = (),  # type: ignore[assignment]
    node_flags: list[str] = (),  # type: ignore[assignment]
) -> AsyncIterator[Served]:
    """Nodes (last first, each pointing at the next) and a gateway with --model."""
    stages = stages if stages is not None else fake_stages(2)
    async with AsyncExitStack() as stack:
        nodes: list[NodeApp] = []
        urls: list[str] = []
        next_url: str | None = None
        for stage in reversed(stages):
            flags = ["--port", "0", "--log-level", "warning", *node_flags]
            if next_url is not None:
                flags += ["--next", next_url]
            node = await stack.enter_async_context(
                serve_node(load_config("node", flags), stage=stage)
            )
            nodes.insert(0, node.app)
            urls.insert(0, node.url)
            next_url = node.url
        flags = [
            "--port", "0", "--log-level", "warning", "--entry", urls[0],
            "--model", str(model_dir), *gateway_flags,
        ]  # fmt: skip
        gateway = await stack.enter_async_context(open_gateway(load_config("gateway", flags)))
        yield Served(gateway.url, gateway.app, nodes, urls)
