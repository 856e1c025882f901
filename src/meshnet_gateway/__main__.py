"""``meshnet-gateway`` / ``python -m meshnet_gateway``: serve until SIGINT/SIGTERM.

Flags per wire-2 §9 (``meshnet-gateway --help``); each also reads
``MESHNET_<FLAG>``. Prints one ready line on stdout, logs on stderr, exits
0 after a graceful shutdown.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from meshnet_runtime.config import model_path_problem
from meshnet_runtime.lifecycle import FORCED_EXIT, run_process, serve_until_signalled
from meshnet_runtime.transports import listen

from .app import ChainMismatch, GatewayApp
from .config import GatewayConfig
from .openai import ServedModel
from .openai.draft_model import draft_model_problem
from .server import build_server, ready_line


async def serve(config: GatewayConfig) -> None:
    # Listen before anything else starts: a taken port is a plain OSError
    # (one line on stderr naming the fix, exit 2), not a traceback out of a
    # task group.
    bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)
    app = GatewayApp(config)
    app.fail_fast = True  # a chain that fails its check at start: one line, exit 2
    async with app.running():
        server = build_server(config, app)

        def ready(url: str) -> None:
            print(ready_line(url, app), flush=True)

        await serve_until_signalled(server, bound, ready)


def main(argv: Sequence[str] | None = None) -> int:
    config = GatewayConfig.load(argv)
    if config.model is not None:
        path_problem = model_path_problem(config.model)
        if path_problem is not None:
            print(f"meshnet-gateway: {path_problem}", file=sys.stderr)
            return 2
        # Checked before serving, so a bad model directory is one clear line and exit 2.
        try:
            served = ServedModel.load(
                config.model, name=config.model_name, context=config.max_context
            )
        except (OSError, ValueError) as exc:
            print(f"meshnet-gateway: cannot load --model {config.model}: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C while the tokenizer loads: nothing to drain
            print("meshnet-gateway: interrupted while loading --model", file=sys.stderr)
            return FORCED_EXIT
        if config.draft_model is not None:
            draft = draft_model_problem(config.draft_model, served.tokenizer, config.speculate)
            if draft is not None:
                print(f"meshnet-gateway: {draft}", file=sys.stderr)
                return 2
    mismatch: list[ChainMismatch] = []

    async def serve_checked(config: GatewayConfig) -> None:
        try:
            await serve(config)
        except* ChainMismatch as group:
            mismatch.extend(e for e in group.exceptions if isinstance(e, ChainMismatch))

    status = run_process("meshnet-gateway", serve_checked, config)
    if mismatch:
        problem = mismatch[0].problems[0]
        more = len(mismatch[0].problems) - 1
        also = f" (and {more} more: GET /health?deep=1 lists them)" if more else ""
        print(f"meshnet-gateway: the chain cannot serve: {problem.line()}{also}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
