"""Choosing the next token from the last stage's logits: seeded, reproducible, O(vocab).

The order is vLLM's (docs/openai-api.md#sampling): ``logit_bias`` is added;
the stop ids are masked while fewer than ``min_tokens`` tokens exist; the
penalties are applied (``repetition_penalty`` over the prompt's and the
generated ids, ``presence_penalty``/``frequency_penalty`` over the generated
ones); then temperature 0 is greedy (argmax, ties to the lowest id).
Otherwise the logits are divided by the temperature, cut by ``min_p``
(probability at least ``min_p`` times the best one's), to the ``top_k``
highest, then to the smallest set whose probability reaches ``top_p``
(nucleus), and one id is drawn.

The draw is a function of ``(seed, position)`` (wire-2 §3.13): the uniform
number that picks the id comes from a counter-based generator (Philox-4x64,
numpy's ``Philox``) keyed by the request's seed, its counter set to the
position of the token being drawn. No state carries from one token to the
next, so the gateway drawing from relayed logits and the last stage drawing
where the logits are made give the same token, and so does a replica that
replays the session after a failover. (Until issue 36 the gateway drew from
one ``numpy.random.Generator`` stream per request: a seed's text changed once,
then.)

A ``TokenConstraint`` (structured output, a forced tool call: the
gateway's grammar, ``meshnet_gateway.openai.grammar``) masks the ids its
grammar does not allow next, after the penalties, and is told every token
chosen; its state is a function of the tokens so far, so a replay that
chooses the same tokens leaves it in the same state.

``logprobs`` are the log-softmax of the *raw* logits, before any of that
(vLLM's default ``logprobs_mode``): the model's own distribution.

The history the penalties need is kept as arrays over the vocabulary,
updated per token in O(1) (a count and a seen flag) and applied in
O(vocab): no Python loop over the vocabulary or the history per token.

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

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "REPETITION_PENALTY",
    "Logprobs",
    "Sampler",
    "TokenConstraint",
    "SamplingParams",
    "distribution",
    "draw_generator",
    "log_softmax",
    "new_seed",
    "top_indices",
]

_FIRST_HEAD = 64  # ids the nucleus search sorts first
_GROWTH = 8
# What a logprob of -inf (a non-finite logit) is reported as: JSON has no
# infinity, and vLLM reports this value.
LOGPROB_FLOOR = -9999.0
# Bounded below too: a float32 logit divided by less than 0.01 could leave
# float64's range (+inf); values in use are 1.0-1.5.
REPETITION_PENALTY = (0.01, 10.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """What decides the next token, vLLM's ``SamplingParams`` in spirit.

    ``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` are here because the
    sampler masks the stop ids until ``min_tokens``; generation stops at
    ``Sampler.stop_ids``. ``logprobs``: None, or how many alternatives
    (``top_logprobs``) to report beside the chosen token's own logprob.
    """

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: no cut
    min_p: float = 0.0  # [0, 1]; 0: no cut
    repetition_penalty: float = 1.0  # REPETITION_PENALTY; 1: none
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) pairs
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # NaN fails too
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        low, high = REPETITION_PENALTY
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}]")
        for value in (self.presence_penalty, self.frequency_penalty):
            if not math.isfinite(value):
                raise ValueError("penalties must be finite")
        if self.min_tokens < 0 or (self.logprobs is not None and self.logprobs < 0):
            raise ValueError("min_tokens and logprobs must be >= 0")

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


class TokenConstraint(Protocol):
    """What may come next, by a grammar over the tokens chosen so far."""

    # The ids of the logits row a mask sent to the last stage covers.
    width: int

    def allowed(self, size: int) -> np.ndarray:
        """A bool mask over ``size`` ids: those the grammar allows next (at
        least one; an id past the tokenizer's vocabulary never is)."""
        ...

    def accept(self, token: int) -> None:
        """``token`` was chosen (always one ``allowed`` gave)."""
        ...


@dataclass(frozen=True, slots=True)
class Logprobs:
    """One chosen token's logprob and its ``top`` alternatives (id, logprob),
    most likely first, ties by id: numbers of the raw distribution."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def new_seed() -> int:
    """A seed for a request that gave none: fresh entropy, as OpenAI does
    (63 bits: any wire-2 sender and JSON reader holds it exactly as an int)."""
    return secrets.randbits(63)


def draw_generator(seed: int, position: int) -> np.random.Generator:
    """The generator of the draw for the token at ``position``: Philox keyed
    by ``seed``, its counter at ``position``. Counter-based: nothing depends
    on which tokens were drawn before, or where."""
    return np.random.Generator(np.random.Philox(key=seed, counter=position))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the finite logits; -inf for the others."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    finite = np.isfinite(row)
    row = np.where(finite, row, -np.inf)
    if not finite.any():
        return row
    peak = row.max()
    with np.errstate(under="ignore"):
        lse = peak + np.log(np.exp(row - peak).sum())
    shifted: np.ndarray = row - lse  # (numpy types an array minus a scalar as Any)
    return shifted


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
    """One request's sampler: its parameters, its own random stream and the
    token history the penalties and ``min_tokens`` need."""

    def __init__(
        self,
        params: SamplingParams,
        seed: int | None,
        constraint: TokenConstraint | None = None,
    ) -> None:
        self.params = params
        self.constraint = constraint
        # No seed: fresh entropy, as OpenAI does; with one, the same draws.
        self.seed = new_seed() if seed is None else seed
        self._prompt: list[int] = []
        self.generated = 0  # tokens chosen so far
        self._counts: np.ndarray | None = None  # per id: times generated
        self._seen: np.ndarray | None = None  # per id: in the prompt or generated
        self.stop_ids: frozenset[int] = params.stop_token_ids
        self.last: Logprobs | None = None  # the last choice's, if params.logprobs
        # Built once, used per token.
        self._bias_ids = np.asarray([i for i, _ in params.logit_bias], dtype=np.int64)
        self._bias = np.asarray([b for _, b in params.logit_bias], dtype=np.float64)
        self._stops = np.asarray(sorted(self.stop_ids), dtype=np.int64)

    def begin(self, prompt_ids: Sequence[int], eos_ids: Collection[int] = ()) -> None:
        """The prompt (for ``repetition_penalty``) and the model's eos ids,
        which stop the generation unless ``ignore_eos``; ``stop_token_ids``
        always do."""
        self._prompt = list(prompt_ids)
        eos = frozenset() if self.params.ignore_eos else frozenset(eos_ids)
        self.stop_ids = eos | self.params.stop_token_ids
        self._stops = np.asarray(sorted(self.stop_ids), dtype=np.int64)

    def __call__(self, logits: np.ndarray, position: int | None = None) -> int:
        """The next id from one position's logits (shape ``[vocab]``).

        ``position``: the new token's place in the session (how many tokens
        come before it), the draw's counter; by default the prompt's length
        plus the tokens chosen so far, which is that place for a generation
        this sampler follows from ``begin``."""
        if position is None:
            position = len(self._prompt) + self.generated
        raw = np.asarray(logits, dtype=np.float64).reshape(-1)
        if raw.size == 0:
            raise ValueError("empty logits")
        # A non-finite logit (a broken stage) must not poison the choice.
        finite = np.isfinite(raw)
        if not finite.any():
            raise ValueError("no finite logit to sample from")
        token = self.choose(self._adjust(np.where(finite, raw, -np.inf)), position)
        if self.params.logprobs is not None:
            self.last = self._logprobs(raw, token)
        self.advance(token, raw.size)
        return token

    @property
    def stateless(self) -> bool:
        """Whether the next draw needs nothing but the logits, the parameters
        and ``(seed, position)``, so that the stage that made the logits can
        draw it (wire-2 §3.13): no ``logit_bias``, no penalty (they need the
        history), no ``min_tokens`` mask still in force, a seed the wire
        carries (< 10**19)."""
        return self.constraint is None and self._history_free

    @property
    def masked_stateless(self) -> bool:
        """Whether the next draw needs nothing but the logits, the parameters,
        ``(seed, position)`` and this step's mask of the constraint (``mask``):
        the stage that made the logits can draw it, sent the mask (wire-2
        §3.13, ``X-Meshnet-Allow``); the grammar's state stays here."""
        return self.constraint is not None and self._history_free

    @property
    def _history_free(self) -> bool:
        params = self.params
        masking = self.generated < params.min_tokens and self._stops.size > 0
        return not (params.logit_bias or params.penalised or masking) and self.seed < 10**19

    def mask(self, size: int) -> bytes:
        """The constraint's mask of the next draw over ``size`` ids, one bit
        each, little-endian within a byte (wire-2 §3.13's ``X-Meshnet-Allow``)."""
        assert self.constraint is not None
        allowed = self.constraint.allowed(size)
        return np.packbits(allowed, bitorder="little").tobytes()

    def record(self, logprobs: Logprobs | None, token: int) -> None:
        """A token drawn elsewhere with this sampler's parameters while it was
        ``stateless`` or ``masked_stateless`` (the last stage, wire-2 §3.13),
        counted as if drawn here: the constraint told, no penalty history."""
        self.last = logprobs
        self.generated += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The logits the next choice is made from (float64; non-finite ones
        -inf): logit_bias, the min_tokens mask and the penalties applied, in
        vLLM's order, for the history so far."""
        row = np.asarray(logits, dtype=np.float64).reshape(-1)
        return self._adjust(np.where(np.isfinite(row), row, -np.inf))

    def _adjust(self, row: np.ndarray) -> np.ndarray:
        params = self.params
        size = row.size
        if params.logit_bias:
            inside = self._bias_ids < size  # an id past the logits cannot be chosen anyway
            np.add.at(row, self._bias_ids[inside], self._bias[inside])
        if self.generated < params.min_tokens and self._stops.size:
            row[self._stops[self._stops < size]] = -np.inf
        if params.penalised:
            counts, seen = self._history(size)
            if params.repetition_penalty != 1.0:
                # HF/vLLM: positive logits divided, negative ones multiplied.
                penalty = params.repetition_penalty
                picked = row[seen]
                row[seen] = np.where(picked > 0, picked / penalty, picked * penalty)
            if params.frequency_penalty != 0.0:
                row -= params.frequency_penalty * counts
            if params.presence_penalty != 0.0:
                row -= params.presence_penalty * (counts > 0)
        if self.constraint is not None:
            row[~self.constraint.allowed(size)] = -np.inf
        if not np.isfinite(row).any():
            raise ValueError("every id is masked (min_tokens or a grammar left nothing)")
        return row

    def _history(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        if self._counts is None or self._counts.size != size:
            self._counts = np.zeros(size, dtype=np.float64)
            self._seen = np.zeros(size, dtype=bool)
            prompt = np.asarray(self._prompt, dtype=np.int64)
            self._seen[prompt[(prompt >= 0) & (prompt < size)]] = True
        assert self._seen is not None
        return self._counts, self._seen

    def advance(self, token: int, size: int) -> None:
        """Count ``token`` as chosen (from ``size`` logits) and add it to the
        penalty history; ``__call__`` does this, and so does a verified
        speculative window (meshnet_model.speculative) for each token it emits."""
        self.generated += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.params.penalised:
            counts, seen = self._history(size)
            counts[token] += 1
            seen[token] = True

    def choose(self, row: np.ndarray, position: int) -> int:
        """The id drawn for ``position`` from ``adjusted`` logits, recording nothing."""
        if self.params.temperature == 0.0:
            return int(np.argmax(row))  # ties: the lowest id
        candidates, probs = distribution(row, self.params)
        rng = draw_generator(self.seed, position)
        return int(candidates[rng.choice(candidates.size, p=probs)])

    def _logprobs(self, raw: np.ndarray, token: int) -> Logprobs:
        logprobs = log_softmax(raw)
        count = min(self.params.logprobs or 0, logprobs.size)
        top = top_indices(logprobs, count) if count else np.zeros(0, dtype=np.int64)
        return Logprobs(
            token=token,
            logprob=_reported(logprobs[token]),
            top=tuple((int(i), _reported(logprobs[i])) for i in top),
        )


def distribution(row: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """What a draw at ``params.temperature`` > 0 chooses among: the kept ids,
    in the order the draw indexes them, and their probabilities (float64,
    sum 1), from ``adjusted`` logits: temperature, min_p, top_k, top_p."""
    candidates = np.flatnonzero(np.isfinite(row))
    values = row[candidates]
    with np.errstate(over="ignore", divide="ignore"):
        # Shift first: 0 for the best, <= 0 (down to -inf) for the rest.
        scaled = (values - values.max()) / params.temperature
    if params.min_p > 0.0:
        # p / p_max = exp(scaled): keep those at least min_p of the best.
        keep = np.flatnonzero(scaled >= math.log(params.min_p))
        candidates, scaled = candidates[keep], scaled[keep]
    if params.top_k and params.top_k < candidates.size:
        keep = top_indices(scaled, params.top_k)
        candidates, scaled = candidates[keep], scaled[keep]
    probs = np.exp(scaled)
    probs /= probs.sum()  # >= 1 before: the best id contributes exp(0)
    if params.top_p < 1.0:
        candidates, probs = _nucleus(candidates, probs, params.top_p)
    return candidates, probs


def _reported(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


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
