"""Every exception class of ``meshnet_model``, in one leaf module.

It imports nothing of ours, so any module of the package can raise or catch
these without importing the module that used to define them (the safetensors
reader's ``CheckpointError`` was the one the GGUF reader needed, and the import
cycle through it). Each keeps its base: the ``ValueError`` ones are what the
command lines report as one line, exit 2.
"""

from __future__ import annotations

__all__ = [
    "CacheMismatch",
    "PrefixMismatch",
    "PrefixUnknown",
    "CheckpointError",
    "ChunkTooLarge",
    "ComputeDeadlineExceeded",
    "ConfigError",
    "ContextExceeded",
    "KVBudgetExceeded",
    "RewindRefused",
    "SessionBusy",
    "SessionEnded",
    "StageInputError",
    "StageInvariantError",
    "TorchUnavailable",
]


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read as promised."""


class ConfigError(ValueError):
    """A config.json this package cannot run, with the reason."""


class StageInvariantError(RuntimeError):
    """A stage broke a rule that must always hold (a bug, never the peer's doing)."""


class StageInputError(ValueError):
    """A chunk this stage cannot take (wrong dtype, rank, width, token id)."""


class CacheMismatch(Exception):
    """The session's cache does not hold the context the chunk follows."""


class PrefixUnknown(Exception):
    """A new session names a cached prefix this stage does not hold (wire-2 §3.10)."""


class PrefixMismatch(StageInputError):
    """Block keys that do not name the session's token ids (wire-2 §3.10)."""


class ChunkTooLarge(StageInputError):
    """More rows, or more scratch memory, than this stage takes in one chunk."""


class ContextExceeded(StageInputError):
    """Positions past the model's ``max_position_embeddings``."""


class ComputeDeadlineExceeded(Exception):
    """The request's deadline passed between two layers: the compute stopped."""


class KVBudgetExceeded(Exception):
    """Growing a cache would pass the budget of all sessions together."""

    def __init__(self, message: str, *, needed: int, in_use: int, limit: int) -> None:
        super().__init__(message)
        self.needed, self.in_use, self.limit = needed, in_use, limit


class RewindRefused(ValueError):
    """A rewind to ``length`` outside ``[floor, held]``: past the positions the
    session holds, negative, or into the prefix it attached (``floor``)."""

    def __init__(self, message: str, *, length: int, held: int, floor: int) -> None:
        super().__init__(message)
        self.length, self.held, self.floor = length, held, floor


class SessionBusy(Exception):
    """A rewind while one of the session's chunks computes: it waits for the chunk."""


class SessionEnded(Exception):
    """The session's cache was released while one of its chunks computed."""


class TorchUnavailable(ValueError):
    """The torch engine was asked for but PyTorch cannot be imported.

    A ``ValueError`` so the node's start-up reports it as one line, exit 2."""
