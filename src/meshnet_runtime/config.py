"""Command-line flags and ``MESHNET_*`` environment fallbacks (wire-2 §9).

One parser for both roles: every server takes the common flags, a node adds
``--next/--backend/--delay-ms``, the gateway ``--entry/--chunk-tokens/--inflight``.
Precedence is flag > environment > default. An environment value goes through
the same validation as the flag, and a bad one names the variable.

One source of truth: a default is written once, where it is used — the
core's ``Limits`` for what the core enforces, the serving loop's
``ServerSettings`` for its timeouts and caps. ``ServerConfig`` takes its
defaults from those two, the flag table (and so ``--help`` and the
environment) from ``ServerConfig``, and ``/info`` shows
``ServerConfig.limits_info()``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from meshnet_proto import Limits

from .endpoints import Endpoint, parse_endpoint
from .http_server import ServerSettings
from .memory import parse_bytes_or_auto

__all__ = [
    "ServerConfig",
    "build_parser",
    "env_name",
    "load_config",
    "positive_int",
    "positive_seconds",
]

Role = Literal["node", "gateway"]

WIRE_DTYPES = ("keep", "float32", "bfloat16", "float16", "auto-lossless")
ENCODINGS = ("mirror", "identity", "zstd", "auto")
BACKENDS = ("echo", "zeros", "count")
# "auto": the engine's own default (numpy: float32; torch: keep, which holds a
# quantized GGUF file quantized). See meshnet_model.engines.choice.
MODEL_DTYPES = ("auto", "keep", "float32", "bfloat16", "float16")
# "auto": torch for a GGUF file when torch is installed, else numpy.
ENGINES = ("auto", "numpy", "torch")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# What the gateway does with special-token text (e.g. "<|im_start|>") inside
# chat message content: docs/security.md argues the default.
SPECIAL_TOKEN_POLICIES = ("escape", "refuse", "keep")

_LIMITS = Limits()  # the core's defaults
_SETTINGS = ServerSettings()  # the serving loop's defaults


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """Validated settings of one node or gateway."""

    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    uds: str | None = None
    timeout: float = _SETTINGS.body_timeout
    max_sessions: int = _LIMITS.max_sessions
    # None: half of max_sessions (the core's rule, Limits); 0: no quota.
    max_sessions_per_client: int | None = None
    session_ttl: float = _LIMITS.session_ttl
    reorder_window: int = _LIMITS.reorder_window
    reorder_timeout: float = _LIMITS.reorder_timeout
    head_timeout: float = _SETTINGS.head_timeout
    max_tensor_bytes: int = _LIMITS.max_tensor_bytes
    max_stored_bytes: int = _LIMITS.max_stored_bytes
    max_inflight_bytes: int = _LIMITS.max_inflight_bytes
    max_connections: int = _SETTINGS.max_connections
    shutdown_timeout: float = _SETTINGS.shutdown_timeout
    token: str | None = field(default=None, repr=False)  # never logged
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    log_level: str = "info"
    wire_dtype: str = "keep"
    encoding: str = "mirror"
    zstd_level: int = 1
    async_backend: str = "trio"
    # replica sets (docs/failover.md): --next/--entry may name several URLs
    # or a host name whose every address is a replica.
    health_interval: float = 2.0  # seconds between health probes of a replica
    probe_timeout: float = 2.0  # a probe unanswered this long marks a replica down
    max_history_bytes: int = 256 * 1024 * 1024  # what a hop keeps to replay, all sessions
    # node
    next: Endpoint | None = None
    next_replicas: tuple[Endpoint, ...] = ()  # every URL of --next (``next`` is the first)
    backend: str = "echo"
    delay_ms: float = 0.0
    # node: a checkpoint directory whose layers to run instead of --backend;
    # gateway: the checkpoint whose tokenizer it loads to serve the OpenAI API.
    model: str | None = None
    layers: str | None = None  # "A:B", checked against the model when it loads
    dtype: str = "auto"  # weights as held in memory (numpy computes in float32, torch in it)
    engine: str = "auto"  # what computes the layers: numpy (the reference) or torch
    device: str = "cpu"  # torch engine: cpu, cuda or cuda:N
    threads: int | None = None  # compute threads of the stage (None: the library's default)
    kv_budget_bytes: int | str = "auto"  # bytes, or auto: up to 1 GiB of what the stage leaves
    memory_limit: int | str = "auto"  # bytes the node may use; auto: cgroup and MemAvailable
    max_chunk_tokens: int = 2048  # rows (batch x tokens) of one chunk a model stage takes
    max_compute_bytes: int = 1024 * 1024 * 1024  # scratch of one chunk's forward pass
    max_batch_tokens: int = 256  # rows of one batched step, all sessions (meshnet_node.scheduler)
    max_queued_tokens: int = 32768  # rows waiting for compute before more get 503 stage_busy
    micro_batches: int = 0  # decode groups in flight along the chain; 0: auto (its stage count)
    # gateway
    entry: Endpoint | None = None
    entry_replicas: tuple[Endpoint, ...] = ()  # every URL of --entry
    chunk_tokens: int = 128
    inflight: int = 1
    model_name: str | None = None  # the id /v1/models shows (default: the directory's name)
    max_tokens_default: int = 256  # completion length when a request names none
    max_context: int = 0  # 0: the checkpoint's max_position_embeddings
    retries: int = 2
    retry_backoff_ms: float = 50.0
    max_prompt_chars: int = 0  # 0: 32 characters per token of context
    special_tokens_in_content: str = "escape"
    # gateway admission (issue 19, docs/openai-api.md#admission): budgets a
    # /v1 generation must fit before any chunk is sent; more wait (FIFO) or
    # get 429/503 + Retry-After. 128 running: the bench's 64 concurrent
    # decode streams run at once, with room. 4096 prefill tokens: a few
    # prompts' worth, seconds of prefill on a CPU chain, so no chunk waits at
    # a node anywhere near its --reorder-timeout. 128 queued: with 128
    # running, the 256 connections (--max-connections) the server takes.
    # 120 s in the queue: 16 prompts of 1,200 tokens on a 2-node CPU chain
    # (~200 prompt tokens/s) are ~100 s of prefill, and the last must not time out.
    max_running: int = 128
    max_prefill_tokens: int = 4096
    max_queued: int = 128
    queue_timeout: float = 120.0

    # The core's limits, built (and so validated) once, with the config.
    limits: Limits = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = Limits(
            max_tensor_bytes=self.max_tensor_bytes,
            max_stored_bytes=self.max_stored_bytes,
            max_inflight_bytes=self.max_inflight_bytes,
            max_sessions=self.max_sessions,
            max_sessions_per_client=self.max_sessions_per_client,
            session_ttl=self.session_ttl,
            reorder_window=self.reorder_window,
            reorder_timeout=self.reorder_timeout,
        )
        object.__setattr__(self, "limits", limits)

    def limits_info(self) -> dict[str, Any]:
        """Every limit this server enforces, by name: the core's and the loop's (``/info``)."""
        return {
            **self.limits.to_dict(),
            "timeout": self.timeout,
            "head_timeout": self.head_timeout,
            "max_connections": self.max_connections,
        }

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def env_name(flag: str) -> str:
    """``--chunk-tokens`` → ``MESHNET_CHUNK_TOKENS``."""
    return "MESHNET_" + flag.lstrip("-").upper().replace("-", "_")


def positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


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


def _micro_batches(text: str) -> int:
    """``auto`` (0: the chain's stage count, from the node's layer share) or 1..1024."""
    if text == "auto":
        return 0
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_MICRO_BATCHES:
        raise argparse.ArgumentTypeError(f"expected auto or 1..{MAX_MICRO_BATCHES}, got {text!r}")
    return int(text)


def _nonnegative_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0-65535, got {text!r}")
    return int(text)


def _level(text: str) -> int:
    # zstd's own range; negative levels are its "fast" modes.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not -7 <= value <= 22:
        raise argparse.ArgumentTypeError(f"zstd level must be -7..22, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _millis(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0, got {text!r}")
    return value


def _endpoint(text: str) -> Endpoint:
    try:
        return parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _endpoints(text: str) -> tuple[Endpoint, ...]:
    """``URL[,URL...]``: one hop's replica set."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"an empty URL in {text[:200]!r}")
    return tuple(_endpoint(part) for part in parts)


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


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


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {text!r} (choose from {', '.join(choices)})"
            )
        return text

    parse.choices = tuple(choices)  # type: ignore[attr-defined]  # shown by --help
    return parse


# (flag, type, help). The default is ServerConfig's field of the flag's name.
_Flag = tuple[str, Callable[[str], Any], str]

_COMMON: list[_Flag] = [
    ("--host", _nonempty, "address to listen on"),
    ("--port", _port, "TCP port (0 = a free one, shown in the ready line)"),
    ("--uds", _nonempty, "listen on this Unix socket path instead of TCP"),
    ("--timeout", positive_seconds, "budget of one request, seconds"),
    ("--max-sessions", positive_int, "sessions held at once"),
    (
        "--max-sessions-per-client",
        _nonnegative_int,
        "sessions one client address may hold (None: half of --max-sessions; 0: no quota)",
    ),
    ("--session-ttl", positive_seconds, "idle seconds before a session is forgotten"),
    ("--reorder-window", positive_int, "chunks a session may run ahead"),
    ("--reorder-timeout", positive_seconds, "seconds a chunk waits for its predecessor"),
    ("--head-timeout", positive_seconds, "seconds a client has to send its request head"),
    ("--max-tensor-bytes", positive_int, "largest tensor accepted"),
    ("--max-stored-bytes", positive_int, "answers kept for replay, all sessions together"),
    (
        "--max-inflight-bytes",
        positive_int,
        "tensor bytes held for requests in flight, all together (more get 503)",
    ),
    ("--max-connections", positive_int, "concurrent connections (more get 503)"),
    ("--shutdown-timeout", positive_seconds, "seconds in-flight requests get on shutdown"),
    ("--token", _nonempty, "require 'Authorization: Bearer TOKEN' (and present it)"),
    ("--tls-cert", _nonempty, "serve TLS with this PEM certificate chain"),
    ("--tls-key", _nonempty, "... and this PEM private key"),
    ("--tls-ca", _nonempty, "verify an https downstream with this CA bundle"),
    ("--log-level", _choice(LOG_LEVELS), "logging level"),
    ("--wire-dtype", _choice(WIRE_DTYPES), "dtype of tensors this server sends"),
    ("--encoding", _choice(ENCODINGS), "encoding of bodies this server sends"),
    ("--zstd-level", _level, "zstd compression level"),
    ("--async-backend", _choice(("trio", "asyncio")), "event loop to run on"),
    ("--health-interval", positive_seconds, "seconds between health probes of each replica"),
    ("--probe-timeout", positive_seconds, "a replica not answering a probe this long is down"),
    ("--max-history-bytes", positive_int, "chunks kept per hop to replay on failover, in all"),
]
_NODE: list[_Flag] = [
    ("--next", _endpoints, "downstream node URL(s), comma-separated replicas (none = last stage)"),
    ("--backend", _choice(BACKENDS), "stage backend"),
    ("--delay-ms", _millis, "simulated stage compute per chunk, ms"),
    ("--model", _nonempty, "checkpoint directory (HF layout): run its layers, not --backend"),
    ("--layers", _layers, "with --model: run layers A..B-1, as A:B (default: all)"),
    ("--dtype", _choice(MODEL_DTYPES), "with --model: weights dtype in memory"),
    ("--engine", _choice(ENGINES), "with --model: numpy, torch, or auto (torch for GGUF)"),
    ("--device", _device, "with --engine torch: cpu, cuda or cuda:N"),
    ("--threads", threads_count, "with --model: compute threads (BLAS or torch) of this stage"),
    (
        "--kv-budget-bytes",
        parse_bytes_or_auto,
        "with --model: KV cache memory, all sessions together (more get 503); auto: "
        "up to 1GiB of what the limit leaves",
    ),
    (
        "--memory-limit",
        parse_bytes_or_auto,
        "with --model: memory the node may use, e.g. 4GiB (auto: the cgroup's limit "
        "and MemAvailable); a stage that needs more exits 2 before loading",
    ),
    (
        "--max-chunk-tokens",
        positive_int,
        "with --model: token rows (batch x tokens) of one chunk (more get 413)",
    ),
    (
        "--max-compute-bytes",
        positive_int,
        "with --model: scratch memory one chunk's compute may need (more get 413)",
    ),
    (
        "--max-batch-tokens",
        positive_int,
        "with --model: token rows one batched step computes, all sessions together",
    ),
    (
        "--max-queued-tokens",
        positive_int,
        "with --model: token rows waiting for compute before more get 503 stage_busy",
    ),
    (
        "--micro-batches",
        _micro_batches,
        "with --model: groups the decoding sessions are stepped in, so every stage of a "
        "chain computes at once (auto: the chain's stage count, from this node's layers)",
    ),
]
_GATEWAY: list[_Flag] = [
    ("--entry", _endpoints, "URL(s) of the first node's replicas, comma-separated (required)"),
    ("--chunk-tokens", positive_int, "tokens per chunk"),
    ("--inflight", positive_int, "chunks in flight per session"),
    ("--model", _nonempty, "checkpoint directory: serve the OpenAI API (/v1) for it"),
    ("--model-name", _nonempty, "model id in the OpenAI API (default: directory name)"),
    ("--max-tokens-default", positive_int, "completion tokens when a request names none"),
    ("--max-context", _nonnegative_int, "context length (0: the checkpoint's config.json)"),
    ("--retries", _nonnegative_int, "extra attempts of a chunk whose connection or hop failed"),
    ("--retry-backoff-ms", _millis, "first retry's backoff, ms (doubles per retry)"),
    (
        "--max-prompt-chars",
        _nonnegative_int,
        "characters of a prompt or conversation, checked before tokenizing "
        "(0: 32 per token of context)",
    ),
    (
        "--special-tokens-in-content",
        _choice(SPECIAL_TOKEN_POLICIES),
        "special-token text in chat content: escape (plain text), refuse (400) or keep",
    ),
    ("--max-running", positive_int, "/v1 generations admitted at once (more wait in the queue)"),
    (
        "--max-prefill-tokens",
        positive_int,
        "prompt tokens of admitted /v1 generations still prefilling (a larger prompt goes alone)",
    ),
    ("--max-queued", _nonnegative_int, "/v1 requests waiting for admission (more get 429)"),
    ("--queue-timeout", positive_seconds, "seconds a /v1 request may wait in the queue (then 503)"),
]


def _flags(role: Role) -> list[_Flag]:
    return _COMMON + (_NODE if role == "node" else _GATEWAY)


def build_parser(role: Role, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``meshnet-<role>``; defaults are applied later, by :func:`load_config`."""
    parser = argparse.ArgumentParser(
        prog=prog or f"meshnet-{role}",
        description=f"meshnet wire-2 {role}. Every flag can also be set as MESHNET_<FLAG>.",
    )
    for flag, kind, help_text in _flags(role):
        choices = getattr(kind, "choices", None)
        # SUPPRESS: an absent flag stays absent, so the environment can fill it.
        parser.add_argument(
            flag,
            type=kind,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else None,
            help=f"{help_text} [env {env_name(flag)}, default {_DEFAULTS[_dest(flag)]}]",
        )
    return parser


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in fields(ServerConfig) if f.default is not MISSING
}


def _check_engine(parser: argparse.ArgumentParser, values: dict[str, Any]) -> None:
    # Only torch computes elsewhere than the CPU; engine flags need a model.
    if values["engine"] == "numpy" and values["device"] != "cpu":
        parser.error(f"--device {values['device']} needs --engine torch (numpy runs on the CPU)")
    if values["model"] is None and values["engine"] == "torch":
        parser.error("--engine torch needs --model")


def load_config(
    role: Role,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Parse ``argv`` with ``environ`` fallbacks; exits (status 2) on a bad value."""
    parser = build_parser(role)
    env = os.environ if environ is None else environ
    given = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    for flag, kind, _ in _flags(role):
        dest = _dest(flag)
        if dest in given:
            values[dest] = given[dest]
        elif env_name(flag) in env:
            try:
                values[dest] = kind(env[env_name(flag)])
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{env_name(flag)}: {exc}")
        else:
            values[dest] = _DEFAULTS[dest]
    for hop in ("next", "entry"):
        if isinstance(values.get(hop), tuple):  # parsed: the first URL plus the whole set
            values[f"{hop}_replicas"] = values[hop]
            values[hop] = values[hop][0]
    if (values["tls_cert"] is None) != (values["tls_key"] is None):
        parser.error("--tls-cert and --tls-key go together")
    if role == "node" and values["model"] is None and values["layers"] is not None:
        parser.error("--layers needs --model")
    if role == "node":
        _check_engine(parser, values)
    if role == "gateway" and values["entry"] is None:
        parser.error(f"--entry (or {env_name('--entry')}) is required")
    try:
        config = ServerConfig(role=role, **values)  # builds and validates its Limits
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    return config
