"""The numpy engine against transformers itself, family by family.

Each variant is a small random model built by transformers (hidden 64, 3
layers, GQA), saved in the transformers-5 layout and in the classic one; the
engine's greedy tokens over 40 steps must equal transformers' ``generate``,
and every step's logits agree within ``LOGIT_TOLERANCE`` — through 1, 2 and 3
stages, the prompt sent in chunks (chunked prefill) and then one token per run
(the KV cache). Windows are smaller than the generated length, so a sliding
window done wrongly in the cache or the chunking shows.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import transformers

from meshnet_model import ConfigError, ModelConfig
from meshnet_model.formats.config import FOREIGN_KEYS, IGNORED_KEYS
from meshnet_node.model_chain import ModelSession, start_model_chain
from meshnet_runtime.downstream import DownstreamPool
from support.reference import (
    HIDDEN,
    LAYERS,
    LOGIT_TOLERANCE,
    VARIANTS,
    VOCAB,
    build_model,
    chain_generate,
    logit_error,
    reference_generate,
    save,
)

STEPS = 40
SPLITS = {
    1: [(0, LAYERS)],
    2: [(0, 1), (1, LAYERS)],
    3: [(0, 1), (1, 2), (2, LAYERS)],
}


@pytest.mark.parametrize("layout", ["transformers5", "classic"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_decode_equals_transformers_through_1_2_3_stages(
    tmp_path: Path, variant: str, layout: str
) -> None:
    model = build_model(variant)
    directory = save(model, tmp_path / variant, classic=layout == "classic")
    raw = json.loads((directory / "config.json").read_text())
    assert ("rope_parameters" in raw) == (layout == "transformers5")
    prompt = [(7 * i + 3) % VOCAB for i in range(11)]
    want_ids, want_logits = reference_generate(model, prompt, STEPS)
    assert len(set(want_ids)) >= 5, f"degenerate reference: {want_ids}"  # not one token
    for stages, splits in SPLITS.items():
        ids, logits = chain_generate(directory, splits, prompt, STEPS)
        assert ids == want_ids, f"{stages} stage(s)"
        error = logit_error(logits, want_logits)
        assert error <= LOGIT_TOLERANCE, f"{stages} stage(s): logits off by {error:.2e}"


def test_both_layouts_read_to_the_same_config(tmp_path: Path) -> None:
    for variant in VARIANTS:
        model = build_model(variant)
        new = ModelConfig.from_dir(save(model, tmp_path / f"{variant}-5", classic=False))
        old = ModelConfig.from_dir(save(model, tmp_path / f"{variant}-4", classic=True))
        assert new.rope_theta == old.rope_theta and new.rope_scaling == old.rope_scaling
        assert [new.layer_window(i) for i in range(LAYERS)] == [
            old.layer_window(i) for i in range(LAYERS)
        ]
        want = getattr(model.config, "head_dim", None) or HIDDEN // 4
        assert new.head_dim == old.head_dim == want


def test_the_rope_base_of_rope_parameters_is_honoured(tmp_path: Path) -> None:
    # The silent failure: transformers 5 moved rope_theta into
    # rope_parameters and the reader fell back to 10000.
    model = build_model("llama")
    config = ModelConfig.from_dir(save(model, tmp_path / "m", classic=False))
    assert config.rope_theta == 5e5


def test_refused_keys_name_the_key_and_value(tmp_path: Path) -> None:
    model = build_model("qwen3")
    directory = save(model, tmp_path / "q", classic=False)
    base = json.loads((directory / "config.json").read_text())
    # key: value -> what the one-line refusal must show
    refused = {
        "hidden_act": ("gelu", 'hidden_act="gelu"'),
        "quantization_config": ({"quant_method": "gptq"}, 'quantization_config={"quant_method"'),
        "auto_map": ({"AutoModelForCausalLM": "x.Y"}, "auto_map="),
        "partial_rotary_factor": (0.5, "partial_rotary_factor=0.5"),
        "rope_parameters": ({"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0,
                             "short_factor": [1.0], "long_factor": [1.0]},
                            'rope_type="longrope"'),
        "logits_scaling": (4.0, "logits_scaling=4.0"),
        "model_type": ("gemma", 'model_type="gemma"'),
        "architectures": (["Qwen3ForSequenceClassification"],
                          'architectures=["Qwen3ForSequenceClassification"]'),
        "layer_types": (["full_attention", "chunked_attention", "full_attention"],
                        "'chunked_attention'"),
        "rope_scaling": ({"rope_type": "linear", "factor": 2.0, "mrope_section": [1]},
                         "rope mrope_section=[1]"),
        "sliding_window": (-3, "sliding_window"),
    }  # fmt: skip
    for key, (value, shown) in refused.items():
        with pytest.raises(ConfigError) as info:
            extra = {"use_sliding_window": True} if key == "sliding_window" else {}
            ModelConfig.from_dict({**base, **extra, key: value}, source="m/config.json")
        message = str(info.value)
        assert message.startswith("m/config.json: ") and "\n" not in message
        assert shown in message, (key, message)
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    with pytest.raises(ConfigError, match="rope_parameters"):
        ModelConfig.from_dict({**base, "layer_types": ["full_attention", "sliding_attention",
                                                       "full_attention"],
                               "use_sliding_window": True, "sliding_window": 4,
                               "rope_parameters": nested})  # fmt: skip


def test_ignored_keys_do_not_change_the_config(tmp_path: Path) -> None:
    model = build_model("llama")
    raw = json.loads((save(model, tmp_path / "m", classic=False) / "config.json").read_text())
    plain = ModelConfig.from_dict(raw)
    noisy = ModelConfig.from_dict(
        {**raw, "attention_dropout": 0.1, "pretraining_tp": 2, "initializer_range": 0.5,
         "use_cache": False, "dtype": "bfloat16", "some_future_key": 3}
    )  # fmt: skip
    assert noisy.rope_theta == plain.rope_theta and noisy.to_dict() | {"torch_dtype": None} == (
        plain.to_dict() | {"torch_dtype": None}
    )


def test_every_ignored_key_leaves_the_config_alone_and_every_foreign_key_is_refused(
    tmp_path: Path,
) -> None:
    raw = json.loads((save(build_model("qwen3"), tmp_path / "m", classic=False)
                      / "config.json").read_text())  # fmt: skip
    plain = ModelConfig.from_dict(raw)
    for key in sorted(IGNORED_KEYS):
        changed = ModelConfig.from_dict({**raw, key: 0.25})
        assert replace(changed, torch_dtype=None) == replace(plain, torch_dtype=None), key
    for key in sorted(FOREIGN_KEYS):
        with pytest.raises(ConfigError, match=f"{key}=0.25 is not supported"):
            ModelConfig.from_dict({**raw, key: 0.25})


def test_family_defaults_are_transformers_defaults() -> None:
    # 32 heads: every family's default KV head count divides it.
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 32, "vocab_size": 96}  # fmt: skip
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "smollm3"):
        ours = ModelConfig.from_dict({**base, "model_type": model_type})
        theirs = transformers.AutoConfig.for_model(model_type, **base)
        assert ours.num_key_value_heads == theirs.num_key_value_heads, model_type
        assert ours.head_dim == (getattr(theirs, "head_dim", None) or 2), model_type
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings, model_type
        assert ours.max_position_embeddings == theirs.max_position_embeddings, model_type
        nulls = ModelConfig.from_dict({**base, "model_type": model_type,
                                       "num_key_value_heads": None})  # fmt: skip
        assert nulls.num_key_value_heads == 32, model_type  # null: all heads, as __post_init__
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"], model_type
        window = getattr(theirs, "sliding_window", None)
        types = getattr(theirs, "layer_types", None) or ["full_attention"] * 2
        want = [window if model_type == "mistral" or t == "sliding_attention" else None
                for t in types]  # fmt: skip
        assert [ours.layer_window(i) for i in range(2)] == want, model_type
    # Mistral without the key: transformers' 4096, not "no window".
    assert ModelConfig.from_dict({**base, "model_type": "mistral"}).layer_window(0) == 4096
    assert ModelConfig.from_dict({**base, "model_type": "qwen3"}).head_dim == 128
    # rope_scaling wins over rope_parameters, as in transformers' reader.
    both = ModelConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0},
                                  "rope_parameters": {"rope_type": "default",
                                                      "rope_theta": 7e4}})  # fmt: skip
    assert both.rope_scaling.rope_type == "linear" and both.rope_theta == 1e4


def test_nested_identical_rope_parameters_run_as_one(tmp_path: Path) -> None:
    model = build_model("qwen2-window")
    raw = json.loads((save(model, tmp_path / "m", classic=False) / "config.json").read_text())
    flat = ModelConfig.from_dict(raw)
    entry = dict(raw["rope_parameters"])
    nested = ModelConfig.from_dict(
        {**raw, "rope_parameters": {"full_attention": entry, "sliding_attention": entry}}
    )
    assert nested == flat


@pytest.mark.anyio
@pytest.mark.parametrize("variant", ["qwen3", "mistral-window"])
async def test_over_loopback_nodes_the_tokens_are_transformers(
    tmp_path: Path, variant: str
) -> None:
    """The same check through 3 real nodes over sockets (wire 2, the session's
    KV cache on each node), the prompt in chunks of 4."""
    model = build_model(variant)
    directory = save(model, tmp_path / variant, classic=False)
    prompt = [(5 * i + 1) % VOCAB for i in range(13)]
    want_ids, want_logits = reference_generate(model, prompt, STEPS)
    async with start_model_chain(directory, SPLITS[3], extra=["--log-level", "warning"]) as nodes:
        pool = DownstreamPool(nodes[0].url)
        try:
            session = ModelSession(pool)
            logits = await session.run(np.asarray([prompt], np.int32), chunk_tokens=4)
            ids, rows = [], []
            for _ in range(STEPS):
                rows.append(logits[0])
                ids.append(int(np.argmax(logits[0])))
                logits = await session.decode(ids[-1])
            await session.delete()
        finally:
            await pool.aclose()
    assert ids == want_ids
    assert logit_error(np.stack(rows), want_logits) <= LOGIT_TOLERANCE
