"""The node's flags: the common ones (``meshnet_runtime.config``) and a stage's own.

``--next`` (the downstream hop, a replica set), ``--backend``/``--delay-ms``
(a test stage) or ``--model`` and its engine, memory and batching flags (a
model stage). ``NodeConfig`` is their one source: its fields are the
defaults, ``NODE_FLAGS`` names them, and so ``meshnet-node --help``, the
``MESHNET_*`` environment and ``/info`` all follow from it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from meshnet_runtime.config import (
    Flag,
    ServerConfig,
    choice,
    endpoint_list,
    millis,
    nonempty,
    positive_int,
    positive_seconds,
    seconds_or_zero,
    split_replicas,
)
from meshnet_runtime.endpoints import Endpoint
from meshnet_runtime.memory import parse_bytes_or_auto

from .backends import BACKENDS

__all__ = [
    "ENGINES",
    "MAX_MICRO_BATCHES",
    "MAX_THREADS",
    "MODEL_DTYPES",
    "NODE_FLAGS",
    "NodeConfig",
    "micro_batches",
    "threads_count",
]

# "auto": the engine's own default (numpy: float32; torch: keep, which holds a
# quantized GGUF file quantized). See meshnet_model.engines.choice.
MODEL_DTYPES = ("auto", "keep", "float32", "bfloat16", "float16")
# "auto": torch for a GGUF file when torch is installed, else numpy.
ENGINES = ("auto", "numpy", "torch")

# Compute threads a stage may ask for: far above any machine's cores, far
# below what overflows the C int that BLAS and torch take.
MAX_THREADS = 4096


def threads_count(text: str) -> int:
    count = positive_int(text)
    if count > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected 1..{MAX_THREADS} threads, got {text!r}")
    return count


# Decode groups a stage may split its sessions into: one per stage of a chain.
MAX_MICRO_BATCHES = 1024


def micro_batches(text: str) -> int:
    """``auto`` (0: the chain's stage count, from the node's layer share) or 1..1024."""
    if text == "auto":
        return 0
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_MICRO_BATCHES:
        raise argparse.ArgumentTypeError(f"expected auto or 1..{MAX_MICRO_BATCHES}, got {text!r}")
    return int(text)


def _layers(text: str) -> str:
    start, sep, end = text.partition(":")
    if not (sep and start.isascii() and start.isdigit() and end.isascii() and end.isdigit()):
        raise argparse.ArgumentTypeError(f"expected A:B (layers A..B-1), got {text!r}")
    if int(start) >= int(end):
        raise argparse.ArgumentTypeError(f"layers {text}: the start must be below the end")
    return text


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]{0,2}))?", text):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


_CHAIN = (
    Flag(
        "--next",
        endpoint_list,
        "downstream node URL(s), comma-separated replicas (none = last stage)",
    ),
    Flag("--backend", choice(tuple(BACKENDS)), "stage backend"),
    Flag("--delay-ms", millis, "simulated stage compute per chunk, ms"),
)
_MODEL = (
    Flag("--model", nonempty, "checkpoint directory (HF layout): run its layers, not --backend"),
    Flag("--layers", _layers, "with --model: run layers A..B-1, as A:B (default: all)"),
    Flag("--dtype", choice(MODEL_DTYPES), "with --model: weights dtype in memory"),
    Flag("--engine", choice(ENGINES), "with --model: numpy, torch, or auto (torch for GGUF)"),
    Flag("--device", _device, "with --engine torch: cpu, cuda or cuda:N"),
    Flag("--threads", threads_count, "with --model: compute threads (BLAS or torch) of this stage"),
    Flag(
        "--share-cores-with",
        nonempty,
        "with --model, torch on the CPU: a file the stages of this machine share; each "
        "step takes the cores free among the busy stages, at most --threads",
    ),
    Flag(
        "--weights-cache",
        nonempty,
        "with --model, torch quantized: directory keeping the repacked weights for the "
        "next start (auto: $XDG_CACHE_HOME/meshnet/weights; off: none)",
    ),
)


def _bytes_zero_or_auto(text: str) -> int | str:
    """``--prefix-cache-bytes``: bytes as ``--kv-budget-bytes`` takes them, or 0 (none)."""
    return 0 if text.strip() == "0" else parse_bytes_or_auto(text)


_MEMORY = (
    Flag(
        "--kv-budget-bytes",
        parse_bytes_or_auto,
        "with --model: KV cache memory, all sessions together (more get 503); auto: "
        "up to 1GiB of what the limit leaves",
    ),
    Flag(
        "--memory-limit",
        parse_bytes_or_auto,
        "with --model: memory the node may use, e.g. 4GiB (auto: the cgroup's limit "
        "and MemAvailable); a stage that needs more exits 2 before loading",
    ),
    Flag(
        "--max-chunk-tokens",
        positive_int,
        "with --model: token rows (batch x tokens) of one chunk (more get 413)",
    ),
    Flag(
        "--max-compute-bytes",
        positive_int,
        "with --model: scratch memory one chunk's compute may need (more get 413)",
    ),
    Flag(
        "--prefix-cache-bytes",
        _bytes_zero_or_auto,
        "with --model: KV of ended sessions kept for the prefix cache, within the KV "
        "budget and given up for live sessions (auto: half the budget; 0: none)",
    ),
)
_BATCHING = (
    Flag(
        "--max-batch-tokens",
        positive_int,
        "with --model: token rows one batched step computes, all sessions together",
    ),
    Flag(
        "--max-queued-tokens",
        positive_int,
        "with --model: token rows waiting for compute before more get 503 stage_busy",
    ),
    Flag(
        "--micro-batches",
        micro_batches,
        "with --model: groups the decoding sessions are stepped in, so every stage of a "
        "chain computes at once (auto: the chain's stage count, from this node's layers)",
    ),
)
KV_ROLES = ("any", "prefill", "decode")


_HANDOFF = (
    Flag(
        "--kv-role",
        choice(KV_ROLES),
        "with --model and replicas: the work this replica takes (wire-2 §3.12): prefill "
        "(prompts), decode (one token at a time, sessions handed over by KV), or any",
    ),
    Flag(
        "--handoff-window",
        seconds_or_zero,
        "when shutting down: seconds the node keeps its sessions for a KV hand-off to "
        "another replica, after its requests in flight (within --shutdown-timeout; 0: none)",
    ),
    Flag(
        "--kv-import-timeout",
        positive_seconds,
        "seconds a KV import's body has, from its head, while its bytes are set aside "
        "(later: 408; wire-2 §3.11)",
    ),
    Flag(
        "--max-kv-transfers",
        positive_int,
        "KV imports and exports open at once, all peers together (more get 503 kv_transfers_full)",
    ),
    Flag(
        "--max-kv-transfers-per-peer",
        positive_int,
        "KV imports and exports one peer address may have open at once (more get 503 "
        "kv_transfers_full)",
    ),
)
NODE_FLAGS: tuple[Flag, ...] = _CHAIN + _MODEL + _MEMORY + _BATCHING + _HANDOFF


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig(ServerConfig):
    """Validated settings of one node: ``NodeConfig.load(argv, environ)``."""

    role: ClassVar[str] = "node"
    ROLE_FLAGS: ClassVar[tuple[Flag, ...]] = NODE_FLAGS

    next: Endpoint | None = None
    next_replicas: tuple[Endpoint, ...] = ()  # every URL of --next (``next`` is the first)
    backend: str = "echo"
    delay_ms: float = 0.0
    # a checkpoint directory (or .gguf file) whose layers to run instead of --backend
    model: str | None = None
    layers: str | None = None  # "A:B", checked against the model when it loads
    dtype: str = "auto"  # weights as held in memory (numpy computes in float32, torch in it)
    engine: str = "auto"  # what computes the layers: numpy (the reference) or torch
    device: str = "cpu"  # torch engine: cpu, cuda or cuda:N
    threads: int | None = None  # compute threads of the stage (None: the library's default)
    share_cores_with: str | None = None  # a core ledger file (engines.core_ledger); None: none
    # torch quantized: where the repacked weights are kept (docs/models.md "Start time")
    weights_cache: str = "auto"
    prefix_cache_bytes: int | str = "auto"  # auto: half of the KV budget
    kv_budget_bytes: int | str = "auto"  # bytes, or auto: up to 1 GiB of what the stage leaves
    memory_limit: int | str = "auto"  # bytes the node may use; auto: cgroup and MemAvailable
    max_chunk_tokens: int = 2048  # rows (batch x tokens) of one chunk a model stage takes
    max_compute_bytes: int = 1024 * 1024 * 1024  # scratch of one chunk's forward pass
    max_batch_tokens: int = 256  # rows of one batched step, all sessions (meshnet_node.scheduler)
    max_queued_tokens: int = 32768  # rows waiting for compute before more get 503 stage_busy
    micro_batches: int = 0  # decode groups in flight along the chain; 0: auto (its stage count)
    kv_role: str = "any"  # wire-2 §3.12: prefill, decode or any (in /info's handoff object)
    handoff_window: float = 10.0  # a drain keeps sessions for export this long (wire-2 §3.11)
    # What a KV move may hold (docs/security.md, KV moves): an import's body
    # comes within this many seconds of its head, and moves open at once are
    # bounded per peer address and in all.
    kv_import_timeout: float = 10.0
    max_kv_transfers: int = 4
    max_kv_transfers_per_peer: int = 2

    @classmethod
    def check_role(cls, values: dict[str, Any], error: Callable[[str], NoReturn]) -> None:
        split_replicas(values, "next")
        if values["model"] is None and values["layers"] is not None:
            error("--layers needs --model")
        # Only torch computes elsewhere than the CPU; engine flags need a model.
        if values["engine"] == "numpy" and values["device"] != "cpu":
            error(f"--device {values['device']} needs --engine torch (numpy runs on the CPU)")
        if values["model"] is None and values["engine"] == "torch":
            error("--engine torch needs --model")
