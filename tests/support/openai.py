"""A chain serving the OpenAI API in-process, for the /v1 tests.

The nodes run real model stages (``meshnet-node --model DIR --layers A:B``)
over a tiny random Llama checkpoint written here, with a tokenizer trained
here; ``reference_greedy`` computes what greedy decoding must produce with
one in-process runner holding every layer (the chain's float32 wire makes
the logits bit-identical, so the argmax walk is exact).

Tests about the gateway alone (a stage that must be slow, a request that
must never reach a node) use *fake* stages honouring the same contract:
the first takes ``int32`` ids ``[1, tokens]``, the last answers float32
logits of each chunk's last position ``[1, vocab]``, a fixed function of
the last id (a random bigram table).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshnet_gateway import open_gateway
from meshnet_gateway.app import GatewayApp
from meshnet_gateway.config import GatewayConfig
from meshnet_gateway.openai.testing import write_tokenizer
from meshnet_model import StageRunner
from meshnet_model.testing import small_config, write_checkpoint
from meshnet_node import serve_node
from meshnet_node.app import NodeApp
from meshnet_node.backends import Stage, StageBackend
from meshnet_node.config import NodeConfig
from meshnet_node.model_chain import even_splits, start_model_chain
from support.fault import Drop, fault_proxy

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


@dataclass(slots=True, eq=False)
class HeldStage(Stage):
    """A stage whose calls from the ``at``-th on wait until ``gate`` opens:
    the test knows the work is under way (``waiting``) and that it can go no
    further until it says so, however slow the machine. ``gate`` is an
    ``anyio.Event`` made in the test's loop; ``calls`` counts the calls
    that got past it."""

    at: int = 1
    gate: Any = None
    waiting: int = 0

    async def __call__(self, tensor: np.ndarray, context: Any = None) -> np.ndarray:
        if self.calls + self.waiting + 1 >= self.at:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        return await Stage.__call__(self, tensor, context)


LAYERS = 4


def write_model_dir(root: Path, vocab: int = VOCAB, context: int = 256) -> Path:
    """A tiny random Llama checkpoint (hidden 64, 4 layers) with its tokenizer files."""
    config = small_config(
        vocab_size=vocab, num_hidden_layers=LAYERS, max_position_embeddings=context
    )
    write_checkpoint(root, config, seed=3)
    write_tokenizer(root, vocab)
    return root


def reference_greedy(model_dir: Path, prompt_ids: list[int], count: int) -> list[int]:
    """Greedy ids from one runner holding every layer, in this process."""
    runner = StageRunner.load(model_dir)
    ids: list[int] = []
    logits = runner.run("reference", 0, np.asarray([prompt_ids], dtype=np.int32))
    position = len(prompt_ids)
    for _ in range(count):
        ids.append(int(np.argmax(logits[0])))
        logits = runner.run("reference", position, np.asarray([[ids[-1]]], dtype=np.int32))
        position += 1
    runner.end_session("reference")
    return ids


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
    stages: int | list[Stage] = 2,
    gateway_flags: list[str] = (),  # type: ignore[assignment]
    node_flags: list[str] = (),  # type: ignore[assignment]
    entry_drop: Callable[[bytes], Drop] | None = None,
) -> AsyncIterator[Served]:
    """Nodes (last first, each pointing at the next) and a gateway with --model.

    ``stages``: how many real model nodes to split the checkpoint over (an
    even split of its layers), or fake stages to run instead. ``entry_drop``:
    put a ``fault_proxy`` losing what it decides between gateway and entry.
    """
    async with AsyncExitStack() as stack:
        urls: list[str] = []
        apps: list[NodeApp] = []
        if isinstance(stages, int):
            running = await stack.enter_async_context(
                start_model_chain(
                    model_dir, even_splits(LAYERS, stages), extra=["--log-level", "warning"]
                )
            )
            urls = [node.url for node in running]
            apps = [node.app for node in running]
        else:
            next_url: str | None = None
            for stage in reversed(stages):
                flags = ["--port", "0", "--log-level", "warning", *node_flags]
                if next_url is not None:
                    flags += ["--next", next_url]
                node = await stack.enter_async_context(
                    serve_node(NodeConfig.load(flags), stage=stage)
                )
                apps.insert(0, node.app)
                urls.insert(0, node.url)
                next_url = node.url
        entry = urls[0]
        if entry_drop is not None:
            entry = (await stack.enter_async_context(fault_proxy(entry, entry_drop))).url
        flags = [
            "--port", "0", "--log-level", "warning", "--entry", entry,
            "--model", str(model_dir), *gateway_flags,
        ]  # fmt: skip
        gateway = await stack.enter_async_context(open_gateway(GatewayConfig.load(flags)))
        yield Served(gateway.url, gateway.app, apps, urls)


def stage_of(app: NodeApp) -> StageBackend:
    return app.stage


def kv_bytes(app: NodeApp) -> int:
    """KV cache bytes a model node's live sessions hold, as its /info reports them."""
    return int(app.info()["stage"]["kv_live_bytes"])  # the prefix cache's retained KV aside


def post_json(
    url: str, path: str, body: dict[str, Any], *, source: str = "127.0.0.1", timeout: float = 120
) -> tuple[int, Any]:
    """POST ``body`` as JSON from the loopback address ``source`` (another
    client's peer address); the status and the decoded answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
