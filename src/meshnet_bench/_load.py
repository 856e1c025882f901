"""Many sessions at once through a running gateway, for the concurrency figure
and the soak: a chain of real processes and a driver that keeps N sessions busy.

The chain is spawned as ``python -m meshnet_node`` / ``python -m
meshnet_gateway`` processes on loopback (the client's event loop must not
share a core's time slice with the servers it measures). Every answer is
checked bit for bit against what its session sent; a mismatch or an error is
counted, never hidden.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import anyio
import ml_dtypes
import numpy as np

from meshnet_gateway import Client
from meshnet_proto import MeshnetError

from ._support import current_rss_bytes, server_process

__all__ = ["LoadStats", "ProcessChain", "drive", "process_chain", "rss_bytes"]


@dataclass(slots=True)
class ProcessChain:
    gateway_url: str
    node_urls: list[str]  # entry first
    procs: dict[str, subprocess.Popen[str]]  # "gateway", "node1", "node2", ...


@contextlib.contextmanager
def process_chain(
    nodes: int = 2,
    *,
    node_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
) -> Iterator[ProcessChain]:
    """``nodes`` node processes and a gateway on loopback; all stopped on exit."""
    quiet = ("--port", "0", "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        procs: dict[str, subprocess.Popen[str]] = {}
        urls: list[str] = []
        downstream: list[str] = []
        for i in range(nodes, 0, -1):  # the last stage first
            proc, url = stack.enter_context(
                server_process("meshnet_node", *quiet, *node_flags, *downstream)
            )
            procs[f"node{i}"] = proc
            urls.insert(0, url)
            downstream = ["--next", url]
        proc, gateway_url = stack.enter_context(
            server_process("meshnet_gateway", *quiet, "--entry", urls[0], *gateway_flags)
        )
        procs["gateway"] = proc
        yield ProcessChain(gateway_url, urls, procs)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (Linux ``/proc``), 0 when unknown."""
    try:
        return current_rss_bytes(pid)
    except (OSError, RuntimeError):
        return 0


def make_inputs(count: int, tokens: int, hidden: int, seed: int) -> list[np.ndarray]:
    """``count`` distinct (1, tokens, hidden) bfloat16 activations."""
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((1, tokens, hidden), dtype=np.float32).astype(ml_dtypes.bfloat16)
        for _ in range(count)
    ]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@dataclass(slots=True)
class LoadStats:
    requests: int = 0
    bytes: int = 0  # input bytes of requests answered correctly
    mismatches: int = 0
    errors: int = 0
    seconds: float = 0.0
    error_samples: list[str] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        """Input bytes per second answered correctly."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


async def drive(
    url: str,
    *,
    sessions: int,
    inputs: Sequence[np.ndarray],
    requests_per_session: int | None = None,
    until: float | None = None,
    stats: LoadStats | None = None,
    encoding: str = "identity",
    delete: bool = True,
    context_requests: int | None = None,
) -> LoadStats:
    """Keep ``sessions`` sessions busy at the gateway ``url``.

    Each session sends ``requests_per_session`` requests (or until the
    ``time.monotonic()`` point ``until``), continuing its own context, and
    ends it with ``DELETE`` — after every ``context_requests`` requests when
    given, then starting a new one. Request ``k`` of session ``s`` sends
    ``inputs[(s + k) % len(inputs)]``: neighbours send different data at
    the same moment, so an answer given to the wrong session is caught.
    """
    if requests_per_session is None and until is None:
        raise ValueError("give requests_per_session or until")
    stats = stats or LoadStats()
    started = time.perf_counter()
    async with Client(url, max_connections=sessions) as client:

        async def one(s: int) -> None:
            session: str | None = None
            k = 0
            while True:
                if requests_per_session is not None and k >= requests_per_session:
                    break
                if until is not None and time.monotonic() >= until:
                    break
                array = inputs[(s + k) % len(inputs)]
                k += 1
                try:
                    result = await client.forward(array, session=session, encoding=encoding)
                except MeshnetError as exc:
                    stats.errors += 1
                    if len(stats.error_samples) < 5:
                        stats.error_samples.append(str(exc))
                    session = None  # the gateway dropped the context: start again
                    continue
                session = result.session
                stats.requests += 1
                if context_requests is not None and k % context_requests == 0:
                    with contextlib.suppress(MeshnetError):
                        await client.delete_session(session)
                    session = None
                if _same_bits(result.output, array):
                    stats.bytes += array.nbytes
                else:
                    stats.mismatches += 1
            if delete and session is not None:
                with contextlib.suppress(MeshnetError):
                    await client.delete_session(session)

        async with anyio.create_task_group() as tg:
            for s in range(sessions):
                tg.start_soon(one, s)
    stats.seconds += time.perf_counter() - started
    return stats
