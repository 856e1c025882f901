"""TCP against Unix domain sockets: the same 2-node chain and gateway, both ways.

    .venv/bin/python benchmarks/bench_transports.py [--tokens 2048] [--repeat 5]

Every hop (client → gateway → node 1 → node 2) runs over loopback TCP, then
over Unix sockets (``--uds``, ``--entry unix:…``, ``--next unix:…``), in this
process, on the same data; echo stages, identity bodies, so the transport is
most of what is measured. The figure is the wall-time ratio (best of
``--repeat``); outputs are checked bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path

import anyio
import numpy as np

from meshnet_bench._support import best_forward
from meshnet_cli.demo import make_activation
from meshnet_gateway import Client, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import serve_node
from meshnet_node.config import NodeConfig


def listen_flags(uds_dir: Path | None, name: str) -> list[str]:
    if uds_dir is None:
        return ["--host", "127.0.0.1", "--port", "0"]
    return ["--uds", str(uds_dir / f"{name}.sock")]


async def measure(
    args: argparse.Namespace, array: np.ndarray, uds_dir: Path | None
) -> tuple[float, np.ndarray]:
    quiet = ["--log-level", "warning"]
    async with contextlib.AsyncExitStack() as stack:
        last = await stack.enter_async_context(
            serve_node(NodeConfig.load([*quiet, *listen_flags(uds_dir, "n2")]))
        )
        entry = await stack.enter_async_context(
            serve_node(NodeConfig.load([*quiet, *listen_flags(uds_dir, "n1"), "--next", last.url]))
        )
        gateway_flags = [*quiet, *listen_flags(uds_dir, "gw"), "--entry", entry.url,
                         "--inflight", str(args.inflight)]  # fmt: skip
        gateway = await stack.enter_async_context(open_gateway(GatewayConfig.load(gateway_flags)))
        client = await stack.enter_async_context(Client(gateway.url))
        return await best_forward(client, array, encoding="identity", repeat=args.repeat)


async def main(args: argparse.Namespace) -> None:
    array = make_activation(args.tokens, args.hidden)
    print(
        f"client -> gateway -> node 1 -> node 2, echo, identity; 1x{args.tokens}x{args.hidden} "
        f"bfloat16 ({array.nbytes / 2**20:.0f} MiB) in chunks of 128, --inflight "
        f"{args.inflight}; best of {args.repeat}"
    )
    tcp, tcp_out = await measure(args, array, None)
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-") as tmp:
        uds, uds_out = await measure(args, array, Path(tmp))
    same = bytes(tcp_out.view(np.uint8)) == bytes(uds_out.view(np.uint8))
    print(f"  TCP loopback: {tcp * 1000:8.1f} ms   (1.00x)")
    print(f"  Unix sockets: {uds * 1000:8.1f} ms   ({tcp / uds:.2f}x faster)"
          f"   outputs bit-identical: {'yes' if same else 'NO'}")  # fmt: skip
    if not same:
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inflight", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--async-backend", choices=("trio", "asyncio"), default="trio")
    ns = parser.parse_args()
    anyio.run(main, ns, backend=ns.async_backend)
