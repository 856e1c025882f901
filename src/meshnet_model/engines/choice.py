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

Idle threads: ``quiet_idle_threads`` bounds how long torch's OpenMP workers
spin when they have no work before they sleep (see there).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from ..source import is_gguf

__all__ = [
    "SPIN_COUNT",
    "WAIT_POLICY_VARS",
    "blas_threads",
    "TORCH_INSTALL",
    "choose_engine",
    "engine_advice",
    "quiet_idle_threads",
    "set_blas_threads",
    "share_cores",
    "usable_cores",
]


# The torch extra is this one requirement; naming it installs it in any
# environment, a checkout's or not (the extra, '.[torch]', needs the checkout).
TORCH_INSTALL = "pip install 'torch>=2.4'"


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


def engine_advice(model: str | Path, engine: str) -> str:
    """What a node's ready line adds when numpy computes a GGUF file: it holds
    the file's matrices as float32, several times their quantized bytes and
    slower (SmolLM2 Q4_1: 853 MiB and 15 tok/s against 420 MiB and 26-30 on
    torch) — and how to hold them quantized instead. "" otherwise."""
    if engine != "numpy" or not is_gguf(model):
        return ""
    fix = "--engine torch" if torch_installed() else f"{TORCH_INSTALL} in this environment"
    return (
        "; numpy holds this GGUF file's matrices as float32 (several times the file's"
        f" bytes, and slower): {fix} holds them as the file stores them"
    )


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
# Iterations an idle libgomp worker spins before it sleeps: tens of
# microseconds, enough to catch the next parallel region of a step.
SPIN_COUNT = 10_000


def quiet_idle_threads(environ: MutableMapping[str, str] | None = None) -> bool:
    """``GOMP_SPINCOUNT`` set to ``SPIN_COUNT`` in the environment, for the
    OpenMP runtime torch loads: an idle worker spins that long, then sleeps.
    True if set.

    libgomp reads it once, when torch is imported, so a process's entry point
    calls this first (``meshnet-node``, ``meshnet run``); it does nothing once
    torch is imported, nor where the operator set a wait policy. Why, measured
    on ``meshnet run --stages 1`` (SmolLM2, 2 cores, one stream, decode tok/s
    quiet and beside two CPU-bound busy loops): libgomp's default spins up to
    300,000 iterations at each barrier, taking the core from the thread it
    waits for whenever the machine has other work — 29.0 quiet, 5.0 beside
    the loops (0.17x); sleeping at once (``OMP_WAIT_POLICY=passive``) pays a
    futex wake-up at each of a token's ~200 parallel regions — 18.9 quiet,
    12.4 beside; 10,000 iterations keep both — 28.9 quiet, 14.8 beside.
    """
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or any(name in environ for name in WAIT_POLICY_VARS):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
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
