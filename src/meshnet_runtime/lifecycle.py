"""Running a server as a process: signals, the ready line, exit status.

wire-2 §9: a server prints one line saying where it listens once it is ready,
and exits 0 after a graceful shutdown on SIGINT/SIGTERM. Shutdown is
uvicorn's: the first signal stops taking requests and drains those in flight
for ``--shutdown-timeout`` seconds (one log line says how many, and for how
long); a second signal quits at once, exit status 130. Nothing in it prints a
traceback: a listener that cannot bind is one line naming the fix, exit 2.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from socket import gaierror as socket_gaierror
from typing import NoReturn, TypeVar

import anyio

from .config import ServerConfig
from .http_server import HttpServer, ServerSettings
from .transports import BoundListener, server_ssl_context

__all__ = [
    "FORCED_EXIT",
    "configure_logging",
    "listen_problem",
    "quit_now",
    "resident_memory",
    "rss_suffix",
    "run_process",
    "serve_until_signalled",
    "server_settings",
    "server_tls",
]

Config = TypeVar("Config", bound=ServerConfig)  # a role's config: NodeConfig, GatewayConfig

FORCED_EXIT = 130  # a second signal cut the drain short (the shell's "interrupted")


def quit_now(status: int = FORCED_EXIT) -> NoReturn:
    """Exit this moment, as a second Ctrl-C asks: output flushed, nothing else.

    Not a cancellation: cleanups are shielded and bounded (a session's DELETE
    waits up to its timeout for a chain that is itself going away), and a
    stage computing in a worker thread cannot be cancelled at all — "at once"
    would be seconds. Nothing a server holds outlives the process anyway.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe
            stream.flush()
    logging.shutdown()
    os._exit(status)


def resident_memory() -> str:
    """``rss 312 MiB``: the process's resident memory now (VmRSS), for ready
    lines; empty where /proc is not there to read it."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return f"rss {int(line.split()[1]) / 1024:,.0f} MiB"
    except (OSError, ValueError, IndexError):
        pass
    return ""


_NOT_HERE = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)  # --host names no address of ours


def rss_suffix() -> str:
    """``; rss 312 MiB``: what ends every ready line (node, gateway, ``meshnet
    run``) — a loaded model's real cost, beside the footprint it was checked
    against; empty where it cannot be read."""
    rss = resident_memory()
    return f"; {rss}" if rss else ""


def listen_problem(exc: OSError, host: str, port: int, uds: str | None = None) -> str:
    """A listener that could not bind, as one line: what, then the fix."""
    where = uds if uds is not None else f"{host}:{port}"
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EADDRINUSE:
        fix = (
            "another process listens there: stop it, or choose another --port, 0 for a free one"
            if uds is None
            else "remove the stale socket file, or choose another --uds"
        )
    elif exc.errno == errno.EACCES:
        fix = (
            "ports below 1024 need privileges: choose a --port from 1024 up"
            if uds is None
            else "choose a --uds path in a directory you may write"
        )
    elif isinstance(exc, socket_gaierror) or exc.errno in _NOT_HERE:
        fix = "--host must be an address of this machine (127.0.0.1, 0.0.0.0, ::)"
    else:
        fix = "check --host and --port" if uds is None else "check --uds"
    return f"cannot listen on {where}: {reason.lower()} ({fix})"


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
    drain quits the process at once, exit status 130 (``quit_now``).
    """
    log = logging.getLogger("meshnet")
    server.drain_note = "; a second SIGINT/SIGTERM (Ctrl-C) quits at once"
    # The receiver stays open for the whole drain, so a second Ctrl-C does
    # not turn into a KeyboardInterrupt traceback halfway through it.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def run(*, task_status: anyio.abc.TaskStatus[str]) -> None:
                await server.serve(bound, task_status=task_status)
                tg.cancel_scope.cancel()

            async def watch() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not server.draining and not server.shutdown_requested:
                        log.info("%s: shutting down gracefully", name)
                        server.request_shutdown()
                        continue
                    log.warning("%s again: quitting at once, requests in flight are cut", name)
                    quit_now()

            tg.start_soon(watch)
            ready(await tg.start(run))


def run_process(program: str, serve: Callable[[Config], Awaitable[None]], config: Config) -> int:
    """Run ``serve(config)`` on the configured backend; the process's exit status.

    0 after a graceful shutdown (130 when a second signal forced it: quit_now); 2 with
    one line on stderr when the server cannot listen (port taken, socket path
    not writable): an OSError out of ``serve`` before it is ready is that, a
    refused setting like any other, not a crash to print a traceback of.
    """
    configure_logging(config.log_level)
    try:
        anyio.run(serve, config, backend=config.async_backend)
    except OSError as exc:
        problem = listen_problem(exc, config.host, config.port, config.uds)
        print(f"{program}: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the signal handlers were installed
        return FORCED_EXIT
    return 0
