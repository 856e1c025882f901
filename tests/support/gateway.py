"""Helpers for the gateway and CLI tests: chains in-process and as subprocesses."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from meshnet_gateway import RunningGateway, open_gateway
from meshnet_gateway.config import GatewayConfig
from meshnet_node import RunningNode, serve_node
from meshnet_node.config import NodeConfig

QUIET = ["--host", "127.0.0.1", "--port", "0", "--log-level", "warning"]


def activation(tokens: int = 512, hidden: int = 64, seed: int = 7) -> np.ndarray:
    """A (1, tokens, hidden) bfloat16 stub activation with random bits."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1, tokens, hidden), dtype=np.float32).astype(ml_dtypes.bfloat16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bytes(np.ascontiguousarray(a).view(np.uint8))
        == bytes(np.ascontiguousarray(b).view(np.uint8))
    )


@dataclass
class Chain:
    nodes: list[RunningNode]  # entry first
    gateway: RunningGateway

    @property
    def entry(self) -> str:
        return self.nodes[0].url


@asynccontextmanager
async def chain(
    length: int = 2,
    *,
    node_flags: Sequence[str] = (),
    last_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
) -> AsyncIterator[Chain]:
    """``length`` nodes (the last one gets ``last_flags`` too) and a gateway."""
    async with contextlib.AsyncExitStack() as stack:
        nodes: list[RunningNode] = []
        next_url: str | None = None
        for position in range(length):
            flags = [*QUIET, *node_flags]
            if position == 0:
                flags += list(last_flags)
            if next_url is not None:
                flags += ["--next", next_url]
            node = await stack.enter_async_context(serve_node(NodeConfig.load(flags)))
            nodes.insert(0, node)
            next_url = node.url
        assert next_url is not None
        gateway = await stack.enter_async_context(
            open_gateway(GatewayConfig.load([*QUIET, "--entry", next_url, *gateway_flags]))
        )
        yield Chain(nodes, gateway)


def chunks_counted(app: Any, outcome: str) -> float | None:
    """A server's ``meshnet_chunks_total{outcome=...}``, read as Prometheus would."""
    return app.metrics.registry.get_sample_value("meshnet_chunks_total", {"outcome": outcome})


_HELD: list[socket.socket] = []


def closed_port_url() -> str:
    """A loopback URL nobody listens on: its port stays bound here, never listening.

    A connection to it is refused, and, bound for as long as the tests run,
    the port cannot be handed to another server meanwhile (one released at
    once could be).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def release_port(url: str) -> str:
    """Let go of ``closed_port_url``'s port, for a server about to bind it; its port.

    Only for a test about a server that comes up where a peer already
    expects it (a gateway started before its entry): the port must be named
    before that server starts, and is released just before it binds.
    """
    port = int(url.rsplit(":", 1)[1])
    for sock in _HELD:
        if sock.getsockname()[1] == port:
            _HELD.remove(sock)
            sock.close()
            return str(port)
    raise AssertionError(f"{url} is not a held closed port")


# ------------------------------------------------------------------ processes


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}


def spawn(
    module: str, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m module`` as a user would; return it and its URL from the ready line.

    ``env``: ``MESHNET_*`` variables to set (the test's own are never inherited).
    ``timeout`` only ends a start that never comes: the ready line is the event
    waited for, and a loaded machine may take a while to import numpy and torch.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean_env(), **(env or {})},
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"{module}: no ready line within {timeout} s")
    line = proc.stdout.readline()
    if " listening on " not in line:
        proc.kill()
        raise AssertionError(f"{module}: bad ready line {line!r}; stderr: {proc.stderr.read()}")
    url = line.split(" listening on ", 1)[1].split()[0]
    return proc, url


def stop(proc: subprocess.Popen[str], timeout: float = 60.0) -> int:
    """SIGTERM, then the exit status (killing it if it does not exit in time)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"pid {proc.pid} did not exit within {timeout} s of SIGTERM") from None


@contextlib.contextmanager
def process_chain(
    length: int = 2, *, gateway_flags: Sequence[str] = ()
) -> Iterator[tuple[list[str], str, list[subprocess.Popen[str]]]]:
    """Nodes and a gateway as subprocesses: (node URLs entry first, gateway URL, procs)."""
    procs: list[subprocess.Popen[str]] = []
    urls: list[str] = []
    try:
        args: list[str] = []
        for _ in range(length):
            proc, url = spawn("meshnet_node", *args)
            procs.append(proc)
            urls.insert(0, url)
            args = ["--next", url]
        proc, gateway_url = spawn("meshnet_gateway", "--entry", urls[0], *gateway_flags)
        procs.append(proc)
        yield urls, gateway_url, procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
