"""meshnet_model: Llama-shaped decoders in numpy, one pipeline stage at a time
(llama, mistral, qwen2, qwen3, smollm3).

* ``ModelConfig`` (alias ``LlamaConfig``) — config.json, fail-closed;
* ``Checkpoint`` / ``open_checkpoint`` — safetensors, memory-mapped;
* ``StageWeights.load(dir, range(a, b), dtype=...)`` — one stage's tensors;
* ``StageModel`` — the forward pass over a ``KVCache``;
* ``StageRunner`` — a stage with its sessions' caches under a ``KVBudget``:
  what ``meshnet-node --model DIR --layers A:B`` runs;
* ``meshnet_model.testing`` — small random checkpoints in the real layout.

The modules, each layer importing only those before it:

* ``errors`` — every exception class (imports nothing of ours); ``progress`` — a
  load's progress (``on_bytes``, the lines and the bar; nothing of ours either);
* ``formats`` — reading from disk: ``config``, ``safetensors``, ``gguf.*``;
  ``rope`` — the RoPE math the engines and the GGUF config reader share;
* ``source`` — what ``--model PATH`` names (``load_config``, ``open_checkpoint``);
* ``stage`` — ``weights``, ``kv_cache``, ``costs``, ``runner``: one stage, any engine;
* ``engines`` — ``base.Engine``, ``numpy.model`` (the float32 reference), ``torch``
  (optional; holds a GGUF file quantized: ``torch.qlinear``), ``choice`` (the
  defaults: ``--engine/--dtype auto``, threads), ``footprint`` (what a stage will hold);
* ``identity`` — a stage's digests (which checkpoint, which tensors, which tokenizer);
* ``plan`` — ``python -m meshnet_model plan``; ``testing`` — helpers for tests and benches.

It imports numpy, ml_dtypes, safetensors, xxhash, gguf, tokenizers, threadpoolctl
and tqdm (all base dependencies of meshnet), and torch only in the torch engine (the
``torch`` extra: ``pip install -e '.[torch]'`` in the checkout); nothing of the
wire or the runtime. docs/models.md has the details.
"""

from .engines.numpy.model import StageModel
from .errors import (
    CacheMismatch,
    CheckpointError,
    ConfigError,
    KVBudgetExceeded,
    SessionEnded,
    StageInputError,
    StageInvariantError,
)
from .formats.config import FAMILIES, SUPPORTED_MODEL_TYPES, LlamaConfig, ModelConfig, RopeScaling
from .formats.safetensors import Checkpoint, SafetensorsFile
from .rope import Rope
from .source import open_checkpoint
from .stage.kv_cache import KVBudget, KVCache
from .stage.prefix_store import BlockNaming
from .stage.runner import StageRunner
from .stage.weights import WEIGHT_DTYPES, StageWeights, parse_layers

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "WEIGHT_DTYPES",
    "BlockNaming",
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
