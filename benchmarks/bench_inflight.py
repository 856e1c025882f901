"""Chunked prefill overlap: a gateway with --inflight 1 against --inflight 4.

    .venv/bin/python benchmarks/bench_inflight.py [--delay-ms 20] [--tokens 1024] [--repeat 3]

A 3-node chain (each node sleeps ``--delay-ms`` per chunk: simulated stage
compute) and a gateway cutting a 1024-token bfloat16 sequence into chunks of
128, all in this process on loopback. Both settings run side by side on the
same data; the figure is the wall-time ratio (best of ``--repeat``), and the
two outputs must be bit-identical. With inflight 1 every chunk crosses the
whole chain before the next starts (~chunks x nodes x delay); with
inflight N a node starts chunk k+1 while chunk k is downstream, so the
chain fills like a pipeline (~(chunks + nodes - 1) x delay when N >= nodes).
"""

from __future__ import annotations

import argparse
import contextlib

import anyio
import numpy as np
from _timing import best_forward

from meshnet_cli.demo import make_activation
from meshnet_gateway import Client, open_gateway
from meshnet_node import serve_node
from meshnet_runtime.config import load_config

QUIET = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]


async def measure(
    args: argparse.Namespace, array: np.ndarray, inflight: int
) -> tuple[float, np.ndarray]:
    async with contextlib.AsyncExitStack() as stack:
        next_flags: list[str] = []
        for _ in range(args.nodes):
            flags = [*QUIET, "--delay-ms", str(args.delay_ms), *next_flags]
            node = await stack.enter_async_context(serve_node(load_config("node", flags)))
            next_flags = ["--next", node.url]
        gateway_flags = [*QUIET, "--entry", node.url, "--chunk-tokens", str(args.chunk_tokens),
                         "--inflight", str(inflight)]  # fmt: skip
        gateway = await stack.enter_async_context(
            open_gateway(load_config("gateway", gateway_flags))
        )
        client = await stack.enter_async_context(Client(gateway.url))
        return await best_forward(client, array, encoding=args.encoding, repeat=args.repeat)


async def main(args: argparse.Namespace) -> None:
    array = make_activation(args.tokens, args.hidden)
    chunks = -(-args.tokens // args.chunk_tokens)
    print(
        f"{args.nodes}-node chain, --delay-ms {args.delay_ms} per node per chunk; "
        f"1x{args.tokens}x{args.hidden} bfloat16 ({array.nbytes / 2**20:.1f} MiB, "
        f"{args.encoding}) in {chunks} chunks of {args.chunk_tokens}; best of {args.repeat}"
    )
    base, base_out = await measure(args, array, 1)
    print(f"  --inflight 1: {base * 1000:8.1f} ms   (1.00x)")
    for inflight in args.inflight:
        seconds, out = await measure(args, array, inflight)
        same = bytes(out.view(np.uint8)) == bytes(base_out.view(np.uint8))
        print(
            f"  --inflight {inflight}: {seconds * 1000:8.1f} ms   ({base / seconds:.2f}x faster)"
            f"   output bit-identical to --inflight 1: {'yes' if same else 'NO'}"
        )
        if not same:
            raise SystemExit("outputs differ")
    ideal_serial = chunks * args.nodes * args.delay_ms
    ideal_pipe = (chunks + args.nodes - 1) * args.delay_ms
    print(f"  stage time alone: {ideal_serial} ms serial, {ideal_pipe} ms fully pipelined "
          f"(ideal ratio {ideal_serial / ideal_pipe:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--inflight", type=int, nargs="+", default=[4])
    parser.add_argument("--encoding", choices=("identity", "zstd"), default="identity")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio")
    ns = parser.parse_args()
    anyio.run(main, ns, backend=ns.async_backend)
