"""``meshnet run``: a model split over N model nodes plus a gateway, one process.

The nodes listen on free loopback ports, each running its layers (an even
share over ``--stages``, or ``--split A:B,B:C``) and pointing at the next;
the gateway listens on ``--host/--port`` with ``--model`` and serves the
OpenAI API. Its flags beside those are its servers' own (``run_flags``).

Nothing starts when any part would fail: the model path, the split, the
device, the memory and the gateway's tokenizer are checked first, then the
gateway's port is bound — before any tensor is read — and only then do the
stages load (in a worker thread, so a Ctrl-C during a load of minutes is
answered at once). Every refusal is one line on stderr, exit 2.

Cores: the stages share the machine's by who is busy (``core_flags``), and
torch's idle OpenMP threads spin briefly, then sleep (``quiet_idle_threads``).

Ready: one line on stdout naming the URL (its first words are stable:
``meshnet run listening on URL``), then a line per node with its URL and
layers. Shutdown: the first SIGINT/SIGTERM drains the gateway (open OpenAI
streams end with a final event) and then the nodes, for at most
``--shutdown-timeout`` seconds; exit 0. A second signal quits at once, as
does one while the models load: exit 130.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio

from meshnet_gateway import open_gateway
from meshnet_gateway.app import GatewayApp
from meshnet_gateway.config import GatewayConfig
from meshnet_gateway.openai import ServedModel
from meshnet_gateway.openai.draft_model import draft_model_problem
from meshnet_model.engines.choice import (
    TORCH_INSTALL,
    choose_engine,
    quiet_idle_threads,
    share_cores,
)
from meshnet_model.engines.core_ledger import supported as ledger_supported
from meshnet_model.engines.fit import fit_process
from meshnet_model.engines.footprint import MemoryShortfall
from meshnet_model.errors import CheckpointError, ConfigError
from meshnet_model.source import load_config as load_model_config
from meshnet_node.config import NodeConfig
from meshnet_node.model_chain import even_splits, start_model_chain
from meshnet_runtime.config import model_path_problem
from meshnet_runtime.http_server import HttpServer
from meshnet_runtime.lifecycle import (
    FORCED_EXIT,
    configure_logging,
    listen_problem,
    quit_now,
    rss_suffix,
)
from meshnet_runtime.memory import limit_from_flag
from meshnet_runtime.transports import BoundListener, listen

from . import run_flags
from .run_flags import BOTH, GATEWAY_ONLY, NODE_ONLY, RUN_NODE_FIXED, forwarded, typed

__all__ = [
    "LocalRun",
    "Refusal",
    "check_split",
    "core_flags",
    "node_lines",
    "ready_line",
    "run_local",
    "serve_local",
]

log = logging.getLogger("meshnet.run")


class Refusal(Exception):
    """What ``meshnet run`` will not start with: one line, cause and fix; exit 2."""


@dataclass(frozen=True, slots=True)
class LocalRun:
    url: str  # the gateway; the OpenAI API is under /v1
    node_urls: list[str]
    splits: list[tuple[int, int]]
    gateway: GatewayApp
    server: HttpServer  # the gateway's


def _num_layers(model: str) -> int:
    return load_model_config(model).num_hidden_layers


def check_split(
    layers: int, stages: int | None, split: Sequence[tuple[int, int]] | None
) -> list[tuple[int, int]]:
    """The nodes' layer ranges, entry first; ``Refusal`` naming what is wrong."""
    if split is None:
        stages = 2 if stages is None else stages
        if not 1 <= stages <= layers:
            raise Refusal(
                f"--stages {stages}: the model has {layers} layers, so at most "
                f"{layers} stages (pass --stages 1..{layers}, or --split)"
            )
        return even_splits(layers, stages)
    shown = ",".join(f"{a}:{b}" for a, b in split)
    if stages is not None and stages != len(split):
        raise Refusal(
            f"--stages {stages} but --split {shown} names {len(split)} ranges (give one of the two)"
        )
    expected = 0
    for start, end in split:
        if start != expected:
            what = (
                f"layers {expected}..{start - 1} are in no stage"
                if start > expected
                else (f"layer {start} is in two stages")
            )
            raise Refusal(
                f"--split {shown}: {what} (each range starts where the previous "
                "ended, the first at 0)"
            )
        if end <= start:
            raise Refusal(f"--split {shown}: {start}:{end} is empty (each range A:B needs A < B)")
        expected = end
    if expected != layers:
        raise Refusal(
            f"--split {shown}: the model has {layers} layers, so the last range "
            f"ends at {layers}, not {expected}"
        )
    return list(split)


@asynccontextmanager
async def serve_local(
    model: str,
    stages: int | Sequence[tuple[int, int]],
    *,
    gateway_flags: Sequence[str] = (),
    node_flags: Sequence[str] = (),
    bound: BoundListener | None = None,
    load_in_thread: bool = False,
) -> AsyncIterator[LocalRun]:
    """Nodes and gateway for the duration of the block.

    ``stages``: a count (an even split) or the layer ranges themselves;
    ``bound``: the gateway's listener, bound beforehand (``run_local``).
    """
    if isinstance(stages, int):
        splits = check_split(_num_layers(model), stages, None)
    else:
        splits = list(stages)
    with tempfile.TemporaryDirectory(prefix="meshnet-run-") as scratch:
        cores = core_flags(model, node_flags, len(splits), Path(scratch) / "cores")
        flags = [*RUN_NODE_FIXED, *node_flags, *cores]
        chain = start_model_chain(model, splits, extra=flags, load_in_thread=load_in_thread)
        async with chain as nodes:
            argv = ["--entry", nodes[0].url, "--model", model, *gateway_flags]
            async with open_gateway(GatewayConfig.load(argv), bound) as gateway:
                yield LocalRun(
                    gateway.url, [n.url for n in nodes], splits, gateway.app, gateway.server
                )


def core_flags(model: str, node_flags: Sequence[str], stages: int, ledger: Path) -> list[str]:
    """The nodes' flags for sharing this machine's cores. Torch stages on the
    CPU: one core ledger (``--share-cores-with``), so the stage computing takes
    the cores the others leave idle — each at most ``--threads``, default every
    core. Others (numpy's BLAS pool is one for the whole process): a static
    share each, unless ``--threads`` is given."""
    node = NodeConfig.load(["--model", model, *node_flags], {})
    engine, _ = choose_engine(model, node.engine, node.dtype, node.device)
    if engine == "torch" and node.device == "cpu" and ledger_supported():
        return ["--share-cores-with", str(ledger)]
    if node.threads is None:
        # Every stage lives in this one process: each gets its share of the
        # cores, or their thread pools would oversubscribe them (issue 18:
        # 1.0 tok/s against 15.1 with one BLAS thread per stage on 2 cores).
        return ["--threads", str(share_cores(stages))]
    return []


def ready_line(run: LocalRun) -> str:
    """The line scripts wait for: ``meshnet run listening on URL (...)``, the
    resident memory of the whole process (every stage) last."""
    assert run.gateway.openai is not None
    ranges = ", ".join(f"{a}:{b}" for a, b in run.splits)
    return (
        f"meshnet run listening on {run.url} (OpenAI API at {run.url}/v1, model "
        f"{run.gateway.openai.model.name}, {len(run.splits)} nodes, layers {ranges})" + rss_suffix()
    )


def node_lines(run: LocalRun) -> list[str]:
    """One line a node, entry first: where it listens and what it runs."""
    count = len(run.splits)
    return [
        f"meshnet run node {i}/{count} at {url}: layers {a}:{b}"
        for i, (url, (a, b)) in enumerate(zip(run.node_urls, run.splits, strict=True), 1)
    ]


async def run_local(
    args: argparse.Namespace,
    splits: list[tuple[int, int]],
    on_ready: Callable[[LocalRun], None] | None = None,
) -> int:
    """Serve until a signal, then drain; the exit status (0). A second signal,
    or one while the models load, exits the process at once (130)."""
    host, port = typed(args, "--host"), typed(args, "--port")
    try:
        # First: a taken port is refused before any model is loaded.
        bound = await listen(host=host, port=port, tls=typed(args, "--tls-cert") is not None)
    except OSError as exc:
        raise Refusal(listen_problem(exc, host, port)) from None
    node_flags = forwarded(args, BOTH + NODE_ONLY)
    gateway_flags = forwarded(args, GATEWAY_ONLY + BOTH)
    ready: list[LocalRun] = []
    stop = anyio.Event()
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if ready and not stop.is_set():
                        print(
                            f"meshnet run: {name}: shutting down (again to quit at once)",
                            file=sys.stderr,
                            flush=True,
                        )
                        stop.set()
                        continue
                    what = "again: quitting at once" if ready else "while loading: quitting"
                    print(f"meshnet run: {name} {what}", file=sys.stderr, flush=True)
                    quit_now(FORCED_EXIT)  # a load in its worker thread is not waited for

            tg.start_soon(watch)
            async with serve_local(
                args.model,
                splits,
                gateway_flags=gateway_flags,
                node_flags=node_flags,
                bound=bound,
                load_in_thread=True,
            ) as run:
                print(ready_line(run), flush=True)
                for line in node_lines(run):
                    print(line, flush=True)
                run.server.drain_note = "; Ctrl-C (SIGINT/SIGTERM) again quits at once"
                ready.append(run)
                if on_ready is not None:
                    on_ready(run)
                await stop.wait()
            tg.cancel_scope.cancel()  # drained: the watcher too
    return 0


def main(args: argparse.Namespace) -> int:
    quiet_idle_threads()  # before torch loads its OpenMP runtime, which reads it once
    try:
        run_flags.resolve(args)  # MESHNET_* for the flags not given, as the servers read them
        configure_logging(typed(args, "--log-level"))
        splits = _preflight(args)
    except (Refusal, ValueError) as exc:
        print(f"meshnet run: {exc}", file=sys.stderr)
        return 2
    status = 0
    # except*: what ends a run may come out of a task group as a group of one.
    try:
        status = anyio.run(run_local, args, splits, backend=typed(args, "--async-backend"))
    except* KeyboardInterrupt:  # before the signal handlers were installed
        status = FORCED_EXIT
    except* Refusal as group:
        print(f"meshnet run: {group.exceptions[0]}", file=sys.stderr)
        status = 2
    except* ValueError as group:  # a checkpoint problem only the load finds
        print(
            f"meshnet run: cannot load --model {args.model}: {group.exceptions[0]}", file=sys.stderr
        )
        status = 2
    return status


def _preflight(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Everything that can be refused before anything listens: the path, the
    split, the device, the memory, the gateway's tokenizer. The layer ranges to run."""
    problem = model_path_problem(args.model)
    if problem is not None:
        raise Refusal(problem)
    try:
        layers = _num_layers(args.model)  # a directory or a .gguf file
    except (ConfigError, CheckpointError) as exc:  # a GGUF's header or metadata too
        raise Refusal(f"cannot load --model {args.model}: {exc}") from None
    splits = check_split(layers, args.stages, args.split)
    _check_device(typed(args, "--device"))
    try:
        _fit(args, splits)  # every stage in this one process, before any tensor is read
    except MemoryShortfall as exc:
        raise Refusal(str(exc)) from None
    try:
        # The gateway's side (tokenizer, chat template, context), which it would
        # otherwise find wrong only after every stage had loaded; last, as the
        # slowest of the checks (it reads the tokenizer).
        served = ServedModel.load(
            args.model, name=typed(args, "--model-name"), context=typed(args, "--max-context")
        )
    except (OSError, ValueError) as exc:
        raise Refusal(f"cannot load --model {args.model}: {exc}") from None
    draft = typed(args, "--draft-model")
    if draft is not None:  # its path, config and vocabulary against the served tokenizer
        problem = draft_model_problem(draft, served.tokenizer, typed(args, "--speculate"))
        if problem is not None:
            raise Refusal(problem)
    return splits


def _check_device(device: str) -> None:
    """A CUDA device this machine lacks, refused before anything loads (the
    stages would refuse it too, after the gateway's port was taken)."""
    if device == "cpu":
        return
    fix = "run on the CPU with --device cpu (the default)"
    try:
        import torch
    except ImportError:
        raise Refusal(f"--device {device} needs torch: {TORCH_INSTALL}; {fix}") from None
    if not torch.cuda.is_available():
        build = torch.version.cuda or "none"
        raise Refusal(
            f"--device {device}: no CUDA device is available here (torch "
            f"{torch.__version__}, cuda build {build}); {fix}"
        )
    index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
    if index >= count:
        raise Refusal(f"--device {device}: this machine has {count} CUDA device(s); {fix}")


def _fit(args: argparse.Namespace, splits: list[tuple[int, int]]) -> None:
    """The stages together (and one runtime) against the process's memory; the
    nodes then get the resolved KV budget and limit, which each stage fits."""
    node = NodeConfig.load(
        [
            "--model",
            args.model,
            *forwarded(
                args,
                (
                    "--dtype",
                    "--engine",
                    "--device",
                    "--threads",
                    "--max-chunk-tokens",
                    "--max-compute-bytes",
                ),
            ),
        ],
        {},
    )
    found = limit_from_flag(typed(args, "--memory-limit"))
    stages = fit_process(
        args.model,
        [range(a, b) for a, b in splits],
        engine=node.engine,
        dtype=node.dtype,
        kv_budget_bytes=typed(args, "--kv-budget-bytes"),
        max_chunk_tokens=node.max_chunk_tokens,
        max_compute_bytes=node.max_compute_bytes,
        limit=found.bytes,
        limit_source=found.source,
        who="this process",
    )
    args.kv_budget_bytes = str(stages[0].kv)
    # None: no limit known, each node reads it again
    args.memory_limit = None if found.bytes is None else str(found.bytes)
