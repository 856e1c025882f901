"""``meshnet run``'s flags: its own (``--model``, ``--stages``, ``--split``) and
those of its nodes and gateway that make sense on one machine.

The servers' flags are not written again here: they are picked by name from
the one flag tables (``NodeConfig.flags()``, ``GatewayConfig.flags()``), so
their parsers, help, environment variables and defaults are the servers'
own. ``meshnet run`` keeps each value's text (validated by the flag's own
parser) and hands it to the nodes' and the gateway's configs, which read it
as ``meshnet-node`` and ``meshnet-gateway`` would. Kept light: ``meshnet
--help`` imports this, not the servers.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from meshnet_gateway.config import GatewayConfig
from meshnet_node.config import NodeConfig
from meshnet_runtime.config import Flag, add_flags, positive_int

if TYPE_CHECKING:
    from meshnet_runtime.config import OneLineParser

    _Commands = argparse._SubParsersAction[OneLineParser]

__all__ = [
    "BOTH",
    "GATEWAY_ONLY",
    "NODE_ONLY",
    "RUN_DEFAULTS",
    "add_parser",
    "flag_table",
    "forwarded",
    "parse_split",
    "resolve",
    "typed",
]

# The nodes' own: how a stage holds and computes its layers.
NODE_ONLY = (
    "--dtype",
    "--engine",
    "--device",
    "--threads",
    "--kv-budget-bytes",
    "--memory-limit",
    "--max-chunk-tokens",
    "--max-compute-bytes",
    "--max-batch-tokens",
    "--max-queued-tokens",
    "--micro-batches",
)
# The gateway's own, and its listener: the one port a user talks to.
GATEWAY_ONLY = (
    "--host",
    "--port",
    "--tls-cert",
    "--tls-key",
    "--chunk-tokens",
    "--inflight",
    "--model-name",
    "--max-tokens-default",
    "--max-context",
    "--max-prompt-chars",
    "--special-tokens-in-content",
    "--max-running",
    "--max-prefill-tokens",
    "--max-queued",
    "--queue-timeout",
    "--allowed-hosts",
    "--allowed-origins",
    "--api-keys",
    "--max-messages",
    "--speculate",
    "--speculate-max-draft",
    "--speculate-windows",
    "--draft-model",
)
# Every server's: access, limits, shutdown, logging — given to the gateway and
# every node alike (a --token is required and presented on every hop).
BOTH = (
    "--token",
    "--accept-token",
    "--timeout",
    "--head-timeout",
    "--max-sessions",
    "--max-sessions-per-client",
    "--session-ttl",
    "--max-tensor-bytes",
    "--max-inflight-bytes",
    "--max-connections",
    "--shutdown-timeout",
    "--log-level",
    "--async-backend",
)

# A `meshnet run` chain lives in one process: when it shuts down no other
# replica can take its sessions over, so its nodes keep none for a KV
# hand-off (a node's default waits up to 10 s for one after SIGTERM).
RUN_NODE_FIXED = ("--handoff-window", "0")

# Where one machine's run differs from a server's default: the port people
# expect of a local OpenAI server, chunks in flight for pipelined prefill,
# and a quiet log (the ready line says what matters).
RUN_DEFAULTS: dict[str, Any] = {"port": 8000, "inflight": 4, "log_level": "info"}

_HELPS = {
    "--host": "gateway address",
    "--port": "gateway TCP port (0 = a free one, shown in the ready line)",
    "--threads": "most compute threads of a node (default: torch on the CPU, every core, "
    "shared by which stage is busy; numpy, the cores split between the stages)",
    "--kv-budget-bytes": "KV cache per node, e.g. 256MiB (auto: up to 1GiB of what is left)",
    "--memory-limit": "memory all the nodes together may use, e.g. 8GiB (auto: the cgroup's "
    "limit and MemAvailable); more needed exits 2 before loading",
    "--token": "require 'Authorization: Bearer TOKEN' at the gateway and every node",
}


def flag_table() -> dict[str, Flag]:
    """Every flag ``meshnet run`` forwards, by name, from the servers' tables."""
    table = {flag.name: flag for flag in GatewayConfig.flags()}
    table.update((flag.name, flag) for flag in NodeConfig.flags() if flag.name in NODE_ONLY)
    return {name: table[name] for name in (*GATEWAY_ONLY, *BOTH, *NODE_ONLY)}


def _defaults() -> dict[str, Any]:
    return {**NodeConfig.defaults(), **GatewayConfig.defaults(), **RUN_DEFAULTS}


def _keep_text(kind: Callable[[str], Any]) -> Callable[[str], str]:
    """Validate with the flag's own parser, keep the text to forward."""

    def parse(text: str) -> str:
        kind(text)
        return text

    return parse


def parse_split(text: str) -> list[tuple[int, int]]:
    """``A:B,B:C,...`` as ranges; that they cover the model is checked against it."""
    ranges: list[tuple[int, int]] = []
    for part in text.split(","):
        start, sep, end = part.strip().partition(":")
        if not (sep and start.isascii() and start.isdigit() and end.isascii() and end.isdigit()):
            raise argparse.ArgumentTypeError(
                f"expected layer ranges A:B,B:C,... (e.g. 0:10,10:30), got {text!r}"
            )
        ranges.append((int(start), int(end)))
    return ranges


def add_parser(commands: _Commands) -> None:
    """``meshnet run``'s parser, on ``meshnet``'s subcommands."""
    run = commands.add_parser(
        "run",
        help="serve a GGUF file or checkpoint split over N model nodes with a gateway, "
        "in this process",
        description="Start N model nodes (an even split of the layers, or --split) and a "
        "gateway with the OpenAI API on one machine, in one process; prints a ready line "
        "with the URL, then each node's URL and layers. Ctrl-C (SIGINT) or SIGTERM drains "
        "for --shutdown-timeout seconds, a second one quits at once (exit 130). The "
        "servers' flags below are meshnet-node's and meshnet-gateway's own; each also "
        "reads MESHNET_<FLAG>.",
    )
    run.add_argument(
        "--model",
        required=True,
        help="a GGUF file (.gguf) or a checkpoint directory (HF layout: config.json, "
        "*.safetensors, tokenizer)",
    )
    run.add_argument("--stages", type=positive_int, default=None, help="nodes, an even split [2]")
    run.add_argument(
        "--split",
        type=parse_split,
        default=None,
        metavar="A:B,B:C,...",
        help="each node's layers, entry first, e.g. 0:10,10:30: contiguous from 0 to the "
        "model's last layer, none empty [an even split over --stages]",
    )
    servers = run.add_argument_group("the nodes' and the gateway's flags")
    add_flags(
        servers,
        tuple(flag_table().values()),
        _defaults(),
        kind=lambda flag: _keep_text(flag.kind),
        helps=_HELPS,
    )


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Fill each absent server flag from its ``MESHNET_*`` variable (validated by
    the flag's parser: ``ValueError`` naming the variable), as the servers do."""
    env = os.environ if environ is None else environ
    for flag in flag_table().values():
        if flag.dest not in vars(args) and flag.env in env:
            try:
                flag.kind(env[flag.env])
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"{flag.env}: {exc}") from None
            setattr(args, flag.dest, env[flag.env])


def typed(args: argparse.Namespace, name: str) -> Any:
    """A server flag's value as the server reads it: given, else the default."""
    flag = flag_table()[name]
    text = getattr(args, flag.dest, None)
    return flag.kind(text) if text is not None else _defaults()[flag.dest]


def forwarded(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The argv of ``names`` given (or run's own defaults), for a server's config."""
    argv: list[str] = []
    for name in names:
        dest = name.lstrip("-").replace("-", "_")
        text = getattr(args, dest, None)
        if text is None and dest in RUN_DEFAULTS:
            text = str(RUN_DEFAULTS[dest])
        if text is not None:
            argv += [name, text]
    return argv
