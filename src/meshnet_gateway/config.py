"""The gateway's flags: the common ones (``meshnet_runtime.config``) and its own.

``--entry`` (the first hop, a replica set), chunking and retries, the OpenAI
API's model and prompt limits, and admission to ``/v1`` generations.
``GatewayConfig`` is their one source: its fields are the defaults,
``GATEWAY_FLAGS`` names them, and so ``meshnet-gateway --help``, the
``MESHNET_*`` environment and ``/info`` all follow from it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from meshnet_proto.lowlevel import Credentials
from meshnet_runtime.config import (
    Flag,
    ServerConfig,
    choice,
    endpoint_list,
    env_name,
    millis,
    nonempty,
    nonnegative_int,
    positive_int,
    positive_seconds,
    split_replicas,
)
from meshnet_runtime.credentials import ApiKeyFile, KeyFileError
from meshnet_runtime.endpoints import Endpoint

from .browser import host_list, origin_list

__all__ = ["GATEWAY_FLAGS", "SPECIAL_TOKEN_POLICIES", "SPECULATE_MODES", "GatewayConfig", "int_in"]

# What the gateway does with special-token text (e.g. "<|im_start|>") inside
# chat message content: docs/security.md argues the default.
SPECIAL_TOKEN_POLICIES = ("escape", "refuse", "keep")

_CHAIN = (
    Flag(
        "--entry", endpoint_list, "URL(s) of the first node's replicas, comma-separated (required)"
    ),
    Flag("--chunk-tokens", positive_int, "tokens per chunk"),
    Flag("--inflight", positive_int, "chunks in flight per session"),
)
_MODEL = (
    Flag("--model", nonempty, "checkpoint directory: serve the OpenAI API (/v1) for it"),
    Flag("--model-name", nonempty, "model id in the OpenAI API (default: directory name)"),
    Flag("--max-tokens-default", positive_int, "completion tokens when a request names none"),
    Flag("--max-context", nonnegative_int, "context length (0: the checkpoint's config.json)"),
)
_RETRIES = (
    Flag("--retries", nonnegative_int, "extra attempts of a chunk whose connection or hop failed"),
    Flag("--retry-backoff-ms", millis, "first retry's backoff, ms (doubles per retry)"),
)
_PROMPTS = (
    Flag(
        "--max-prompt-chars",
        nonnegative_int,
        "characters of a prompt or conversation, checked before tokenizing "
        "(0: 32 per token of context)",
    ),
    Flag("--max-messages", positive_int, "messages of one chat, counted before any is rendered"),
    Flag(
        "--special-tokens-in-content",
        choice(SPECIAL_TOKEN_POLICIES),
        "special-token text in chat content: escape (plain text), refuse (400) or keep",
    ),
)
_ADMISSION = (
    Flag(
        "--max-running", positive_int, "/v1 generations admitted at once (more wait in the queue)"
    ),
    Flag(
        "--max-prefill-tokens",
        positive_int,
        "prompt tokens in flight on the chain at once, granted piece by piece (fair across "
        "clients; a larger piece goes alone)",
    ),
    Flag("--max-queued", nonnegative_int, "/v1 requests waiting for admission (more get 429)"),
    Flag(
        "--queue-timeout",
        positive_seconds,
        "seconds a /v1 request may wait in the queue (then 503)",
    ),
)


def check_api_keys(values: dict[str, Any], error: Callable[[str], NoReturn]) -> None:
    """``--api-keys`` needs the chain's token (which clients never hold)
    and a key file that can be used, both said at start in one line."""
    path = values.get("api_keys")
    if path is None:
        return
    if values.get("token") is None:
        error(
            "--api-keys: give the chain's token too (--token or MESHNET_TOKEN); "
            "clients hold API keys, the chain its token"
        )
    try:
        ApiKeyFile(path, Credentials())
    except KeyFileError as exc:
        error(f"--api-keys: {exc}")


def switch(text: str) -> bool:
    """An on/off flag's value: given bare (``--no-access-log``) it is on; a
    value (the flag's ``=VALUE`` or its ``MESHNET_*`` variable) says which."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false (1/0, yes/no, on/off), got {text!r}")


_LOGGING = (
    Flag("--no-access-log", switch, "do not log one line per request (meshnet.access, at info)"),
)
_CACHE = (
    Flag(
        "--no-prefix-cache",
        switch,
        "send no block keys: every prompt is computed whole (wire-2 §3.10)",
    ),
)
SAMPLE_SITES = ("last-stage", "gateway")


def one_url(text: str) -> str:
    """``--direct-return``'s value: one URL (the last stage, not a replica set)."""
    if len(endpoint_list(text)) != 1:
        raise argparse.ArgumentTypeError("one URL: the last stage as this gateway reaches it")
    return text.strip()


_SAMPLING = (
    Flag(
        "--sample-at",
        choice(SAMPLE_SITES),
        "where tokens are drawn: last-stage (it answers token ids, wire-2 §3.13) or "
        "gateway (the last stage's logits are relayed up every hop)",
    ),
    Flag(
        "--direct-return",
        one_url,
        "the last stage's URL as this gateway reaches it: each decode step's token is "
        "asked of it directly, not waited for back through every hop (wire-2 §3.14)",
    ),
)
SPECULATE_MODES = ("lookup", "off")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """A flag's integer in ``low..high``."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in {low}..{high}, got {text!r}")
        return int(text)

    return parse


_SPECULATION = (
    Flag(
        "--speculate",
        choice(SPECULATE_MODES),
        "speculative decoding: lookup (drafts from the prompt and output so far, verified "
        "several per trip at the last stage, wire-2 §3.16) or off (one token a trip)",
    ),
    Flag("--speculate-max-draft", int_in(1, 64), "most tokens drafted in one verify window"),
    Flag("--speculate-windows", int_in(1, 8), "verify windows of a generation in flight at once"),
    Flag(
        "--draft-model",
        nonempty,
        "a small model (.gguf) with --model's tokenizer, run here to draft the windows "
        "(default: prompt lookup, no model)",
    ),
)
_KEYS = (
    Flag(
        "--api-keys",
        nonempty,
        "file of clients' API keys (TENANT sha256:DIGEST [cache=GROUP] a line; re-read "
        "when it changes): /v1 and /forward then take these keys, never the chain's token",
    ),
)
_BROWSERS = (
    Flag(
        "--allowed-hosts",
        host_list,
        "Host names served beside localhost and IP literals, comma-separated ('*': any)",
    ),
    Flag(
        "--allowed-origins",
        origin_list,
        "browser origins (https://app.example.com) that may call the gateway ('*': any)",
    ),
)
GATEWAY_FLAGS: tuple[Flag, ...] = (
    _CHAIN
    + _MODEL
    + _RETRIES
    + _PROMPTS
    + _ADMISSION
    + _LOGGING
    + _CACHE
    + _SAMPLING
    + _SPECULATION
    + _BROWSERS
    + _KEYS
)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig(ServerConfig):
    """Validated settings of one gateway: ``GatewayConfig.load(argv, environ)``."""

    role: ClassVar[str] = "gateway"
    ROLE_FLAGS: ClassVar[tuple[Flag, ...]] = GATEWAY_FLAGS

    entry: Endpoint | None = None
    entry_replicas: tuple[Endpoint, ...] = ()  # every URL of --entry (``entry`` is the first)
    chunk_tokens: int = 128
    inflight: int = 1
    # the checkpoint whose tokenizer the gateway loads to serve the OpenAI API
    model: str | None = None
    model_name: str | None = None  # the id /v1/models shows (default: the directory's name)
    max_tokens_default: int = 256  # completion length when a request names none
    max_context: int = 0  # 0: the checkpoint's max_position_embeddings
    retries: int = 2
    retry_backoff_ms: float = 50.0
    max_prompt_chars: int = 0  # 0: 32 characters per token of context
    max_messages: int = 2048  # OpenAI's own bound on a chat's messages (issue 37)
    special_tokens_in_content: str = "escape"
    # admission (issue 19, docs/openai-api.md#admission): budgets a /v1
    # generation must fit before any chunk is sent; more wait (FIFO) or get
    # 429/503 + Retry-After. 128 running: the bench's 64 concurrent decode
    # streams run at once, with room. 4096 prefill tokens: a few prompts'
    # worth, seconds of prefill on a CPU chain, so no chunk waits at a node
    # anywhere near its --reorder-timeout. 128 queued: with 128 running, the
    # 256 connections (--max-connections) the server takes. 120 s in the
    # queue: 16 prompts of 1,200 tokens on a 2-node CPU chain (~200 prompt
    # tokens/s) are ~100 s of prefill, and the last must not time out.
    max_running: int = 128
    max_prefill_tokens: int = 4096
    max_queued: int = 128
    queue_timeout: float = 120.0
    # The access log (meshnet_gateway.access): one line per request, on by
    # default as uvicorn's and vLLM's are; an operator behind a proxy that
    # logs already turns it off.
    no_access_log: bool = False
    # The chain's prefix cache (wire-2 §3.10): block keys on every chunk, and
    # prompts started after the longest prefix the chain holds.
    no_prefix_cache: bool = False
    # Where a generation's tokens are drawn (wire-2 §3.13; SAMPLE_SITES).
    sample_at: str = "last-stage"
    # The last stage, polled for each decode step's token (wire-2 §3.14).
    direct_return: str | None = None
    # Speculative decoding (docs/openai-api.md#speculative-decoding): prompt
    # lookup drafts, verified at the last stage. 8 drafts: a copied passage
    # yields up to 9 tokens a trip, and a rejected window wastes at most 8
    # rows. 2 windows: the next one travels while the last stage verifies
    # this one, and a rejection throws away at most one window's work.
    speculate: str = "lookup"
    speculate_max_draft: int = 8
    speculate_windows: int = 2
    # A draft model run in the gateway (draft_model.py) instead of prompt
    # lookup: drafts where the prompt holds none, for its compute and memory.
    draft_model: str | None = None
    # Clients' API keys (docs/security.md): a file of digests, never the keys.
    api_keys: str | None = None
    # Web pages (browser.py, docs/openai-api.md#browsers-host-origin-cors): a
    # Host not served is 403 (DNS rebinding), so is an Origin not allowed.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    @classmethod
    def build_parser(cls, prog: str | None = None) -> argparse.ArgumentParser:
        """As every server's, and an on/off flag needs no value (``--no-access-log``)."""
        # (not bare super(): slots=True makes a new class, the closure keeps the old)
        parser = super(GatewayConfig, cls).build_parser(prog)
        for flag in cls.flags():
            if flag.kind is switch:
                action = parser._option_string_actions[flag.name]
                action.nargs, action.const, action.metavar = "?", "true", "BOOL"
        return parser

    @classmethod
    def check_role(cls, values: dict[str, Any], error: Callable[[str], NoReturn]) -> None:
        split_replicas(values, "entry")
        if values["entry"] is None:
            error(f"--entry (or {env_name('--entry')}) is required")
        check_api_keys(values, error)
