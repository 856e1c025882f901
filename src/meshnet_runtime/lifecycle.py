"""Running a server as a process: signals, the ready line, exit status.

wire-2 §9: a server prints one line saying where it listens once it is ready,
and exits 0 after a graceful shutdown on SIGINT/SIGTERM.
"""

from __future__ import annotations

import logging
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .config import ServerConfig
from .http_server import HttpServer, ServerSettings
from .transports import BoundListener, server_ssl_context

__all__ = [
    "configure_logging",
    "run_process",
    "serve_until_signalled",
    "server_settings",
    "server_tls",
]

Config = TypeVar("Config", bound=ServerConfig)  # a role's config: NodeConfig, GatewayConfig


def server_settings(config: ServerConfig) -> ServerSettings:
    """The serving loop's settings from a node's or gateway's flags."""
    return ServerSettings(
        head_timeout=config.head_timeout,
        body_timeout=config.timeout,
        write_timeout=config.timeout,
        max_connections=config.max_connections,
        shutdown_timeout=config.shutdown_timeout,
    )


def server_tls(config: ServerConfig) -> ssl.SSLContext | None:
    """The TLS context to serve with (``--tls-cert``/``--tls-key``), or None."""
    if config.tls_cert and config.tls_key:
        return server_ssl_context(config.tls_cert, config.tls_key)
    return None


def configure_logging(level: str) -> None:
    # Logs go to stderr: stdout carries only the ready line, for scripts.
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def serve_until_signalled(
    server: HttpServer,
    bound: BoundListener,
    ready: Callable[[str], None],
) -> None:
    """Serve ``bound`` until SIGINT/SIGTERM, then shut down gracefully.

    ``ready(url)`` runs once the listener accepts; a second signal during the
    drain is ignored (the shutdown timeout bounds it anyway).
    """
    log = logging.getLogger("meshnet")
    # The receiver stays open for the whole drain, so a second Ctrl-C does
    # not turn into a KeyboardInterrupt traceback halfway through it.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def run(*, task_status: anyio.abc.TaskStatus[str]) -> None:
                await server.serve(bound, task_status=task_status)
                tg.cancel_scope.cancel()

            async def watch() -> None:
                async for signum in signals:
                    log.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    server.request_shutdown()

            tg.start_soon(watch)
            ready(await tg.start(run))


def run_process(program: str, serve: Callable[[Config], Awaitable[None]], config: Config) -> int:
    """Run ``serve(config)`` on the configured backend; the process's exit status.

    0 after a graceful shutdown; 1 with one line on stderr when the server
    cannot listen (port taken, socket path not writable): an OSError out of
    ``serve`` before it is ready is that, not a crash to print a traceback of.
    """
    configure_logging(config.log_level)
    try:
        anyio.run(serve, config, backend=config.async_backend)
    except OSError as exc:
        print(f"{program}: cannot listen: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 130
    return 0
