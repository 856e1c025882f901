"""Choosing the next token from the last stage's logits: seeded, reproducible, O(vocab).

Temperature 0 is greedy (argmax, ties to the lowest id). Otherwise the
logits are divided by the temperature, cut to the ``top_k`` highest, then
to the smallest set whose probability reaches ``top_p`` (nucleus), and one
id is drawn with a ``numpy.random.Generator`` seeded from the request's
``seed``: the same seed, prompt and parameters give the same tokens.

Cost (issue 13): no full sort of the vocabulary per token. The ``top_k`` cut
is a partition (``np.partition``, O(vocab)) plus a sort of the k kept; the
nucleus grows a partitioned head of the distribution (64 ids, then x8, then all) until
it holds ``top_p`` of the mass — for the peaked distributions of a language
model the first head suffices. Ties are broken by id, exactly as a stable
sort would: the kept set does not depend on how the partition fell.

Numerics: the logits are shifted by their maximum *before* the division, so
``(logit - max) / T`` is 0 for the best ids and ≤ 0 for the rest whatever
the temperature: a tiny one (``1e-307``, ``5e-324``) sends every other value
to -inf — exactly the limit, greedy among equal maxima — and never makes an
inf - inf NaN. The probabilities are computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Sampler", "SamplingParams", "top_indices"]

_FIRST_HEAD = 64  # ids the nucleus search sorts first
_GROWTH = 8


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


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` largest ``values``, largest first, ties by index.

    The same as ``np.argsort(-values, kind="stable")[:k]``, in O(n + k log k).
    """
    n = values.size
    if k >= n:
        return np.argsort(-values, kind="stable")
    kth = np.partition(values, n - k)[n - k]  # the k-th largest value
    above = np.flatnonzero(values > kth)
    tied = np.flatnonzero(values == kth)[: k - above.size]  # lowest ids first
    chosen = np.concatenate((above, tied))
    return chosen[np.lexsort((chosen, -values[chosen]))]


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
        finite = np.isfinite(row)
        if not finite.any():
            raise ValueError("no finite logit to sample from")
        row = np.where(finite, row, -np.inf)
        params = self.params
        if params.temperature == 0.0:
            return int(np.argmax(row))
        candidates = np.flatnonzero(finite)
        values = row[candidates]
        with np.errstate(over="ignore", divide="ignore"):
            # Shift first: 0 for the best, <= 0 (down to -inf) for the rest.
            scaled = (values - values.max()) / params.temperature
        if params.top_k and params.top_k < candidates.size:
            keep = top_indices(scaled, params.top_k)
            candidates, scaled = candidates[keep], scaled[keep]
        probs = np.exp(scaled)
        probs /= probs.sum()  # >= 1 before: the best id contributes exp(0)
        if params.top_p < 1.0:
            candidates, probs = _nucleus(candidates, probs, params.top_p)
        return int(candidates[self._rng.choice(candidates.size, p=probs)])


def _nucleus(
    candidates: np.ndarray, probs: np.ndarray, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The smallest most-probable set reaching ``top_p``, renormalised."""
    head = min(_FIRST_HEAD, probs.size)
    while True:
        order = top_indices(probs, head)
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= top_p or head == probs.size:
            break
        # Past a quarter of the ids a partition no longer saves much: sort all.
        head = head * _GROWTH if head * _GROWTH * 4 < probs.size else probs.size
    # Keep every id up to and including the one that reaches top_p.
    cut = min(int(np.searchsorted(cumulative, top_p, side="left")) + 1, order.size)
    keep = order[:cut]
    kept = probs[keep]
    return candidates[keep], kept / kept.sum()
