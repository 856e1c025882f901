"""meshnet_model: the Llama family in numpy, one pipeline stage at a time.

* ``LlamaConfig`` — config.json; ``Checkpoint`` — safetensors, memory-mapped;
* ``StageWeights.load(dir, range(a, b), dtype=...)`` — one stage's tensors;
* ``StageModel`` — the forward pass over a ``KVCache``;
* ``StageRunner`` — a stage with its sessions' caches under a ``KVBudget``:
  what ``meshnet-node --model DIR --layers A:B`` runs;
* ``meshnet_model.testing`` — small random checkpoints in the real layout.

numpy, safetensors and ml_dtypes only. docs/models.md has the details.
"""

from .checkpoint import Checkpoint, CheckpointError, SafetensorsFile
from .config import SUPPORTED_MODEL_TYPES, ConfigError, LlamaConfig, RopeScaling
from .kv_cache import KVBudget, KVBudgetExceeded, KVCache, SessionEnded
from .llama import StageInvariantError, StageModel
from .rope import Rope
from .runner import CacheMismatch, StageInputError, StageRunner
from .weights import WEIGHT_DTYPES, StageWeights, parse_layers

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "WEIGHT_DTYPES",
    "CacheMismatch",
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "KVBudget",
    "KVBudgetExceeded",
    "KVCache",
    "LlamaConfig",
    "Rope",
    "RopeScaling",
    "SafetensorsFile",
    "SessionEnded",
    "StageInputError",
    "StageInvariantError",
    "StageModel",
    "StageRunner",
    "StageWeights",
    "parse_layers",
]
