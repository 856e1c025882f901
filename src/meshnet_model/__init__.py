"""meshnet_model: Llama-shaped decoders in numpy, one pipeline stage at a time
(llama, mistral, qwen2, qwen3, smollm3).

* ``ModelConfig`` (alias ``LlamaConfig``) — config.json, fail-closed;
* ``Checkpoint`` / ``open_checkpoint`` — safetensors, memory-mapped;
* ``StageWeights.load(dir, range(a, b), dtype=...)`` — one stage's tensors;
* ``StageModel`` — the forward pass over a ``KVCache``;
* ``StageRunner`` — a stage with its sessions' caches under a ``KVBudget``:
  what ``meshnet-node --model DIR --layers A:B`` runs;
* ``meshnet_model.testing`` — small random checkpoints in the real layout.

numpy, safetensors and ml_dtypes only. docs/models.md has the details.
"""

from .checkpoint import Checkpoint, SafetensorsFile, open_checkpoint
from .config import FAMILIES, SUPPORTED_MODEL_TYPES, LlamaConfig, ModelConfig, RopeScaling
from .errors import (
    CacheMismatch,
    CheckpointError,
    ConfigError,
    KVBudgetExceeded,
    SessionEnded,
    StageInputError,
    StageInvariantError,
)
from .kv_cache import KVBudget, KVCache
from .llama import StageModel
from .rope import Rope
from .runner import StageRunner
from .weights import WEIGHT_DTYPES, StageWeights, parse_layers

__all__ = [
    "FAMILIES",
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
    "ModelConfig",
    "Rope",
    "RopeScaling",
    "SafetensorsFile",
    "SessionEnded",
    "StageInputError",
    "StageInvariantError",
    "StageModel",
    "StageRunner",
    "StageWeights",
    "open_checkpoint",
    "parse_layers",
]
