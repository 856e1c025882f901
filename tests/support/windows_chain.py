"""Real SmolLM2 node processes on the chain's token, and raw wire-2 chunks
for verify windows and rewinds (wire-2 §3.16), for the hostile matrix of
tests/system/test_windows_hostile.py.

The processes start in parallel, two at a time (each round's URLs are the
next round's ``--next``); each is ready when it prints its ready line.
Chunks are bytes built here, sent on a fresh connection with
``support.security.send``: nothing tidies what a test sends or reads.
"""

from __future__ import annotations

import contextlib
import select
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from support.gateway import clean_env
from support.security import Answer, Pairs, request, send

__all__ = ["GREEDY", "Chunk", "chunk_request", "node_processes", "post", "rows"]

# Greedy sampling (wire-2 §3.13): what a window's drafts are verified against.
GREEDY = b"seed=1,temperature=0"


@dataclass(frozen=True)
class Chunk:
    """One run's chunk 0 of ``session`` (``index``/``total`` to put it elsewhere)."""

    session: str
    ids: Sequence[int] | np.ndarray  # int32 ids, or a float32 [1, tokens, hidden] tensor
    position: int | None
    key: str | None
    after: tuple[int, int] | None = None  # X-Meshnet-After: (position F, epoch E)
    draft: Sequence[int] | None = None
    sample: bytes | None = None
    prefix: str | None = None
    prefix_blocks: Sequence[str] = ()
    deadline_ms: int | None = None
    index: int = 0
    total: int = 1

    def pairs(self) -> Pairs:
        tensor = self.tensor()
        dtype = b"int32" if tensor.dtype == np.int32 else b"float32"
        pairs: Pairs = [
            (b"Content-Type", b"application/octet-stream"),
            (b"X-Meshnet-Shape", ",".join(map(str, tensor.shape)).encode()),
            (b"X-Meshnet-Dtype", dtype),
            (b"X-Meshnet-Session", self.session.encode()),
            (b"X-Meshnet-Chunk-Index", b"%d" % self.index),
            (b"X-Meshnet-Chunk-Total", b"%d" % self.total),
        ]
        optional = {
            b"X-Meshnet-Position": None if self.position is None else b"%d" % self.position,
            b"X-Meshnet-Session-Key": None if self.key is None else self.key.encode(),
            b"X-Meshnet-After": None
            if self.after is None
            else b"position=%d,epoch=%d" % self.after,
            b"X-Meshnet-Draft": None if self.draft is None else _ids(self.draft),
            b"X-Meshnet-Sample": self.sample,
            b"X-Meshnet-Prefix": None if self.prefix is None else self.prefix.encode(),
            b"X-Meshnet-Prefix-Blocks": ",".join(self.prefix_blocks).encode() or None,
            b"X-Meshnet-Deadline-Ms": (
                None if self.deadline_ms is None else b"%d" % self.deadline_ms
            ),
        }
        return pairs + [(name, value) for name, value in optional.items() if value is not None]

    def tensor(self) -> np.ndarray:
        if isinstance(self.ids, np.ndarray) and self.ids.dtype != np.int32:
            return np.ascontiguousarray(self.ids, dtype="<f4")
        return np.asarray([list(self.ids)], dtype="<i4")


def _ids(ids: Sequence[int]) -> bytes:
    return ",".join(str(int(i)) for i in ids).encode()


def chunk_request(chunk: Chunk, token: str | None, *, target: bytes = b"/forward") -> bytes:
    return request(chunk.pairs(), chunk.tensor().tobytes(), target=target, token=token)


def post(url: str, chunk: Chunk, token: str | None) -> Answer:
    """``chunk`` sent to ``url`` on a connection of its own; the answer as it came."""
    return send(url, chunk_request(chunk, token), timeout=120.0)


def rows(answer: Answer) -> bytes:
    """A 200's body (logits, drawn tokens or logprob rows), to compare bit for bit."""
    assert answer.status == 200, answer.raw[:400]
    return answer.body


def _launch(args: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "meshnet_node", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**clean_env(), **env},
        )


def _ready(proc: subprocess.Popen[str], log: Path, timeout: float = 180.0) -> str:
    """The URL of ``proc``'s ready line (the event waited for; the bound ends a hang)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert " listening on " in line, f"no ready line ({line!r}); log: {log.read_text()[-2000:]}"
    return line.split(" listening on ", 1)[1].split()[0]


def _exit_status(proc: subprocess.Popen[str], timeout: float = 60.0) -> int | None:
    """How a process told to stop exited (None: it had to be killed)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


@contextlib.contextmanager
def node_processes(
    rounds: Sequence[Sequence[tuple[str, Sequence[str], str | None]]],
    logs: Path,
    token: str,
) -> Iterator[dict[str, str]]:
    """Start each round's nodes at once — ``(name, flags, next)``, ``next``
    the name of a node of an earlier round — the chain's token given in
    ``MESHNET_TOKEN`` (never on a command line); yields their URLs by name
    and stops them all (each must exit 0) after the block."""
    procs: dict[str, subprocess.Popen[str]] = {}
    urls: dict[str, str] = {}
    try:
        for nodes in rounds:
            started = []
            for name, flags, downstream in nodes:
                args = [*flags] + ([] if downstream is None else ["--next", urls[downstream]])
                log = logs / f"{name}.log"
                procs[name] = _launch(args, log, {"MESHNET_TOKEN": token})
                started.append((name, log))
            for name, log in started:
                urls[name] = _ready(procs[name], log)
        yield urls
        for proc in procs.values():  # all at once: each drains on its own
            proc.send_signal(signal.SIGTERM)
        for name, proc in procs.items():
            assert _exit_status(proc) == 0, (logs / f"{name}.log").read_text()[-2000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
