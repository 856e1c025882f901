"""A decoder's hyper-parameters, read from a Hugging Face ``config.json`` — fail-closed.

One numpy code path (``engines/numpy/model.py``) runs several Llama-shaped families with
small per-family switches (``FAMILIES``). Every key that changes the forward
pass in transformers' own modeling code for that family is read and honoured
exactly, or the config is refused with one line naming the key and its value;
keys that cannot change the math are listed in ``IGNORED_KEYS`` (and
docs/models.md says why). Keys nobody here knows are ignored, as transformers
ignores them for these families (its modeling code never reads them), except
the ones in ``FOREIGN_KEYS``: settings of *other* architectures whose presence
means the checkpoint's math is not the one its ``model_type`` names.

Both config layouts are read:

* classic (transformers 4.x): top-level ``rope_theta`` and ``rope_scaling``
  (``type`` or ``rope_type``);
* transformers 5: ``rope_parameters`` (``rope_type``, ``rope_theta``, the
  scaling fields), possibly nested per layer type (``{"full_attention": {...},
  "sliding_attention": {...}}``).

``ModelConfig.from_dict(raw, source=...)`` is the single entry point; the GGUF
reader builds a config.json-shaped dict and passes it here too, so the
validation is shared. ``LlamaConfig`` is the same class under its old name.

The families and their key sets are in ``families``, the rope settings in
``rope_config``; both stay importable from here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .families import (
    FAMILIES,
    FOREIGN_KEYS,
    IGNORED_KEYS,
    SUPPORTED_MODEL_TYPES,
    Family,
    family_of,
    refuse,
)
from .rope_config import RopeScaling, read_rope

__all__ = [
    "FAMILIES",
    "FOREIGN_KEYS",
    "IGNORED_KEYS",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "Family",
    "LlamaConfig",
    "ModelConfig",
    "RopeScaling",
]

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """What a ``*ForCausalLM`` of a supported family is built from (config.json names).

    ``layer_types``: per layer, "full_attention" or "sliding_attention" (None:
    all full); ``sliding_window`` applies to the sliding ones. ``no_rope_layers``:
    per layer 1 (rotate) or 0 (no rope), smollm3's convention (None: all rotate).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    torch_dtype: str | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    no_rope_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.model_type not in FAMILIES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 1):
            raise ConfigError(f"rope_theta must be > 1, got {self.rope_theta}")
        window = self.sliding_window
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1
        ):
            raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
        for name, allowed in (("layer_types", LAYER_TYPES), ("no_rope_layers", (0, 1))):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != self.num_hidden_layers:
                raise ConfigError(
                    f"{name} has {len(values)} entries for {self.num_hidden_layers} layers"
                )
            bad = [v for v in values if v not in allowed or isinstance(v, bool)]
            if bad:
                raise ConfigError(f"{name}: {bad[0]!r} is not one of {list(allowed)}")
        if self.layer_types and "sliding_attention" in self.layer_types and window is None:
            raise ConfigError("layer_types names sliding_attention layers but no sliding_window")
        sliding = self.family.sliding
        if (sliding == "none" and window is not None) or (
            sliding != "layer_types" and self.layer_types is not None
        ):
            raise ConfigError(f"model_type {self.model_type} has no per-layer sliding window")
        if self.no_rope_layers is not None and not self.family.no_rope_layers:
            raise ConfigError(f"model_type {self.model_type} rotates every layer (no_rope_layers)")

    # -- per-family and per-layer switches the forward pass reads ---------------------

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def kv_groups(self) -> int:
        """Query heads sharing one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.family.qkv_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (keys ``p - window < k <= p``), or None."""
        if self.family.sliding == "global":
            return self.sliding_window
        if self.layer_types is None:
            return None
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rotates(self, layer: int) -> bool:
        return self.no_rope_layers is None or bool(self.no_rope_layers[layer])

    # -- reading --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Validate a config.json-shaped dict; ``source`` names it in every error."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source} must hold a JSON object")
        family = family_of(raw, source)
        missing = [
            key
            for key in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "vocab_size",
            )
            if key not in raw
        ]
        if missing:
            raise ConfigError(f"{source} lacks {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        layers = raw["num_hidden_layers"]
        # Absent: the config class's default; null: derived (transformers'
        # __post_init__ for head_dim and num_key_value_heads alike).
        head_dim = raw.get("head_dim", family.default_head_dim)
        if head_dim is None:
            if (
                not isinstance(heads, int)
                or heads < 1
                or not isinstance(hidden, int)
                or (hidden % heads)
            ):
                raise ConfigError(
                    f"{source}: hidden_size ({hidden}) must be a multiple of "
                    f"num_attention_heads ({heads}) when head_dim is not given"
                )
            head_dim = hidden // heads
        try:
            theta, scaling = read_rope(raw, family, source)
            window, layer_types = _sliding(raw, family, layers, source)
            return cls(
                hidden_size=hidden,
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads", family.default_kv_heads)
                or heads,
                vocab_size=raw["vocab_size"],
                head_dim=head_dim,
                max_position_embeddings=raw.get(
                    "max_position_embeddings", family.default_max_positions
                ),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.default_tie)),
                attention_bias=family.honours_attention_bias
                and bool(raw.get("attention_bias", False)),
                mlp_bias=family.honours_mlp_bias and bool(raw.get("mlp_bias", False)),
                model_type=family.model_type,
                torch_dtype=raw.get("torch_dtype", raw.get("dtype")),
                sliding_window=window,
                layer_types=layer_types,
                no_rope_layers=_no_rope_layers(raw, family, layers, source),
            )
        except ConfigError as exc:
            message = str(exc)
            raise ConfigError(
                message if message.startswith(source) else f"{source}: {message}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> ModelConfig:
        path = Path(directory) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """A classic-layout config.json that ``from_dict`` reads back to an equal config."""
        out: dict[str, Any] = {
            "architectures": [self.family.architecture],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_dict(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "torch_dtype": self.torch_dtype,
        }
        sliding = self.family.sliding
        if sliding == "global":
            out["sliding_window"] = self.sliding_window
        elif sliding == "layer_types":
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            if self.layer_types is not None:
                out["layer_types"] = list(self.layer_types)
        if self.no_rope_layers is not None:
            out["no_rope_layers"] = list(self.no_rope_layers)
        return out


# The name the rest of the code base (and users) know it by.
LlamaConfig = ModelConfig


def _sliding(
    raw: dict[str, Any], family: Family, layers: Any, source: str
) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, layer_types) as the family's transformers config derives them."""
    if family.sliding == "none":
        # LlamaForCausalLM has no sliding window: transformers ignores the keys.
        return None, None
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise ConfigError(f"num_hidden_layers must be a positive integer, got {layers!r}")
    window = raw.get("sliding_window", family.default_sliding_window)
    if family.sliding == "global":
        # Mistral: one window for every layer; layer_types is not read (transformers
        # warns and ignores it, so do we).
        return window, None
    if not raw.get("use_sliding_window", False):
        window = None
    given = raw.get("layer_types")
    if given is not None:
        if not isinstance(given, list):
            raise refuse(source, "layer_types", given, "it must be a list")
        return window, tuple(given)
    if window is None:
        return None, None
    if family.no_rope_layers:  # smollm3: sliding exactly on the layers without rope
        rotates = _no_rope_layers(raw, family, layers, source) or (1,) * layers
        return window, tuple("full_attention" if r else "sliding_attention" for r in rotates)
    first = raw.get("max_window_layers", 28)
    return window, tuple(
        "sliding_attention" if i >= first else "full_attention" for i in range(layers)
    )


def _no_rope_layers(
    raw: dict[str, Any], family: Family, layers: int, source: str
) -> tuple[int, ...] | None:
    if not family.no_rope_layers:
        return None
    given = raw.get("no_rope_layers")
    if given is not None:
        if not isinstance(given, list):
            raise refuse(source, "no_rope_layers", given, "it must be a list")
        return tuple(given)
    interval = raw.get("no_rope_layer_interval", 4)
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise refuse(source, "no_rope_layer_interval", interval, "a positive integer")
    return tuple(int((i + 1) % interval != 0) for i in range(layers))
