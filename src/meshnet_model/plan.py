"""``python -m meshnet_model plan DIR|FILE.gguf --stages N``: how to split a checkpoint.

Prints, for N contiguous stages holding about equal checkpoint bytes, each
node's ``--layers A:B``, the checkpoint bytes it maps (the embedding counts on
the first stage, the norm and head — the embedding again when tied — on the
last) and its KV cache bytes per token: what each machine needs, before
starting any node. It balances memory, not compute (an embedding costs bytes
but almost no time). Reads only ``config.json`` and the safetensors headers, or
a GGUF file's header (its bytes are the quantized ones).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from .engines.footprint import (
    MemoryShortfall,
    default_engine,
    fit_process,
    format_bytes,
    model_bytes,
    parse_size,
    plan_split,
)
from .errors import CheckpointError, ConfigError
from .formats.gguf.checkpoint import hf_name, is_gguf
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .source import load_config
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
    directory: str | Path,
    stages: int,
    *,
    engine: str | None = None,
    dtype: str | None = None,
    memories: list[int] | None = None,
) -> list[dict[str, object]]:
    """``stages`` layer ranges balancing checkpoint bytes, with what each holds
    (``footprint``: resident bytes as ``engine``/``dtype`` hold them, KV ``auto``);
    ``memories``: one range per machine of those bytes, each fitting it."""
    if engine is None or dtype is None:
        engine, dtype = (
            engine or default_engine(directory)[0],
            dtype or default_engine(directory)[1],
        )
    if memories is not None:
        split = plan_split(
            directory,
            memories,
            engine=engine,
            dtype=dtype,
            max_chunk_tokens=DEFAULT_MAX_CHUNK_TOKENS,
            max_compute_bytes=DEFAULT_MAX_COMPUTE_BYTES,
        )
        return [_entry(directory, fp, memory) for fp, memory in zip(split, memories, strict=True)]
    config = load_config(directory)
    if not 1 <= stages <= config.num_hidden_layers:
        raise ValueError(f"stages must be 1..{config.num_hidden_layers}, got {stages}")
    sizes = _tensor_sizes(directory)
    layer_bytes = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        layer_bytes.append(sum(size for n, size in sizes.items() if n.startswith(prefix)))
    embed = sizes["model.embed_tokens.weight"]
    head = sizes["model.norm.weight"] + (
        sizes["lm_head.weight"]
        if "lm_head.weight" in sizes and not config.tie_word_embeddings
        else embed  # a tied head maps the embedding on the last stage too
    )
    # Greedy cut: close a stage once the stages so far hold their share of the
    # total, keeping at least one layer for every stage still to come; the
    # shares are of the bytes held (footprint), not of the file.
    mb = model_bytes(directory, engine, dtype, config)
    total = mb.embed + sum(mb.layers) + mb.head
    bounds, held = [0], mb.embed
    for i, size in enumerate(mb.layers[:-1]):
        held += size
        stages_left = stages - len(bounds)
        layers_left = config.num_hidden_layers - (i + 1)
        if stages_left and (held >= total * len(bounds) / stages or layers_left == stages_left):
            bounds.append(i + 1)
    bounds.append(config.num_hidden_layers)
    kv_per_layer = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, float32
    fps = fit_process(
        directory,
        [range(a, b) for a, b in itertools.pairwise(bounds)],
        engine=engine,
        dtype=dtype,
        kv_budget_bytes="auto",
        max_chunk_tokens=DEFAULT_MAX_CHUNK_TOKENS,
        max_compute_bytes=DEFAULT_MAX_COMPUTE_BYTES,
        limit=None,
    )
    plan: list[dict[str, object]] = []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        mapped = sum(layer_bytes[a:b]) + (embed if k == 0 else 0)
        mapped += head if b == config.num_hidden_layers else 0
        plan.append(
            {
                "layers": f"{a}:{b}",
                "checkpoint_bytes": mapped,
                "kv_bytes_per_token": (b - a) * kv_per_layer,
                "footprint": fps[k].to_dict(),
            }
        )
    return plan


def _entry(directory: str | Path, fp: object, memory: int) -> dict[str, object]:
    config = load_config(directory)
    kv_per_layer = 2 * config.num_key_value_heads * config.head_dim * 4
    a, b = fp.layers.start, fp.layers.stop  # type: ignore[attr-defined]
    return {
        "layers": f"{a}:{b}",
        "kv_bytes_per_token": (b - a) * kv_per_layer,
        "footprint": fp.to_dict(),  # type: ignore[attr-defined]
        "memory": memory,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshnet_model", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="split a checkpoint into N stages (--layers per node)")
    plan.add_argument("directory")
    plan.add_argument("--stages", type=int, default=None, help="[2, or one per --memory]")
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
    engine, dtype = args.engine, args.dtype
    if args.engine == "numpy" and dtype is None:
        dtype = "float32"  # numpy's own default
    try:
        stages = plan_stages(
            args.directory, args.stages or 2, engine=engine, dtype=dtype, memories=args.memory
        )
    except MemoryShortfall as exc:
        print(f"meshnet_model: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"meshnet_model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stages, indent=2))
        return 0
    for k, stage in enumerate(stages):
        fp = stage["footprint"]
        assert isinstance(fp, dict)
        machine = f" of {format_bytes(int(stage['memory']))}" if "memory" in stage else ""  # type: ignore[call-overload]
        file_share = ""
        if "checkpoint_bytes" in stage:
            file_share = f"  checkpoint {int(stage['checkpoint_bytes']) / 2**20:.1f} MiB"  # type: ignore[call-overload]
        print(
            f"stage {k}: --layers {stage['layers']}  resident {format_bytes(fp['total'])}{machine}"
            f" (weights {format_bytes(fp['weights'])} {fp['form']}, KV {format_bytes(fp['kv'])},"
            f" scratch {format_bytes(fp['scratch'])}, runtime {format_bytes(fp['runtime'])};"
            f" {fp['engine']} {fp['dtype']}){file_share}  KV {stage['kv_bytes_per_token']} B/token"
        )
    return 0


def _memories(text: str) -> list[int]:
    try:
        return [parse_size(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(main())
