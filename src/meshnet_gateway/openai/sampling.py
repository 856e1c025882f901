"""Choosing the next token from the last stage's logits: seeded, reproducible.

Temperature 0 is greedy (argmax, ties to the lowest id). Otherwise the
logits are divided by the temperature, cut to the ``top_k`` highest, then
to the smallest set whose probability reaches ``top_p`` (nucleus), and one
id is drawn with a ``numpy.random.Generator`` seeded from the request's
``seed``: the same seed, prompt and parameters give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: no cut

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # NaN fails too
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


class Sampler:
    """One request's sampler: its parameters and its own random stream."""

    def __init__(self, params: SamplingParams, seed: int | None) -> None:
        self.params = params
        # No seed: fresh entropy, as OpenAI does; with one, a fixed stream.
        self._rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        """The next id from one position's logits (shape ``[vocab]``)."""
        row = np.asarray(logits, dtype=np.float64).reshape(-1)
        if row.size == 0:
            raise ValueError("empty logits")
        # A non-finite logit (a broken stage) must not poison the choice.
        row = np.where(np.isfinite(row), row, -np.inf)
        if not np.isfinite(row).any():
            raise ValueError("no finite logit to sample from")
        params = self.params
        if params.temperature == 0.0:
            return int(np.argmax(row))
        scaled = row / params.temperature
        candidates = np.flatnonzero(np.isfinite(scaled))
        values = scaled[candidates]
        if params.top_k and params.top_k < candidates.size:
            # Stable sort: equal logits keep id order, so the cut is deterministic.
            keep = np.argsort(-values, kind="stable")[: params.top_k]
            candidates, values = candidates[keep], values[keep]
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # Keep every id up to and including the one that reaches top_p.
            cut = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
            keep = order[:cut]
            candidates, probs = candidates[keep], probs[keep]
            probs = probs / probs.sum()
        return int(candidates[self._rng.choice(candidates.size, p=probs)])
