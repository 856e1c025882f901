"""``meshnet-gateway`` / ``python -m meshnet_gateway``: serve until SIGINT/SIGTERM.

Flags per wire-2 §9 (``meshnet-gateway --help``); each also reads
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
from .openai import ServedModel
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
    config = load_config("gateway", argv)
    if config.model is not None:
        # Checked before serving, so a bad model directory is one clear line and exit 2.
        try:
            ServedModel.load(config.model, name=config.model_name, context=config.max_context)
        except (OSError, ValueError) as exc:
            print(f"meshnet-gateway: cannot load --model {config.model}: {exc}", file=sys.stderr)
            return 2
    return run_process("meshnet-gateway", serve, config)


if __name__ == "__main__":
    sys.exit(main())
