"""What ``--model PATH`` names: a checkpoint directory or a GGUF file.

One place decides, so that the node, the gateway and ``meshnet run`` agree:
a path ending in ``.gguf`` is a GGUF file (config, tensors and tokenizer all
from its metadata), anything else a Hugging Face checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path

from .formats.config import ModelConfig
from .formats.gguf.checkpoint import GGUFCheckpoint, is_gguf
from .formats.gguf.config import gguf_config
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .progress import NO_PROGRESS, LoadProgress

__all__ = ["is_gguf", "load_config", "model_name", "open_checkpoint"]


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
