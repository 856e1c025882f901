"""Which engine computes a stage, in what dtype, with how many threads — the defaults.

``--engine auto`` (the default) is torch for a GGUF file when torch is
installed, so a quantized file is held quantized (``--dtype auto`` → ``keep``
on torch); numpy, the float32 reference, otherwise — a checkpoint directory,
or a machine without torch. ``--dtype auto`` is each engine's own default:
``float32`` for numpy, ``keep`` for torch.

Threads: BLAS pools (numpy's OpenBLAS) are process-wide and set once with
threadpoolctl; torch's intra-op threads are a setting of the *calling*
thread under OpenMP, so the torch engine applies its count in the worker
thread that computes (``TorchStageModel.forward``). ``meshnet run`` gives each
of its stages its share of the cores (``share_cores``), so stages in one
process split the machine instead of each spinning a pool over all of it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..source import is_gguf

__all__ = ["blas_threads", "choose_engine", "set_blas_threads", "share_cores", "usable_cores"]


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


def set_blas_threads(threads: int) -> None:
    """Every BLAS pool of the process to ``threads`` (OpenBLAS, MKL: process-wide)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


def blas_threads() -> int | None:
    """The BLAS pools' thread count now (the largest, if several), or None."""
    from threadpoolctl import threadpool_info

    counts = [int(pool["num_threads"]) for pool in threadpool_info() if pool["user_api"] == "blas"]
    return max(counts) if counts else None
