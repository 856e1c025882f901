"""A meshnet node with a stage of your own, inside a plain asyncio program.

Run it:  python examples/asyncio_stage.py

The node and its client run on the asyncio event loop the program already
has (anyio underneath, so nothing here is trio-specific). The stage is a
toy "layer" — y = x * 2 + 1 in float32, computed in a worker thread so the
event loop keeps serving other sessions while it runs — standing in for the
real model layers a stage will hold. The program pushes a 300-token
activation through the node in chunks of 128 and checks the answer.

The node is meshnet's own (``serve_node``: the conformant node that
tests/conformance checks with the echo stage), here with a stage of this
program's; the program exits once its activation is checked. It is not a
server to run ``meshnet conformance`` against: the checker's sampling and
window cases read a stage's answer as the identity's. For the core alone in
a server of your own, see examples/blocking_server.py.
"""

from __future__ import annotations

import asyncio

import anyio
import numpy as np

from meshnet_gateway import forward_via_chain
from meshnet_node import Stage, serve_node
from meshnet_node.config import NodeConfig


async def affine_layer(x: np.ndarray) -> np.ndarray:
    # numpy releases the GIL for large element-wise work: a thread keeps the
    # loop free for other sessions' chunks while this one computes.
    return await anyio.to_thread.run_sync(lambda: x.astype(np.float32) * 2 + 1)


async def main() -> int:
    config = NodeConfig.load(["--host", "127.0.0.1", "--port", "0"], {})
    async with serve_node(config, stage=Stage("affine", affine_layer)) as node:
        print(f"node with stage 'affine' listening on {node.url}")
        x = np.random.default_rng(7).standard_normal((1, 300, 64)).astype(np.float32)
        result = await forward_via_chain(node.url, x, chunk_tokens=128, encoding="zstd")
        for h in result.chunk_headers:
            print(f"  chunk {h.chunk_index}/{h.chunk_total}  position {h.position:>3}  "
                  f"shape {'x'.join(map(str, h.shape))}  {h.dtype} {h.encoding}")  # fmt: skip
        expected = x * 2 + 1
        ok = result.output.shape == expected.shape and np.array_equal(result.output, expected)
        print(f"output == x * 2 + 1, bit for bit: {'yes' if ok else 'NO'}")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
