"""Rotary position embeddings (RoPE) as transformers' ``LlamaForCausalLM`` does them.

Convention: "rotate half" (GPT-NeoX style), not interleaved pairs — the
head dimension's first half pairs with its second half::

    q' = q * cos + rotate_half(q) * sin,   rotate_half([a, b]) = [-b, a]

with ``cos``/``sin`` of ``position * inv_freq`` repeated over both halves.

Scaling variants (``rope_scaling`` in config.json) change ``inv_freq``, and
"yarn" also scales cos/sin by an attention factor:

* ``default`` (none): ``inv_freq[i] = theta ** (-2i / head_dim)``.
* ``linear``: ``inv_freq / factor`` (position interpolation).
* ``dynamic`` (dynamic NTK): past ``max_position_embeddings`` the base grows
  with the chunk's end position. As in transformers, the frequency of a
  forward depends on its longest position and cached keys keep the rotation
  they were made with — so beyond the trained length chunking changes the
  numbers; within it, dynamic is the default.
* ``llama3``: Llama 3.1's banded rescaling (low frequencies / factor, high
  kept, a smooth ramp between), from ``low_freq_factor``,
  ``high_freq_factor`` and ``original_max_position_embeddings``.
* ``yarn``: NTK-by-parts interpolation between the extrapolated and the
  interpolated frequencies (``beta_fast``/``beta_slow``), and cos/sin scaled by
  ``attention_factor`` (default ``0.1 * ln(factor) + 1``, or the ratio of the
  mscale terms when ``mscale``/``mscale_all_dim`` are given).

``inv_freq`` is derived in float64 and rounded to float32 once; the angles and
their cos/sin are float32, as transformers computes them. Every value depends
only on the absolute position, never on how a sequence was chunked (dynamic
beyond the trained length excepted, see above).
"""

from __future__ import annotations

import math

import numpy as np

from .formats.config import ModelConfig, RopeScaling

__all__ = ["Rope", "apply_rope", "rotate_half"]


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / (base**exponents)


def _llama3(inv_freq: np.ndarray, s: RopeScaling, max_positions: int) -> np.ndarray:
    old_context = s.original_max_position_embeddings or max_positions
    low_wavelen = old_context / s.low_freq_factor
    high_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, s: RopeScaling, max_positions: int) -> tuple[np.ndarray, float]:
    original = s.original_max_position_embeddings or max_positions
    factor = s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    inv = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv, attention


class Rope:
    """cos/sin tables for absolute positions, per a model's rope settings."""

    def __init__(self, config: ModelConfig) -> None:
        self.dim = config.head_dim
        self.base = config.rope_theta
        self.scaling = config.rope_scaling
        self.max_positions = config.max_position_embeddings
        kind = self.scaling.rope_type
        self.attention_factor = 1.0
        inv = _base_inv_freq(self.base, self.dim)
        if kind == "linear":
            inv = inv / self.scaling.factor
        elif kind == "llama3":
            inv = _llama3(inv, self.scaling, self.max_positions)
        elif kind == "yarn":
            inv, self.attention_factor = _yarn(
                self.base, self.dim, self.scaling, self.max_positions
            )
        self.inv_freq = inv.astype(np.float32)

    def _inv_freq_for(self, seq_len: int) -> np.ndarray:
        if self.scaling.rope_type != "dynamic" or seq_len <= self.max_positions:
            return self.inv_freq
        factor = self.scaling.factor
        grown = (factor * seq_len / self.max_positions) - (factor - 1)
        base = self.base * grown ** (self.dim / (self.dim - 2))
        return _base_inv_freq(base, self.dim).astype(np.float32)

    def cos_sin(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``cos`` and ``sin``, each ``[count, head_dim]``, for positions
        ``start .. start + count - 1``."""
        inv_freq = self._inv_freq_for(start + count)
        positions = np.arange(start, start + count, dtype=np.float32)
        angles = np.multiply.outer(positions, inv_freq)  # float32, as transformers
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = np.cos(angles), np.sin(angles)
        if self.attention_factor != 1.0:
            scale = np.float32(self.attention_factor)
            cos, sin = cos * scale, sin * scale
        return cos, sin


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate ``x`` ``[..., tokens, head_dim]`` by per-token ``cos``/``sin``."""
    rotated: np.ndarray = x * cos + rotate_half(x) * sin
    return rotated
