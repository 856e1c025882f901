"""Importing torch on demand, and the names the command line uses for it.

Nothing here imports torch at module import time: the device string is
checked before torch is loaded (so a typo is refused without the 2 s import),
and ``import_torch`` turns a missing installation into one line naming the
extra to install.
"""

from __future__ import annotations

import re
from types import ModuleType

from ...errors import TorchUnavailable

__all__ = ["COMPUTE_DTYPES", "TorchUnavailable", "check_device", "import_torch", "parse_device"]

# --dtype values the torch engine computes in ("keep": the checkpoint's own).
COMPUTE_DTYPES = ("keep", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]{0,2}))?")
# Works on a fresh machine as written: the extra from the checkout, or torch
# itself (the extra only pins torch>=2.4); "meshnet" on the index is another
# project, so the hint never names a distribution to fetch from there.
INSTALL_HINT = "pip install -e '.[torch]' in the meshnet checkout (or: pip install 'torch>=2.4')"


def import_torch() -> ModuleType:
    try:
        import torch
    except ImportError as exc:
        raise TorchUnavailable(
            f"--engine torch needs PyTorch, which is not installed ({exc.msg}): {INSTALL_HINT}"
        ) from None
    return torch


def parse_device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (N < 1000), else ``ValueError``."""
    if not _DEVICE.fullmatch(text):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    return text


def check_device(torch: ModuleType, device: str) -> None:
    """Refuse a CUDA device this machine does not have, in one line."""
    parse_device(device)
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: no CUDA device is available here "
            f"(torch {torch.__version__}, cuda build {torch.version.cuda or 'none'})"
        )
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s)")
