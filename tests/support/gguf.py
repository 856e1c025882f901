"""GGUF test models: built by transformers, written as llama.cpp writes them.

``build_model(kind)`` makes a small random ``LlamaForCausalLM`` (GQA) or
``Qwen2ForCausalLM`` with transformers itself, its weights replaced by ones
scaled to keep activations O(1) (transformers' own init, std 0.02, gives
near-flat logits whose argmax ties would make "same greedy tokens" a coin
toss). ``write_model_gguf`` writes it with a trained tiny tokenizer;
``hf_from_gguf`` is transformers loading that very file back.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from meshnet_model.testing.gguf import GGUFVocab, random_k_quant, write_gguf
from support.vocab import byte_level_vocab, sentencepiece_vocab

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# The mistral test model's sliding window: the tests decode 12 + 32 positions.
MISTRAL_WINDOW = 8


@cache
def vocab_for(kind: str) -> GGUFVocab:
    return sentencepiece_vocab() if kind in ("llama", "mistral") else byte_level_vocab()


@dataclass
class Model:
    kind: str
    config: dict[str, Any]  # config.json form
    weights: dict[str, np.ndarray]  # HF names, float32


def build_model(kind: str, layers: int = 4, seed: int = 0, hidden: int = 64) -> Model:
    import transformers

    vocab = len(vocab_for(kind).tokens)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5)  # fmt: skip
    if kind == "llama":
        hf_config = transformers.LlamaConfig(**common, rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(hf_config)
    elif kind == "mistral":
        # A window shorter than prompt + steps, so that it masks keys.
        hf_config = transformers.MistralConfig(**common, rope_theta=50000.0,
                                               sliding_window=MISTRAL_WINDOW)  # fmt: skip
        model = transformers.MistralForCausalLM(hf_config)
    elif kind == "qwen3":
        # An explicit head_dim (not hidden / heads). transformers' GGUF loader does
        # not read attention.key_length for qwen3 and falls back to Qwen3Config's
        # default, 128: the test model uses that value so both sides agree.
        hf_config = transformers.Qwen3Config(**common, rope_theta=1000000.0, head_dim=128,
                                             tie_word_embeddings=True)  # fmt: skip
        model = transformers.Qwen3ForCausalLM(hf_config)
    else:
        hf_config = transformers.Qwen2Config(**common, rope_theta=1000000.0,
                                             tie_word_embeddings=True)  # fmt: skip
        model = transformers.Qwen2ForCausalLM(hf_config)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, param in model.state_dict().items():
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            # Tied, it is the head too: rows of norm ~1 keep the logits O(1)
            # (the first layer's RMSNorm rescales the input either way).
            tied = hf_config.tie_word_embeddings
            value = rng.standard_normal(shape) / (np.sqrt(shape[-1]) if tied else 1.0)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        weights[name] = value.astype(np.float32)
    if hf_config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    config = hf_config.to_dict()
    config["model_type"] = kind
    config["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if config.get("head_dim") is None:
        config["head_dim"] = 16
    return Model(kind, config, weights)


def write_model_gguf(directory: Path, model: Model, qtype: str = "F32") -> Path:
    path = directory / f"{model.kind}-{qtype.lower()}.gguf"
    # A Mistral file is architecture "llama" with a sliding window, as llama.cpp's
    # converter writes it. transformers 5 would take one *named* "mistral" as
    # Mistral and then fail in its own name mapping (NotImplementedError);
    # unnamed, it loads it as Llama and drops the window (hf_reference puts it back).
    write_gguf(path, model.config, model.weights, qtype=qtype, vocab=vocab_for(model.kind),
               chat_template=CHAT_TEMPLATE)  # fmt: skip
    return path


def hf_from_gguf(path: Path) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def hf_reference(path: Path) -> Any:
    """transformers' model for a GGUF file: ``hf_from_gguf``, except that a
    file with a sliding window runs as ``MistralForCausalLM`` with that window.
    transformers' GGUF loader reads a llama-architecture file as Llama and has
    no key for ``llama.attention.sliding_window``, so it would silently attend
    to everything; the tensors are still the ones it dequantized from the file."""
    import transformers

    from meshnet_model.formats.gguf.checkpoint import GGUFFile

    loaded = hf_from_gguf(path)
    window = GGUFFile(path).get("llama.attention.sliding_window")
    if window is None:
        return loaded
    keys = loaded.config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "dtype"):
        keys.pop(key, None)
    config = transformers.MistralConfig(**{**keys, "sliding_window": int(window)})
    model = transformers.MistralForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    return model.eval()


def hf_greedy(model: Any, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ``generate``: the new tokens and the logits that
    chose each of them (``[steps, vocab]``: the prompt's last position, then
    every generated one but the last)."""
    import torch

    ids = torch.tensor([prompt])
    # No eos (an empty list: None would fall back to the model's own): a random
    # model may pick it, and both sides must then go on with plain argmax.
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=[],
                             do_sample=False, max_new_tokens=steps, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
    new = out.sequences[0, len(prompt) :].tolist()
    assert len(new) == steps
    return new, np.stack([step[0].numpy() for step in out.logits])


def write_k_quant_gguf(directory: Path, model: Model, seed: int = 0) -> Path:
    """The model's shapes as a "Q4_K_M"-like file: Q4_K matrices, Q6_K for the
    embedding, v and down projections (llama.cpp's mix), random K-quant bytes
    (no encoder exists in the gguf package), norms F32."""
    rng = np.random.default_rng(seed)
    encoded = {}
    for name, value in model.weights.items():
        if value.ndim != 2:
            continue
        rows, columns = value.shape
        six = name == "model.embed_tokens.weight" or name.endswith(
            ("v_proj.weight", "down_proj.weight")
        )
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / np.sqrt(columns)
        qtype = "Q6_K" if six else "Q4_K"
        encoded[name] = (random_k_quant(rows, columns, qtype, float(std), rng), qtype)
    path = directory / f"{model.kind}-q4_k_m.gguf"
    write_gguf(path, model.config, model.weights, vocab=vocab_for(model.kind),
               chat_template=CHAT_TEMPLATE, encoded=encoded)  # fmt: skip
    return path
