"""One pipeline stage, engine-independent: ``weights`` (a layer range's tensors),
``kv_cache`` (per-session caches under one budget), ``costs`` (a chunk's scratch,
from its shape), ``life`` (a session's cache, prefix bookkeeping and rewind)
and ``runner`` (``StageRunner``: the stage's contract, sessions and locking).
The engines build on it; it imports none at module level."""
