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

from .errors import CheckpointError, ConfigError
from .formats.gguf.checkpoint import hf_name, is_gguf
from .formats.gguf.file import GGUFFile
from .formats.safetensors import Checkpoint
from .source import load_config

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


def plan_stages(directory: str | Path, stages: int) -> list[dict[str, object]]:
    """``stages`` layer ranges balancing checkpoint bytes, with what each holds."""
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
    # total, keeping at least one layer for every stage still to come.
    total = embed + sum(layer_bytes) + head
    bounds, held = [0], embed
    for i, size in enumerate(layer_bytes[:-1]):
        held += size
        stages_left = stages - len(bounds)
        layers_left = config.num_hidden_layers - (i + 1)
        if stages_left and (held >= total * len(bounds) / stages or layers_left == stages_left):
            bounds.append(i + 1)
    bounds.append(config.num_hidden_layers)
    kv_per_layer = 2 * config.num_key_value_heads * config.head_dim * 4  # K and V, float32
    plan: list[dict[str, object]] = []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        mapped = sum(layer_bytes[a:b]) + (embed if k == 0 else 0)
        mapped += head if b == config.num_hidden_layers else 0
        plan.append(
            {
                "layers": f"{a}:{b}",
                "checkpoint_bytes": mapped,
                "kv_bytes_per_token": (b - a) * kv_per_layer,
            }
        )
    return plan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshnet_model", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="split a checkpoint into N stages (--layers per node)")
    plan.add_argument("directory")
    plan.add_argument("--stages", type=int, default=2)
    plan.add_argument("--json", action="store_true", help="one JSON document instead of lines")
    args = parser.parse_args(argv)
    try:
        stages = plan_stages(args.directory, args.stages)
    except (ConfigError, CheckpointError, ValueError) as exc:
        print(f"meshnet_model: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stages, indent=2))
        return 0
    for k, stage in enumerate(stages):
        mib = int(stage["checkpoint_bytes"]) / 2**20  # type: ignore[call-overload]
        print(
            f"stage {k}: --layers {stage['layers']}  checkpoint {mib:.1f} MiB"
            f"  KV {stage['kv_bytes_per_token']} B/token"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
