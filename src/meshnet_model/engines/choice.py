"""Which engine computes a stage, in what dtype, with how many threads — the defaults.

``--engine auto`` (the default) is torch for a GGUF file when torch is
installed, so a quantized file is held quantized (``--dtype auto`` → ``keep``
on torch); numpy, the float32 reference, otherwise — a checkpoint directory,
or a machine without torch. ``--dtype auto`` is each engine's own default:
``float32`` for numpy, ``keep`` for torch.

Threads: BLAS pools (numpy's OpenBLAS) are process-wide and set once with
threadpoolctl; torch's intra-op threads are a setting of the *calling*
thread under OpenMP, so the torch engine applies its count in the worker
thread that computes (``TorchStageModel.forward``). ``meshnet run`` shares
the cores among its torch stages by who is busy (``core_ledger``); numpy
stages, whose BLAS pool is one for the whole process, keep a static share
(``share_cores``), so stages in one process split the machine instead of
each running a pool over all of it.

Idle threads: ``quiet_idle_threads`` makes torch's OpenMP workers sleep when
they have no work instead of spinning (see there).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from ..source import is_gguf

__all__ = [
    "WAIT_POLICY_VARS",
    "blas_threads",
    "choose_engine",
    "quiet_idle_threads",
    "set_blas_threads",
    "share_cores",
    "usable_cores",
]


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def choose_engine(
    model: str | Path, engine: str, dtype: str, device: str = "cpu"
) -> tuple[str, str]:
    """``(engine, dtype)`` with ``auto`` resolved (see the module docstring)."""
    if engine == "auto":
        wants_torch = device != "cpu" or (is_gguf(model) and torch_installed())
        engine = "torch" if wants_torch else "numpy"
    if dtype == "auto":
        dtype = "keep" if engine == "torch" else "float32"
    return engine, dtype


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def share_cores(stages: int, cores: int | None = None) -> int:
    """Threads for each of ``stages`` stages sharing this machine's cores."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, stages))


# libgomp's (torch's OpenMP) and Intel OpenMP's: what an idle worker does.
WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def quiet_idle_threads(environ: MutableMapping[str, str] | None = None) -> bool:
    """``OMP_WAIT_POLICY=passive`` in the environment, for the OpenMP runtime
    torch loads: its idle workers sleep at once instead of spinning. True if set.

    libgomp reads it once, when torch is imported, so a process's entry point
    calls this first (``meshnet-node``, ``meshnet run``); it does nothing once
    torch is imported, nor where the operator set a wait policy. Why: a worker
    spins up to ~300,000 iterations at each barrier, taking the core from the
    thread it waits for whenever the machine has other work — beside other
    processes, or in ``meshnet run``, whose stages load in a worker thread, at
    every step: decode at 0.4-8 tok/s against 16-31 passive (SmolLM2, 2 cores,
    CPU per token 150-440 ms against 22). Sleeping costs a futex wake-up per
    parallel region, within the noise of a one-stream decode here.
    """
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or any(name in environ for name in WAIT_POLICY_VARS):
        return False
    environ["OMP_WAIT_POLICY"] = "passive"
    return True


def set_blas_threads(threads: int) -> None:
    """Every BLAS pool of the process to ``threads`` (OpenBLAS, MKL: process-wide)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


def blas_threads() -> int | None:
    """The BLAS pools' thread count now (the largest, if several), or None."""
    from threadpoolctl import threadpool_info

    counts = [int(pool["num_threads"]) for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts) if counts else None
