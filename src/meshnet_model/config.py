"""The Llama family's hyper-parameters, read from a Hugging Face ``config.json``.

Only what the forward pass needs is kept, validated once here so that the
numeric code never meets a surprise (a head count that does not divide the
hidden size, a rope scaling it cannot honour). Unknown keys are ignored, as
transformers does; an architecture this package does not implement is
refused by name rather than run wrongly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SUPPORTED_MODEL_TYPES", "ConfigError", "LlamaConfig", "RopeScaling"]

# model_type values whose forward pass is exactly the one in ``llama.py``.
SUPPORTED_MODEL_TYPES = ("llama",)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ConfigError(ValueError):
    """A config.json this package cannot run, with the reason."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """``rope_scaling`` of config.json; ``rope_type`` "default" means none.

    Fields not used by a type keep their defaults. ``original_max_position_embeddings``
    is None when the config does not give it (the model's
    ``max_position_embeddings`` stands in, as transformers does).
    """

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RopeScaling:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"rope_scaling must be an object or null, got {raw!r}")
        # Older configs say "type", newer "rope_type"; "su"/"longrope" etc. are refused.
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ConfigError(
                f"rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        factor = float(raw.get("factor", 1.0))
        if kind != "default" and not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(f"rope_scaling factor must be >= 1, got {factor}")
        original = raw.get("original_max_position_embeddings")

        def opt_float(key: str) -> float | None:
            value = raw.get(key)
            return None if value is None else float(value)

        scaling = cls(
            rope_type=kind,
            factor=factor,
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=None if original is None else int(original),
            attention_factor=opt_float("attention_factor"),
            beta_fast=float(raw.get("beta_fast") or 32.0),
            beta_slow=float(raw.get("beta_slow") or 1.0),
            mscale=opt_float("mscale"),
            mscale_all_dim=opt_float("mscale_all_dim"),
            truncate=bool(raw.get("truncate", True)),
        )
        if kind == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor:
            raise ConfigError("rope_scaling llama3: high_freq_factor must exceed low_freq_factor")
        return scaling

    def to_dict(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """What ``LlamaForCausalLM`` is built from (names as in config.json)."""

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

    @property
    def kv_groups(self) -> int:
        """Query heads sharing one key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        missing = [
            key
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "vocab_size")
            if key not in raw
        ]  # fmt: skip
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if not isinstance(heads, int) or heads < 1 or hidden % heads:
                raise ConfigError(
                    f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
                    "when head_dim is not given"
                )
            head_dim = hidden // heads
        try:
            return cls(
                hidden_size=hidden,
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads") or heads,
                vocab_size=raw["vocab_size"],
                head_dim=head_dim,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=RopeScaling.from_dict(raw.get("rope_scaling")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                model_type=model_type,
                torch_dtype=raw.get("torch_dtype"),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config.json: {exc}") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> LlamaConfig:
        path = Path(directory) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path} does not exist") from None
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """A config.json that ``from_dict`` reads back to an equal config."""
        return {
            "architectures": ["LlamaForCausalLM"],
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
