"""Rotary position embedding settings of a config.json (both layouts, see
``config``): the rope variant and its fields (``RopeScaling``), and theta.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ConfigError
from .families import Family, refuse

__all__ = ["ROPE_TYPES", "RopeScaling", "read_rope"]

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Fields a rope dict may carry for the types above (longrope's short/long
# factors, mrope sections and the like are refused with their key).
_ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "partial_rotary_factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "low_freq_factor",
        "high_freq_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    }
)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """The rope variant and its fields; ``rope_type`` "default" means none.

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
    def from_dict(cls, raw: dict[str, Any] | None, *, source: str = "config.json") -> RopeScaling:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object or null, got {raw!r}")
        # Older configs say "type", newer "rope_type"; "su"/"longrope" etc. are refused.
        kind = raw.get("rope_type", raw.get("type", "default"))
        if kind not in ROPE_TYPES:
            raise refuse(source, "rope_type", kind, f"supported: {', '.join(ROPE_TYPES)}")
        unknown = sorted(set(raw) - _ROPE_KEYS)
        if unknown:
            raise refuse(
                source,
                f"rope {unknown[0]}",
                raw[unknown[0]],
                "not a field of the supported rope types",
            )
        partial = raw.get("partial_rotary_factor")
        if partial is not None and partial != 1.0:
            raise refuse(
                source, "partial_rotary_factor", partial, "these families rotate the whole head"
            )
        try:
            factor = float(raw.get("factor", 1.0))
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
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: rope parameters: {exc}") from None
        if kind != "default" and not (math.isfinite(factor) and factor >= 1.0):
            raise refuse(source, "rope factor", factor, "it must be >= 1")
        if kind == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor:
            raise ConfigError(
                f"{source}: rope llama3: high_freq_factor must exceed low_freq_factor"
            )
        return scaling

    def to_dict(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        out = {k: v for k, v in asdict(self).items() if v is not None}
        return out


def read_rope(raw: dict[str, Any], family: Family, source: str) -> tuple[float, RopeScaling]:
    """(theta, scaling) from either layout, with transformers' precedence:
    ``rope_scaling`` when set, else ``rope_parameters``; theta from that dict,
    else the top-level ``rope_theta``, else the family's default."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object or null, got {params!r}")
    params = dict(params or {})
    layer_types = raw.get("layer_types") or ()
    nested = [k for k in params if k in layer_types]
    if nested:
        # Per-layer-type rope (transformers 5). These families' rotary module
        # reads one dict, so only identical entries can run as transformers does.
        entries = [params[k] for k in nested]
        if any(e != entries[0] for e in entries) or set(params) != set(nested):
            why = "different rope per layer type is not a feature of these families"
            raise refuse(source, "rope_parameters", params, why)
        params = dict(entries[0] or {})
    top_partial = raw.get("partial_rotary_factor")
    if top_partial is not None:
        params.setdefault("partial_rotary_factor", top_partial)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", family.default_theta)
    try:
        theta = float(theta)
    except (TypeError, ValueError):
        raise refuse(source, "rope_theta", theta, "it must be a number") from None
    return theta, RopeScaling.from_dict(params, source=source)
