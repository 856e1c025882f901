"""``meshnet-node`` / ``python -m meshnet_node``: one stage of a meshnet chain."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import anyio

from meshnet_proto import WIRE_VERSION
from meshnet_runtime.config import ServerConfig, load_config
from meshnet_runtime.lifecycle import run_process, serve_until_signalled
from meshnet_runtime.transports import listen

from .app import build_node


def ready_line(config: ServerConfig, url: str) -> str:
    downstream = config.next.url if config.next is not None else "none (last stage)"
    return (
        f"meshnet-node listening on {url} "
        f"(wire {WIRE_VERSION}, stage {config.backend}, next: {downstream})"
    )


async def run(config: ServerConfig) -> None:
    app, server = build_node(config)
    bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)

    def ready(url: str) -> None:
        # The one line scripts wait for; flushed, since stdout may be a pipe.
        print(ready_line(config, url), flush=True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(app.maintain)
            await serve_until_signalled(server, bound, ready)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await app.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    return run_process("meshnet-node", run, load_config("node", argv))


if __name__ == "__main__":
    sys.exit(main())
