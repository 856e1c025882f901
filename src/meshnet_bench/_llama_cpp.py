"""llama.cpp beside meshnet in the compute section: where its binaries are,
``llama-bench`` runs, a ``llama-server`` process, and the cores both share.

llama.cpp is not a dependency: the bench uses a build it is pointed at
(``MESHNET_LLAMA_CPP=dir`` holding ``llama-bench`` and ``llama-server``) or
finds on ``PATH``; without one the section compares with the figures issue
39 quotes (:data:`QUOTED`), named as quoted in its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV",
    "QUOTED",
    "LlamaCpp",
    "LlamaServer",
    "find",
    "has_amx",
    "llama_bench",
    "llama_server",
    "pin",
    "shared_cores",
]

ENV = "MESHNET_LLAMA_CPP"
THREADS = 2  # llama.cpp's -t, and the cores every contender is pinned to

# Issue 39's llama.cpp figures (2 threads, 2 vCPUs, load 1.3-4.4): the
# baseline where no build is found. tok/s, seconds.
QUOTED: dict[str, float] = {
    "prefill_tok_s": 117.0,  # llama-bench pp512, the 1B-shaped Q4_0 file
    "decode_tok_s": 90.0,  # llama-bench tg, SmolLM2-135M Q4_1
    "streams16_tok_s": 182.0,  # llama-server --parallel 16, 16 streams' aggregate
    "ready_s": 1.3,  # llama-server, the 1B file: exec -> /health 200
}


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    bench: Path
    server: Path

    @property
    def where(self) -> str:
        return str(self.bench.parent)


def find() -> tuple[LlamaCpp | None, str]:
    """The build to run and how it was found, or None and why not.

    ``MESHNET_LLAMA_CPP`` set names the only place looked at (a bench pointed
    at a directory must not silently measure another build from ``PATH``)."""
    names = ("llama-bench", "llama-server")
    directory = os.environ.get(ENV)
    if directory:
        paths = [Path(directory) / name for name in names]
        if all(p.is_file() and os.access(p, os.X_OK) for p in paths):
            return LlamaCpp(*paths), f"{ENV}={directory}"
        return None, f"{ENV}={directory} holds no executable llama-bench and llama-server"
    found = [shutil.which(name) for name in names]
    if found[0] and found[1]:
        return LlamaCpp(Path(found[0]), Path(found[1])), "PATH"
    return None, f"neither {ENV} nor PATH has llama-bench and llama-server"


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (``amx_tile`` among /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and " amx_tile" in line for line in info)
    except OSError:
        return False


def shared_cores() -> list[int]:
    """The cores every contender runs on: the first :data:`THREADS` this
    process may use (2 threads each, on the same 2 cores, as the issue measured)."""
    return sorted(os.sched_getaffinity(0))[:THREADS]


def pin() -> None:
    """A ``preexec_fn``: the child runs on :func:`shared_cores` only (so
    meshnet's default thread split sees those cores, as llama.cpp's -t does)."""
    os.sched_setaffinity(0, shared_cores())


def llama_bench(
    build: LlamaCpp, model: Path, *, prompt: int, generate: int, timeout: float = 600.0
) -> float:
    """One ``llama-bench`` run (``-r 1``, after its own warm-up): tokens/s."""
    argv = [
        str(build.bench),
        "-m",
        str(model),
        "-p",
        str(prompt),
        "-n",
        str(generate),
        "-t",
        str(THREADS),
        "-r",
        "1",
        "-o",
        "json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=pin)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-1500:]}")
    return float(json.loads(done.stdout)[0]["avg_ts"])


def _free_port() -> int:
    # llama-server prints the port of --port 0 only once loaded; /health is
    # polled during the load, so the port is chosen here (a race nobody runs).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2.0) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:  # 503 while it loads
        return exc.code
    except OSError:  # not listening yet
        return 0


@dataclass(frozen=True, slots=True)
class LlamaServer:
    url: str
    pid: int
    ready_s: float  # exec -> the first /health 200


@contextlib.contextmanager
def llama_server(
    build: LlamaCpp, model: Path, args: Sequence[str], timeout: float = 300.0
) -> Iterator[LlamaServer]:
    """``llama-server -m model args`` on loopback until the block ends, ready
    (``GET /health`` 200); always stopped. Its log is quoted if it fails."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        str(build.server),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(THREADS),
        *args,
    ]
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pin)
        try:
            while _health(url) != 200:
                if proc.poll() is not None or time.perf_counter() - started > timeout:
                    log.seek(0)
                    raise RuntimeError(f"llama-server did not get ready: {log.read()[-2000:]}")
                time.sleep(0.02)
            yield LlamaServer(url, proc.pid, time.perf_counter() - started)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
