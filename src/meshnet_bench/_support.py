"""What several sections share: timing, percentiles, server processes, cells.

Every figure of ``meshnet bench`` is a ratio of two things measured in the
same run; :func:`interleaved` alternates them (A, B, A, B, …) so that a
neighbour's burst of load on this shared machine falls on both alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from meshnet_gateway import Client
    from meshnet_model import ModelConfig

    from ._result import BenchOptions

MiB = 1024 * 1024
LOOPBACK = ["--host", "127.0.0.1", "--port", "0"]
QUIET = [*LOOPBACK, "--log-level", "warning"]


async def interleaved(
    contenders: Mapping[str, Callable[[], Awaitable[object]]],
    repeat: int,
    check: Callable[[str, object], None] | None = None,
    progress: Callable[[str], None] | None = None,
    after: Callable[[str], Awaitable[object]] | None = None,
) -> dict[str, list[float]]:
    """Wall times of ``repeat`` calls of each contender, taken in turns.

    ``check(name, result)`` (say, that an echo is bit-identical) runs after
    each call, outside the timed part, and so does ``await after(name)``
    (say, ending the session the call opened); ``progress`` gets a line per
    round.
    """
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(repeat):
        if progress is not None:
            progress(f"  round {round_ + 1}/{repeat}")
        for name, call in contenders.items():
            start = time.perf_counter()
            result = await call()
            times[name].append(time.perf_counter() - start)
            if check is not None:
                check(name, result)
            if after is not None:
                await after(name)
    return times


async def best_forward(
    client: Client, array: np.ndarray, *, encoding: str, repeat: int
) -> tuple[float, np.ndarray]:
    """Best wall time of ``repeat`` gateway forwards of ``array``, and the last
    output. One token goes through first so that connections are open and
    pooled before anything is timed. (Best, not median: where the figure is
    compared with an ideal, load on the machine only ever adds.)"""
    await client.forward(array[:, :1], encoding=encoding)
    best, output = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = await client.forward(array, encoding=encoding)
        best = min(best, time.perf_counter() - start)
        output = result.output
    assert output is not None
    return best, output


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (``fraction`` in 0..1) of ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def rate_mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


def ratio(numerator: float, denominator: float) -> float | None:
    """Rounded for the JSON object; None (JSON null) for a zero denominator,
    which a timer never gives (JSON has no infinity)."""
    return round(numerator / denominator, 3) if denominator else None


# ------------------------------------------------------------ processes


def _child_env() -> dict[str, str]:
    """Our environment without MESHNET_* settings (they would change the
    servers under test) and with this package importable (a source run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    src = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def server_process(
    module: str,
    *args: str,
    timeout: float = 60.0,
    preexec_fn: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``python -m module args`` until the block ends; yields it and the URL of
    its ready line (``… listening on URL``). Always stopped, killed if need be.
    ``preexec_fn`` runs in the child before it execs (joining a cgroup, say);
    ``env`` replaces its environment (another tree's ``PYTHONPATH``, say).

    Its stderr goes to a temporary file, quoted when it fails to start. The
    generous start-up timeout is for a loaded machine (imports take seconds).
    """
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=dict(env) if env is not None else _child_env(),
            preexec_fn=preexec_fn,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else ""
            if " listening on " not in line:
                errors.seek(0)
                raise RuntimeError(
                    f"{module} did not start (ready line {line!r}); stderr: {errors.read()[-2000:]}"
                )
            yield proc, line.split(" listening on ", 1)[1].split()[0]
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (Linux only), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set (``VmHWM``)."""
    return _status_bytes(pid, "VmHWM")


def reset_peak_rss(pid: int) -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: write 5 to clear_refs).

    False where the kernel or permissions do not allow it: the peak then
    includes whatever came before (the warm-up), which only makes it higher.
    """
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def current_rss_bytes(pid: int) -> int:
    """The process's resident set now (``VmRSS``)."""
    return _status_bytes(pid, "VmRSS")


# ------------------------------------------------------------ cells


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us"


def mib(nbytes: int) -> str:
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB else f"{nbytes / 1024:.0f} KiB"


def times_x(value: float) -> str:
    return f"{value:.2f}x"


@contextlib.contextmanager
def random_smollm(
    options: BenchOptions, layers: int, label: str, section: str
) -> Iterator[tuple[str, ModelConfig]]:
    """A random checkpoint of SmolLM-135M's shape with ``layers`` layers (a
    toy model with ``options.tiny``), written to a temporary directory for
    the block: (the directory, its config)."""
    from meshnet_model.testing import small_config, smollm_135m_config, write_checkpoint

    config = (
        small_config(num_hidden_layers=layers, max_position_embeddings=2048)
        if options.tiny
        else smollm_135m_config(num_hidden_layers=layers)
    )
    with tempfile.TemporaryDirectory(prefix=f"meshnet-bench-{section}-") as directory:
        options.progress(f"{section}: writing a random checkpoint ({label})")
        write_checkpoint(directory, config, seed=0)
        yield directory, config
