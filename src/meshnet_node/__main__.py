"""``meshnet-node`` / ``python -m meshnet_node``: one stage of a meshnet chain."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import anyio

from meshnet_model.engines.choice import engine_advice, quiet_idle_threads
from meshnet_model.engines.footprint import MemoryShortfall
from meshnet_proto import WIRE_VERSION
from meshnet_runtime.config import model_path_problem
from meshnet_runtime.lifecycle import (
    FORCED_EXIT,
    rss_suffix,
    run_process,
    serve_until_signalled,
)
from meshnet_runtime.transports import listen

from .backends import StageBackend
from .config import NodeConfig
from .model_stage import stage_from_config
from .serving import build_node


def ready_line(config: NodeConfig, url: str, stage: StageBackend | None = None) -> str:
    downstream = config.next.url if config.next is not None else "none (last stage)"
    name = stage.name if stage is not None else config.backend
    return (
        f"meshnet-node listening on {url} (wire {WIRE_VERSION}, stage {name}, next: {downstream})"
        + _model_summary(stage, config.model)
        + rss_suffix()
    )


def _model_summary(stage: StageBackend | None, model: str | None) -> str:
    """What a model stage computes with and holds: engine, held forms, bytes, threads."""
    info = stage.describe() if stage is not None else {}
    if info.get("backend") != "model":
        return ""
    held = info.get("weights_held") or {info.get("weights_dtype"): None}
    forms = "+".join(str(form) for form in held)
    mib = int(info.get("weights_bytes", 0)) / 2**20
    engine = f"{info.get('engine')} on {info.get('device')}"
    footprint = info.get("footprint") or {}
    resident = (
        f", resident at most {int(footprint['total']) / 2**20:,.0f} MiB with the KV budget"
        if "total" in footprint
        else ""
    )
    return (
        f" engine {engine}, compute {info.get('compute_dtype')}, weights {forms}"
        f" {mib:,.1f} MiB{resident}, threads {info.get('threads') or 'default'}"
        + (engine_advice(model, str(info.get("engine"))) if model else "")
    )


async def run(config: NodeConfig, stage: StageBackend | None = None) -> None:
    app, server = build_node(config, stage=stage)
    bound = await listen(host=config.host, port=config.port, uds=config.uds, tls=config.tls)

    def ready(url: str) -> None:
        # The one line scripts wait for; flushed, since stdout may be a pipe.
        print(ready_line(config, url, app.stage), flush=True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(app.maintain)
            await serve_until_signalled(server, bound, ready)
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await app.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    quiet_idle_threads()  # before torch loads its OpenMP runtime, which reads it once
    config = NodeConfig.load(argv)
    stage = None
    if config.model is not None:
        problem = model_path_problem(config.model)
        if problem is not None:
            print(f"meshnet-node: {problem}", file=sys.stderr)
            return 2
        # Loaded before serving, so a bad checkpoint is one clear line and exit 2.
        try:
            stage = stage_from_config(config)
        except MemoryShortfall as exc:  # before any tensor was read
            print(f"meshnet-node: {exc}", file=sys.stderr)
            return 2
        except ValueError as exc:
            print(f"meshnet-node: cannot load --model {config.model}: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C during the load: nothing to drain
            print("meshnet-node: interrupted while loading --model", file=sys.stderr)
            return FORCED_EXIT
    return run_process("meshnet-node", functools.partial(run, stage=stage), config)


if __name__ == "__main__":
    sys.exit(main())
