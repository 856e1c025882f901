"""``meshnet-gateway`` / ``python -m meshnet_gateway``: serve until SIGINT/SIGTERM.

Flags per SPEC §9 (``meshnet-gateway --help``); each also reads
``MESHNET_<FLAG>``. Prints one ready line on stdout, logs on stderr, exits
0 after a graceful shutdown.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from meshnet_runtime.config import ServerConfig, load_config
from meshnet_runtime.lifecycle import run_process, serve_until_signalled
from meshnet_runtime.transports import listen

from .app import GatewayApp
from .server import build_server, ready_line


async def serve(config: ServerConfig) -> None:
    # Listen before anything else starts: a taken port is a plain OSError
    # (one line on stderr, exit 1), not a traceback out of a task group.
    bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)
    app = GatewayApp(config)
    async with app.running():
        server = build_server(config, app)

        def ready(url: str) -> None:
            print(ready_line(url, app), flush=True)

        await serve_until_signalled(server, bound, ready)


def main(argv: Sequence[str] | None = None) -> int:
    return run_process("meshnet-gateway", serve, load_config("gateway", argv))


if __name__ == "__main__":
    sys.exit(main())
