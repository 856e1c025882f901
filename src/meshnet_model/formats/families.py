"""The decoder families a config.json may name, and what its keys mean to
them: the per-family switches (``FAMILIES``), the keys that cannot change
the math (``IGNORED_KEYS``) and those of other architectures
(``FOREIGN_KEYS``). The reading itself is ``config.ModelConfig.from_dict``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

__all__ = [
    "FAMILIES",
    "FOREIGN_KEYS",
    "IGNORED_KEYS",
    "SUPPORTED_MODEL_TYPES",
    "Family",
    "family_of",
    "refuse",
]


@dataclass(frozen=True, slots=True)
class Family:
    """What differs between the supported families, as transformers builds them.

    Defaults are the transformers 5 config class's own, used when a key is
    absent (a missing key means the class default there, not "off").
    """

    model_type: str
    architecture: str  # the *ForCausalLM class name
    # Whether config.json's attention_bias / mlp_bias are honoured; where not,
    # the modeling code hard-codes no bias and the key is ignored by transformers.
    honours_attention_bias: bool = True
    honours_mlp_bias: bool = True
    qkv_bias: bool = False  # q/k/v always biased, o never (qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (qwen3)
    # "none": no sliding window; "global": ``sliding_window`` on every layer
    # (mistral); "layer_types": per layer, from ``layer_types`` (qwen2/3, smollm3).
    sliding: str = "none"
    default_sliding_window: int | None = None
    no_rope_layers: bool = False  # smollm3: some layers skip rope
    default_theta: float = 10000.0
    default_kv_heads: int | None = None  # None: num_attention_heads
    default_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    default_tie: bool = False
    default_max_positions: int = 2048


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family(
            "mistral",
            "MistralForCausalLM",
            honours_attention_bias=False,
            honours_mlp_bias=False,
            sliding="global",
            default_sliding_window=4096,
            default_kv_heads=8,
            default_max_positions=4096 * 32,
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            honours_attention_bias=False,
            honours_mlp_bias=False,
            qkv_bias=True,
            sliding="layer_types",
            default_sliding_window=4096,
            default_kv_heads=32,
            default_max_positions=32768,
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            honours_mlp_bias=False,
            qk_norm=True,
            sliding="layer_types",
            default_sliding_window=4096,
            default_kv_heads=32,
            default_head_dim=128,
            default_max_positions=32768,
        ),
        Family(
            "smollm3",
            "SmolLM3ForCausalLM",
            sliding="layer_types",
            no_rope_layers=True,
            default_theta=2000000.0,
            default_kv_heads=4,
            default_tie=True,
            default_max_positions=32768,
        ),
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# Keys that cannot change the forward pass of these families (why: docs/models.md).
IGNORED_KEYS = frozenset(
    {
        "attention_dropout",  # dropout is off at inference
        "initializer_range",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "unk_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "torch_dtype",
        "dtype",  # the safetensors say what is stored; compute is float32
        "transformers_version",
        "_name_or_path",
        "_model_name_or_path",
        "name_or_path",
        "pretraining_tp",  # transformers 5's Llama never reads it (4.x only split the same matmuls)
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_return_dict",
        "tokenizer_class",
        "id2label",
        "label2id",
        "problem_type",
        "task_specific_params",
        "finetuning_task",
        "prefix",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "_attn_implementation",
        "attn_implementation",
        "_from_model_config",
        "model_max_length",
        "max_length",
        "bad_words_ids",
        "num_beams",
        "temperature",
        "top_k",
        "top_p",
        "do_sample",
    }
)

# Settings of other architectures: where present, the checkpoint's math is not
# the named family's, and transformers would run it wrongly without a word.
FOREIGN_KEYS = frozenset(
    {
        "quantization_config",  # weights in a quantized layout this reader does not decode
        "auto_map",  # the model's math is in custom code shipped with it
        "embedding_multiplier",
        "residual_multiplier",
        "attention_multiplier",
        "logits_scaling",
        "logit_scale",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "query_pre_attn_scalar",
        "use_qk_norm",
        "qk_layernorm",
        "clip_qkv",
        "rope_interleaved",
        "rotary_interleaved",
        "parallel_attn",
        "parallel_residual",
        "use_parallel_residual",
        "num_experts",
        "num_local_experts",
        "moe_intermediate_size",
        "attention_chunk_size",
        "no_rope_layer_indices",
        "sandwich_norm",
        "use_post_norm",
    }
)


def refuse(source: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{source}: {key}={json.dumps(value, default=str)} is not supported: {why}")


def family_of(raw: dict[str, Any], source: str) -> Family:
    """The family ``raw`` names, refusing a config whose keys say its math is
    another's (a foreign key, other architectures, an activation not SiLU)."""
    model_type = raw.get("model_type", "llama")
    if model_type not in FAMILIES:
        raise refuse(
            source, "model_type", model_type, f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    family = FAMILIES[model_type]
    foreign = sorted(k for k in FOREIGN_KEYS if raw.get(k) not in (None, False))
    if foreign:
        key = foreign[0]
        raise refuse(
            source,
            key,
            raw[key],
            f"a setting {model_type} does not have "
            "(the checkpoint's math is not plain " + model_type + ")",
        )
    architectures = raw.get("architectures")
    if architectures is not None and architectures != [family.architecture]:
        raise refuse(
            source,
            "architectures",
            architectures,
            f"model_type {model_type} runs [{family.architecture!r}]",
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps both to SiLU
        raise refuse(source, "hidden_act", act, "only silu")
    return family
