"""Two first-stage replicas in front of one last stage, a gateway over the
two, on real loopback sockets — the chain the KV hand-off tests (drain,
prefill/decode, a refused move's backoff) run — and the logits the same
split computes without any of it, to hold them to bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import numpy as np

from meshnet_gateway import Client, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_model import StageRunner
from meshnet_node import RunningNode, serve_node
from meshnet_node.config import NodeConfig
from meshnet_runtime.replicas import ReplicaSet
from support.gateway import QUIET

__all__ = ["handoff_chain", "random_prompt", "split_reference"]


def random_prompt(vocab: int, tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (1, tokens)).astype(np.int32)


def split_reference(checkpoint: str, prompt: np.ndarray, steps: int) -> list[np.ndarray]:
    """The prompt's logits and each greedy step's, by two runners split as the chain is."""
    first = StageRunner.load(checkpoint, range(0, 2))
    last = StageRunner.load(checkpoint, range(2, 4))
    out = [last.run("r", 0, first.run("r", 0, prompt))]
    for position in range(prompt.shape[1], prompt.shape[1] + steps):
        step = np.asarray([[int(np.argmax(out[-1]))]], dtype=np.int32)
        out.append(last.run("r", position, first.run("r", position, step)))
    return out


@contextlib.asynccontextmanager
async def handoff_chain(
    checkpoint: str, entry_flags: Sequence[Sequence[str]]
) -> AsyncIterator[tuple[list[RunningNode], ReplicaSet, Client]]:
    """The last stage (layers 2:4), one first-stage replica (0:2) per item of
    ``entry_flags`` (its own flags: ``--kv-role``, a budget), a gateway over
    them and a client of it: (the replicas, the gateway's replica set, the client)."""
    model = ["--model", checkpoint]
    async with contextlib.AsyncExitStack() as stack:
        last = await stack.enter_async_context(
            serve_node(NodeConfig.load([*QUIET, *model, "--layers", "2:4"]))
        )
        entries = []
        for extra in entry_flags:
            flags = [*QUIET, *model, "--layers", "0:2", "--next", last.url, *extra]
            entries.append(await stack.enter_async_context(serve_node(NodeConfig.load(flags))))
        config = GatewayConfig.load([*QUIET, "--entry", ",".join(n.url for n in entries)])
        gateway = await stack.enter_async_context(open_gateway(config))
        client = await stack.enter_async_context(Client(gateway.url))
        hop = gateway.app.pool
        assert isinstance(hop, ReplicaSet)
        yield entries, hop, client
