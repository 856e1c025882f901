"""Small random models built by transformers itself, saved both ways, and the
numpy engine's greedy decode of them through an in-process chain of stages.

transformers 5's ``save_pretrained`` writes the new layout (``rope_parameters``,
``dtype``, explicit ``layer_types``); ``to_classic`` rewrites config.json the
way 4.x releases wrote it (``rope_theta`` + ``rope_scaling``, ``torch_dtype``,
no ``layer_types``), so both readers are exercised on the same weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from meshnet_model import StageRunner
from meshnet_model.stage.weights import StageWeights

# Greedy logits vs transformers' (both float32): max |difference| within this
# many times the logits' scale. Measured ≤ 6e-7 on these models (docs/models.md);
# the margin covers other BLAS builds' summation orders.
LOGIT_TOLERANCE = 1e-5
VOCAB = 96
HIDDEN = 64
LAYERS = 3


def _base(**extra: Any) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **extra,
    }


# name -> (config class, keyword arguments): every family, and the switches
# where each breaks if it is done wrongly (windows smaller than the generated
# length, rope variants, an explicit head_dim, biases, no-rope layers).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", _base(rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "llama-tied-bias": ("LlamaConfig", _base(tie_word_embeddings=True, attention_bias=True,
                                              mlp_bias=True)),
    "llama3-rope": ("LlamaConfig", _base(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-yarn": ("LlamaConfig", _base(rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 64})),
    "llama-linear": ("LlamaConfig", _base(rope_parameters={
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "mistral-window": ("MistralConfig", _base(sliding_window=7, head_dim=24)),
    "qwen2": ("Qwen2Config", _base(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-window": ("Qwen2Config", _base(use_sliding_window=True, sliding_window=6,
                                          max_window_layers=1)),
    "qwen3": ("Qwen3Config", _base(head_dim=24, tie_word_embeddings=True)),
    "smollm3": ("SmolLM3Config", _base(no_rope_layer_interval=2, num_key_value_heads=1)),
}  # fmt: skip


def build_model(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A transformers model of ``variant`` with weights large enough that greedy
    decoding wanders over the vocabulary (transformers' 0.02-std init gives
    near-uniform logits and one repeated token)."""
    class_name, kwargs = VARIANTS[variant]
    config = getattr(transformers, class_name)(**json.loads(json.dumps(kwargs)))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight" and config.tie_word_embeddings:
                # A tied head reads the embedding back: with a norm near 1 the
                # current token's own row wins every step and greedy repeats it.
                param.copy_(torch.randn_like(param))
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[1] ** 0.5)
    model.tie_weights()
    return model.eval()


def save(model: transformers.PreTrainedModel, directory: Path, *, classic: bool) -> Path:
    model.save_pretrained(directory)
    if classic:
        path = directory / "config.json"
        path.write_text(json.dumps(to_classic(json.loads(path.read_text())), indent=2))
    return directory


def to_classic(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers-5 config.json as a 4.x release wrote it."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters", None) or {})
    out["rope_theta"] = rope.pop("rope_theta", 10000.0)
    kind = rope.pop("rope_type", "default")
    # 4.x wrote null for plain rope and the scaling dict (with "type" in older
    # releases) otherwise.
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    out["torch_dtype"] = out.pop("dtype", "float32")
    out.pop("layer_types", None)
    if out.get("model_type") in ("qwen2", "qwen3") and out.get("sliding_window") is None:
        out["sliding_window"] = 4096  # 4.x kept the unused window next to use_sliding_window=false
    return out


def reference_generate(
    model: transformers.PreTrainedModel, prompt: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ``generate``: the new ids and each step's logits."""
    # No eos (an empty list: None falls back to the model's): plain argmax at
    # every step, where min_new_tokens would instead mask the eos logit.
    out = model.generate(
        torch.tensor([prompt]),
        eos_token_id=[],
        max_new_tokens=steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    assert out.sequences.shape[1] == len(prompt) + steps
    ids = out.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(out.logits, dim=1)[0].numpy()
    return ids, logits


def chain_generate(
    directory: Path,
    splits: list[tuple[int, int]],
    prompt: list[int],
    steps: int,
    *,
    chunk: int = 5,
) -> tuple[list[int], np.ndarray]:
    """Greedy decode through stages ``splits`` (in process, each its own runner):
    the prompt in chunks of ``chunk`` (chunked prefill), then one id per run."""
    runners = [StageRunner(StageWeights.load(directory, range(a, b))) for a, b in splits]
    return greedy(runners, prompt, steps, chunk=chunk)


def greedy(
    runners: Sequence[StageRunner],
    prompt: list[int],
    steps: int,
    *,
    chunk: int = 5,
    session: str = "s",
) -> tuple[list[int], np.ndarray]:
    """Greedy decode through in-process stage runners of any engine: the new
    ids and each step's float32 logits ``[steps, vocab]``."""

    def forward(ids: list[int], position: int) -> np.ndarray:
        x: np.ndarray = np.asarray([ids], dtype=np.int32)
        for runner in runners:
            x = runner.run(session, position, x)
        return x

    logits = None
    for lo in range(0, len(prompt), chunk):
        logits = forward(prompt[lo : lo + chunk], lo)
    assert logits is not None
    ids: list[int] = []
    rows = []
    position = len(prompt)
    for _ in range(steps):
        rows.append(np.array(logits[0], dtype=np.float32))
        ids.append(int(np.argmax(logits[0])))
        logits = forward(ids[-1:], position)
        position += 1
    return ids, np.stack(rows)


def logit_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """max |difference| over the logits' scale, max(1, max |logit|)."""
    scale = max(1.0, float(np.abs(theirs).max()))
    return float(np.abs(ours - theirs).max()) / scale
