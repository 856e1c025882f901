"""``meshnet run``: a checkpoint split over N model nodes plus a gateway, one process.

The nodes listen on free loopback ports, each running an even share of the
layers (``--layers A:B``) and pointing at the next; the gateway listens on
``--host/--port`` with ``--model`` and serves the OpenAI API. One ready line
on stdout names the URL; SIGINT/SIGTERM shut everything down gracefully.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

from meshnet_gateway import open_gateway
from meshnet_gateway.app import GatewayApp
from meshnet_gateway.config import GatewayConfig
from meshnet_model.engines.choice import share_cores
from meshnet_model.engines.footprint import MemoryShortfall, fit_process
from meshnet_model.errors import CheckpointError, ConfigError
from meshnet_model.source import load_config as load_model_config
from meshnet_node.config import NodeConfig
from meshnet_node.model_chain import even_splits, start_model_chain
from meshnet_runtime.lifecycle import configure_logging
from meshnet_runtime.memory import limit_from_flag

__all__ = ["LocalRun", "ready_line", "run_local", "serve_local"]


@dataclass(frozen=True, slots=True)
class LocalRun:
    url: str  # the gateway; the OpenAI API is under /v1
    node_urls: list[str]
    splits: list[tuple[int, int]]
    gateway: GatewayApp


def _num_layers(model: str) -> int:
    return load_model_config(model).num_hidden_layers


@asynccontextmanager
async def serve_local(
    model: str,
    stages: int,
    *,
    gateway_flags: list[str] = (),  # type: ignore[assignment]
    node_flags: list[str] = (),  # type: ignore[assignment]
) -> AsyncIterator[LocalRun]:
    """Nodes and gateway for the duration of the block."""
    layers = _num_layers(model)
    if not 1 <= stages <= layers:
        raise ValueError(f"--stages must be 1..{layers} (the model has {layers} layers)")
    splits = even_splits(layers, stages)
    if "--threads" not in node_flags:
        # Every stage lives in this one process: each gets its share of the
        # cores, or their thread pools would oversubscribe them (issue 18:
        # 1.0 tok/s against 15.1 with one BLAS thread per stage on 2 cores).
        node_flags = [*node_flags, "--threads", str(share_cores(stages))]
    async with start_model_chain(model, splits, extra=list(node_flags)) as nodes:
        argv = ["--entry", nodes[0].url, "--model", model, *gateway_flags]
        async with open_gateway(GatewayConfig.load(argv)) as gateway:
            yield LocalRun(gateway.url, [n.url for n in nodes], splits, gateway.app)


def ready_line(run: LocalRun) -> str:
    assert run.gateway.openai is not None
    ranges = ", ".join(f"{a}:{b}" for a, b in run.splits)
    return (
        f"meshnet run listening on {run.url} (OpenAI API at {run.url}/v1, model "
        f"{run.gateway.openai.model.name}, {len(run.splits)} nodes, layers {ranges})"
    )


async def run_local(
    args: argparse.Namespace, on_ready: Callable[[LocalRun], None] | None = None
) -> None:
    gateway_flags = ["--host", args.host, "--port", str(args.port),
                     "--chunk-tokens", str(args.chunk_tokens), "--inflight", str(args.inflight),
                     "--log-level", args.log_level]  # fmt: skip
    if args.max_tokens_default is not None:
        gateway_flags += ["--max-tokens-default", str(args.max_tokens_default)]
    if args.model_name is not None:
        gateway_flags += ["--model-name", args.model_name]
    node_flags = ["--log-level", args.log_level]
    for flag in ("dtype", "engine", "device", "threads", "kv_budget_bytes", "memory_limit"):
        if getattr(args, flag, None) is not None:  # the nodes validate them
            node_flags += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with serve_local(
            args.model, args.stages, gateway_flags=gateway_flags, node_flags=node_flags
        ) as run:
            print(ready_line(run), flush=True)
            if on_ready is not None:
                on_ready(run)
            async for _ in signals:
                break  # leaving the block shuts the gateway, then the nodes, down


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        # Fail-closed before anything listens: a config the nodes would refuse
        # is one line and exit 2, as meshnet-node and meshnet-gateway give it.
        load_model_config(args.model)  # a directory or a .gguf file
    except (ConfigError, CheckpointError) as exc:  # a GGUF's header or metadata too
        print(f"meshnet run: cannot load --model {args.model}: {exc}", file=sys.stderr)
        return 2
    try:
        _fit(args)  # every stage in this one process, before any tensor is read
    except MemoryShortfall as exc:
        print(f"meshnet run: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(run_local, args, backend=args.async_backend)
    except (OSError, ValueError) as exc:
        print(f"meshnet run: {exc}", file=sys.stderr)
        return 1
    return 0


def _fit(args: argparse.Namespace) -> None:
    """The stages together (and one runtime) against the process's memory; the
    nodes then get the resolved KV budget and limit, which each stage fits."""
    flags = [f"--{f}={getattr(args, f)}" for f in ("dtype", "engine", "device", "threads")
             if getattr(args, f, None) is not None]  # fmt: skip
    node = NodeConfig.load(["--model", args.model, *flags], {})
    found = limit_from_flag(getattr(args, "memory_limit", "auto"))
    splits = even_splits(_num_layers(args.model), args.stages)
    stages = fit_process(args.model, [range(a, b) for a, b in splits], engine=node.engine,
                         dtype=node.dtype, kv_budget_bytes=getattr(args, "kv_budget_bytes", "auto"),
                         max_chunk_tokens=node.max_chunk_tokens,
                         max_compute_bytes=node.max_compute_bytes, limit=found.bytes,
                         limit_source=found.source, who="this process")  # fmt: skip
    args.kv_budget_bytes = stages[0].kv
    args.memory_limit = found.bytes  # None: no limit known, each node reads it again
