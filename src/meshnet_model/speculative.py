"""Verifying a drafted window: which drafted tokens the target accepts (issue 38).

A verify window is one chunk ``[last accepted token, d1..dk]``; the last
stage makes its ``k + 1`` rows of logits, row ``i`` the distribution after
the first ``i + 1`` of those tokens, so row ``i`` decides the token at
``start_position + i`` (``start_position``: d1's place in the session, the
chunk's position plus one). The result is the accepted drafts, then one
token of the target's own: the correction at the first rejected row, or the
bonus token from row ``k`` when all ``k`` were accepted. Its prefix shared
with the drafts is what was accepted; the token after it never equals the
draft it replaced, so that length is unambiguous (the KV keeps ``last`` and
those drafts, and drops the rest, before the next window).

**Point-mass drafts** (prompt lookup, no ``draft_probs``): each row draws
its token exactly as the plain sampler does at that position
(``Sampler.choose``: the same adjusted logits, the same draw from
``Philox(key=seed, counter=position)``), and the draft is accepted iff the
draw equals it. For q = δ(d) this *is* the speculative-sampling rule of
Leviathan et al. 2023 / Chen et al. 2023 in law — d is accepted with
probability p(d), and a rejection is distributed as norm(max(0, p - q)), p
without d — coupled to the plain draw, so the output is token for token the
non-speculative output for the same seed: temperature 0 (argmax, ties to
the lowest id) and any temperature alike, whatever the drafts, wherever a
window is cut, after a replay or a failover, and with speculation off.

**Draft distributions** (``draft_probs``, a draft model's rows q): the
general rule. d is accepted if ``u < p(d) / q(d)`` (so with probability
min(1, p/q)); on rejection one id is drawn from norm(max(0, p - q)) over
the ids p keeps. p is the plain sampler's distribution after
temperature/min_p/top_k/top_p (``sampling.distribution``). The output is
distributed as the target's, but not equal to the plain draws.

**Random streams.** Every number is a pure function of ``(seed, position)``
of the token being decided, from Philox-4x64 keyed by the seed. Sub-stream
``tag`` at ``position`` is the counter ``position + tag * 2**128``: tag 0 is
the plain draw (``sampling.draw_generator``: point-mass verification and
the bonus token), tag 1 (``ACCEPT_STREAM``) the acceptance uniform and
tag 2 (``RESIDUAL_STREAM``) the residual draw. Tags sit in the third
counter word, which a stream's own blocks (the low word counting up from a
position < 2**64) never reach, so no two sub-streams of any positions share
a block: the acceptance and the residual are independent of each other
and of every plain draw. A window replayed with the same logits and drafts
decides identically.

**History.** Everything the plain sampler applies is applied row by row
with the window's own history: the sampler passed in is advanced by each
emitted token (``Sampler.advance``) before the next row is adjusted, so
row ``i`` sees the history plus d1..di — ``logit_bias``, the
``min_tokens`` mask of the stop ids, and the repetition/presence/frequency
penalties behave exactly as in plain decoding. A stop id (``stop_ids``)
ends the window after it, as it ends a plain generation. Not here:
``logprobs`` (``sampler.last`` is left alone; they are the log-softmax of
the raw rows, ``sampling.log_softmax``) and ``max_tokens`` (the caller cuts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .sampling import Sampler, SamplingParams, distribution

__all__ = ["ACCEPT_STREAM", "RESIDUAL_STREAM", "substream", "verify_greedy", "verify_sampled"]

ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2
_TAG_SHIFT = 128  # the tag in the counter's third 64-bit word
_GREEDY = SamplingParams(temperature=0.0)


def substream(seed: int, position: int, tag: int) -> np.random.Generator:
    """Sub-stream ``tag`` of the draws for the token at ``position``; tag 0
    is ``sampling.draw_generator(seed, position)`` itself."""
    return np.random.Generator(np.random.Philox(key=seed, counter=position + (tag << _TAG_SHIFT)))


def verify_greedy(logits: np.ndarray, drafts: Sequence[int]) -> list[int]:
    """Greedy verification of raw logits ``[k + 1, vocab]`` against ``k``
    drafts: the drafts that equal the argmax of the row before them (ties
    to the lowest id, as the plain greedy sampler), then the argmax of the
    next row. Token for token what greedy decoding gives."""
    return verify_sampled(logits, drafts, Sampler(_GREEDY, 0), start_position=0)


def verify_sampled(
    logits: np.ndarray,
    drafts: Sequence[int],
    sampler: Sampler,
    start_position: int,
    draft_probs: np.ndarray | None = None,
) -> list[int]:
    """The window's tokens under ``sampler`` (its parameters, seed and
    history), which is advanced by each of them as if it had drawn them.

    ``logits``: ``[k + 1, vocab]`` raw rows (non-finite values are -inf, as
    in plain decoding); ``drafts``: the ``k`` drafted ids; ``draft_probs``:
    None for point-mass drafts, else ``[k, vocab]`` draft probabilities
    (normalised per row here) under which each draft has probability > 0.
    Bad shapes or values raise ValueError before anything is decided (a row
    that ``min_tokens`` leaves no id in raises at that row, as plain decoding
    does, after the rows before it have advanced the sampler)."""
    rows, drafted = _checked(logits, drafts, start_position)
    q_rows = None if draft_probs is None else _draft_rows(draft_probs, drafted, rows.shape[1])
    tokens: list[int] = []
    for i, row in enumerate(rows):
        position = start_position + i
        adjusted = sampler.adjusted(row)
        if i == len(drafted) or q_rows is None or sampler.params.temperature == 0.0:
            # Greedy with a draft model comes here too: p is a point mass, so
            # min(1, p/q) accepts exactly the argmax and the residual is it.
            token = sampler.choose(adjusted, position)
        else:
            token = _accept_or_resample(adjusted, sampler, position, drafted[i], q_rows[i])
        sampler.advance(token, row.size)
        tokens.append(token)
        if i == len(drafted) or token != drafted[i] or token in sampler.stop_ids:
            break
    return tokens


def _accept_or_resample(
    adjusted: np.ndarray, sampler: Sampler, position: int, draft: int, q_row: np.ndarray
) -> int:
    candidates, probs = distribution(adjusted, sampler.params)
    at = np.flatnonzero(candidates == draft)
    p_draft = float(probs[at[0]]) if at.size else 0.0
    uniform = substream(sampler.seed, position, ACCEPT_STREAM).random()
    if uniform * q_row[draft] < p_draft:  # u < p/q, without dividing
        return draft
    # Rejected: q(d) > p(d), so the residual is 0 at d and has mass elsewhere.
    residual = np.maximum(probs - q_row[candidates], 0.0)
    total = residual.sum()
    if not total > 0.0:
        # Only rounding (p == q but at d) gets here: p without d, still != d.
        residual = np.where(candidates == draft, 0.0, probs)
        total = residual.sum()
    rng = substream(sampler.seed, position, RESIDUAL_STREAM)
    return int(candidates[rng.choice(candidates.size, p=residual / total)])


def _checked(
    logits: np.ndarray, drafts: Sequence[int], start_position: int
) -> tuple[np.ndarray, list[int]]:
    rows = np.asarray(logits, dtype=np.float64)
    drafted = [int(d) for d in drafts]
    if rows.ndim != 2 or rows.shape[0] != len(drafted) + 1 or rows.shape[1] == 0:
        raise ValueError(f"logits must be [{len(drafted) + 1}, vocab], got {rows.shape}")
    if not all(0 <= d < rows.shape[1] for d in drafted):
        raise ValueError("a drafted id is outside the vocabulary")
    if not np.isfinite(rows).any(axis=1).all():
        raise ValueError("no finite logit to sample from")
    if start_position < 0:
        raise ValueError("start_position must be >= 0")
    return rows, drafted


def _draft_rows(draft_probs: np.ndarray, drafted: list[int], vocab: int) -> np.ndarray:
    q = np.asarray(draft_probs, dtype=np.float64)
    if q.shape != (len(drafted), vocab):
        raise ValueError(f"draft_probs must be [{len(drafted)}, {vocab}], got {q.shape}")
    if not (np.isfinite(q).all() and (q >= 0.0).all()):
        raise ValueError("draft_probs must be finite and >= 0")
    totals = q.sum(axis=1, keepdims=True)
    if not (totals > 0.0).all():
        raise ValueError("a draft_probs row has no mass")
    normalised: np.ndarray = q / totals
    if not all(normalised[i, d] > 0.0 for i, d in enumerate(drafted)):
        raise ValueError("a draft has probability 0 under its own draft_probs row")
    return normalised
