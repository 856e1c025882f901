"""``python -m meshnet_model plan MODEL --stages N | --memory M1,M2,...``: how to split a model.

Prints each node's ``--layers A:B`` and what it needs, before starting any
node: its weights as the engine holds them, its scratch, the process's
runtime and the least KV budget — the figure the node's own memory check
(``--memory-limit``) compares, independent of any limit — and the KV budget
it may grow to (``auto``: what the machine leaves, up to 1 GiB); with the
checkpoint bytes it maps and its KV bytes per token. ``--stages N`` splits
as ``meshnet run --stages N`` does (``split.even_splits``: the same
function); ``--memory`` keeps that split where it fits every machine and
moves layers where it does not (``split.plan_split``). Reads only
``config.json`` and the safetensors headers, or a GGUF file's header.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .engines.fit import fit_process
from .engines.footprint import (
    KV_AUTO_MIN,
    MemoryShortfall,
    StageFootprint,
    default_engine,
    format_bytes,
    least_need,
    parse_size,
)
from .errors import CheckpointError, ConfigError
from .formats.config import ModelConfig
from .formats.gguf.checkpoint import hf_name, is_gguf
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .source import load_config
from .split import even_splits, plan_split
from .stage.runner import DEFAULT_MAX_CHUNK_TOKENS, DEFAULT_MAX_COMPUTE_BYTES

__all__ = ["main", "plan_stages"]


def _tensor_sizes(path: str | Path) -> dict[str, int]:
    """Bytes of each tensor as stored, by HF name: a directory's safetensors, or
    a GGUF file's (quantized) tensors, read from the headers only."""
    if is_gguf(path):
        file = GGUFFile(path)
        return {
            name: int(tensor.n_bytes)
            for tensor in file.tensors.values()
            if (name := hf_name(tensor.name)) is not None
        }
    ckpt = Checkpoint(path)
    sizes = {}
    for name in ckpt.weight_map:
        f = ckpt.file_for(name)
        sizes[name] = math.prod(f.shape(name)) * f.dtype(name).itemsize
    return sizes


def plan_stages(
    model: str | Path,
    stages: int,
    *,
    engine: str | None = None,
    dtype: str | None = None,
    memories: list[int] | None = None,
) -> list[dict[str, object]]:
    """The stages of ``model`` (module doc): ``stages`` even ranges, or one range
    per machine of ``memories`` bytes. Each entry: ``layers``, ``need`` (bytes,
    the node's memory check), ``footprint`` (``footprint.StageFootprint``, its
    KV the ``auto`` budget: the machine's, else the most), ``kv_bytes_per_token``,
    and ``checkpoint_bytes`` or ``memory``."""
    default = default_engine(model)
    engine, dtype = engine or default[0], dtype or default[1]
    if memories is not None:
        split = plan_split(
            model,
            memories,
            engine=engine,
            dtype=dtype,
            max_chunk_tokens=DEFAULT_MAX_CHUNK_TOKENS,
            max_compute_bytes=DEFAULT_MAX_COMPUTE_BYTES,
        )
        return [
            {**_entry(model, fp, engine, dtype), "memory": memory}
            for fp, memory in zip(split, memories, strict=True)
        ]
    config = load_config(model)
    if not 1 <= stages <= config.num_hidden_layers:
        raise ValueError(f"stages must be 1..{config.num_hidden_layers}, got {stages}")
    ranges = [range(a, b) for a, b in even_splits(config.num_hidden_layers, stages)]
    fps = _fit(model, ranges, engine, dtype, "auto")
    sizes = _tensor_sizes(model)
    return [
        {**_entry(model, fp, engine, dtype), "checkpoint_bytes": _mapped(sizes, config, fp.layers)}
        for fp in fps
    ]


def _fit(
    model: str | Path, ranges: list[range], engine: str, dtype: str, kv: int | str
) -> list[StageFootprint]:
    """The footprints with the node's default chunk and compute limits, no machine's limit."""
    return fit_process(
        model,
        ranges,
        engine=engine,
        dtype=dtype,
        kv_budget_bytes=kv,
        max_chunk_tokens=DEFAULT_MAX_CHUNK_TOKENS,
        max_compute_bytes=DEFAULT_MAX_COMPUTE_BYTES,
        limit=None,
    )


def _mapped(sizes: dict[str, int], config: ModelConfig, span: range) -> int:
    """Checkpoint bytes a stage of ``span`` maps: its layers, the embedding on
    the first, the norm and head on the last (a tied head: the embedding again)."""
    total = sum(
        size
        for name, size in sizes.items()
        if name.startswith("model.layers.") and int(name.split(".")[2]) in span
    )
    embed = sizes["model.embed_tokens.weight"]
    total += embed if span.start == 0 else 0
    if span.stop == config.num_hidden_layers:
        untied = "lm_head.weight" in sizes and not config.tie_word_embeddings
        total += sizes["model.norm.weight"] + (sizes["lm_head.weight"] if untied else embed)
    return total


def _entry(model: str | Path, fp: StageFootprint, engine: str, dtype: str) -> dict[str, object]:
    """What a stage needs as the node's check counts it: its least KV budget, not the most."""
    config = load_config(model)
    kv_per_layer = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, float32
    (least,) = _fit(model, [fp.layers], engine, dtype, KV_AUTO_MIN)
    return {
        "layers": f"{fp.layers.start}:{fp.layers.stop}",
        "need": least_need([least], KV_AUTO_MIN),
        "kv_bytes_per_token": len(fp.layers) * kv_per_layer,
        "footprint": fp.to_dict(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshnet_model", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="split a model into stages (--layers per node)")
    plan.add_argument(
        "model",
        metavar="MODEL",
        help="a GGUF file or a checkpoint directory (config.json and safetensors)",
    )
    plan.add_argument(
        "--stages", type=int, default=None, help="[2, or one per --memory] as meshnet run splits"
    )
    plan.add_argument(
        "--engine",
        choices=("numpy", "torch"),
        default=None,
        help="[the node's default: torch keep for a GGUF file with torch, else numpy float32]",
    )
    plan.add_argument("--dtype", choices=("keep", "float32", "bfloat16", "float16"), default=None)
    plan.add_argument(
        "--memory",
        type=_memories,
        default=None,
        help="machines' memories, e.g. 16GiB,8GiB,8GiB: a split that fits them",
    )
    plan.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    args = parser.parse_args(argv)
    if args.memory is not None and args.stages not in (None, len(args.memory)):
        parser.error(f"--stages {args.stages} but --memory names {len(args.memory)} machines")
    dtype = "float32" if args.engine == "numpy" and args.dtype is None else args.dtype
    try:
        stages = plan_stages(
            args.model, args.stages or 2, engine=args.engine, dtype=dtype, memories=args.memory
        )
    except MemoryShortfall as exc:
        print(f"meshnet_model: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"meshnet_model: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(stages, indent=2) if args.json else "\n".join(map(_line, enumerate(stages))))
    return 0


def _line(numbered: tuple[int, dict[str, object]]) -> str:
    """One stage as a reader wants it: the flag, what it needs, what the KV may grow to."""
    k, stage = numbered
    fp = stage["footprint"]
    assert isinstance(fp, dict)
    machine = stage.get("memory")
    where = (
        f" of {format_bytes(int(machine))}"
        if isinstance(machine, int)
        else " as the machine allows"
    )
    mapped = stage.get("checkpoint_bytes")
    file_share = f", checkpoint {format_bytes(mapped)}" if isinstance(mapped, int) else ""
    return (
        f"stage {k}: --layers {stage['layers']}  needs {format_bytes(int(str(stage['need'])))}"
        f" (weights {format_bytes(fp['weights'])} {fp['form']}, scratch"
        f" {format_bytes(fp['scratch'])}, runtime {format_bytes(fp['runtime'])}, KV"
        f" {format_bytes(KV_AUTO_MIN)} at least; {fp['engine']} {fp['dtype']}), KV budget up to"
        f" {format_bytes(fp['kv'])}{where}  ({stage['kv_bytes_per_token']} B/token{file_share})"
    )


def _memories(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
