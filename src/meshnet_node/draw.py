"""The last stage draws the token (wire-2 §3.13): what a sampled chunk is answered.

A chunk with ``X-Meshnet-Sample`` asks the node that answers it to turn its
stage's logits (``[1, vocab]``) into the next token here, where they are
made, and to answer the id instead of the row: 4 bytes up the chain instead
of ``vocab * 4`` (SmolLM2: 192 KiB a token and hop). The draw is
``meshnet_model.sampling``'s, the gateway's own: a function of the logits,
the parameters and ``(seed, position)``, so the gateway drawing from relayed
logits, this node drawing, and a replica replaying the session after a
failover all pick the same token.

The answer (wire-2 §3.13): without ``logprobs``, int32 ``[1, 1]``, the id;
with ``logprobs=k``, float32 ``[1, 2 + 2k]``: the id, its logprob, then the
``k`` most likely (id, logprob) pairs (ids are exact in float32 below 2**24,
which every vocabulary is: ``draw_answer`` refuses a wider row).

With ``X-Meshnet-Allow`` (the sender's grammar: structured output, a
forced tool call) the draw chooses among the ids its mask sets, exactly as
the sender's own sampler would with the same mask: the logits still never
leave this node. A mask that is not one bit per id of the row, or that
leaves no finite logit, is answered with the logits as they are, and the
sender draws (it holds the grammar: §3.13).

A verify window (wire-2 §3.16, ``verify_answer``): the stage made the
``k + 1`` rows ``[1, k + 1, vocab]`` of a chunk ``[t, d1 … dk]``; each row
draws as above at its own position and a draft stands while the draw equals
it (``meshnet_model.speculative.verify_sampled``), so the tokens are those
plain decoding draws. The answer: int32 ``[1, n]``, or one logprobs row per
token, float32 ``[n, 2 + 2k]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet_model.sampling import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingParams,
    log_softmax,
    top_indices,
)
from meshnet_model.speculative import verify_sampled
from meshnet_proto import ErrorCode, ProtocolError
from meshnet_proto.lowlevel import SampleSpec

__all__ = ["MAX_SAMPLED_VOCAB", "check_sampled_head", "draw_answer", "mask_of", "verify_answer"]

# Ids travel exactly in a float32 answer up to here.
MAX_SAMPLED_VOCAB = 2**24


def _refuse(message: str) -> ProtocolError:
    return ProtocolError(message, code=ErrorCode.BAD_SAMPLE, header="x-meshnet-sample")


def check_sampled_head(output: str) -> None:
    """Before the body: a sampled chunk this node answers must make logits.
    ``output``: the stage identity's — ``logits`` (a model's last stage),
    ``hidden`` (refused here, before anything changes) or ``any`` (a stub
    stage, whose output is known only once it ran: ``draw_answer`` checks it)."""
    if output == "hidden":
        raise _refuse("x-meshnet-sample: this node's stage answers hidden states, not logits")


def draw_answer(logits: np.ndarray, spec: SampleSpec, position: int) -> np.ndarray:
    """The answer to a sampled chunk whose stage made ``logits``; ``position``
    is the drawn token's place in the session (the tokens before it).

    ``ProtocolError`` 400 ``bad_sample`` for an output that is no row of
    logits (a stub's). A row without a finite logit (a broken stage) is
    answered as it is: the sender, which accepts logits to a sampled chunk
    (wire-2 §3.13), finds it cannot draw from them and says so (502)."""
    if logits.ndim != 2 or logits.shape[0] != 1 or not 0 < logits.shape[1] < MAX_SAMPLED_VOCAB:
        raise _refuse(f"x-meshnet-sample: the stage made shape {logits.shape}, not [1, vocab]")
    if not np.isfinite(logits).any():
        return logits
    row = logits[0]
    if spec.allow is not None:
        allowed = mask_of(spec.allow, row.size)
        if allowed is None or not np.isfinite(row[allowed]).any():
            return logits
        row = np.where(allowed, row, -np.inf)
    token = _sampler(spec)(row, position)
    if spec.logprobs is None:
        return np.array([[token]], dtype=np.int32)
    return np.array([logprob_row(logits[0], token, spec.logprobs)], dtype=np.float32)


def mask_of(allow: bytes, vocab: int) -> np.ndarray | None:
    """The bool mask of ``vocab`` ids a §3.13 mask sets, or None unless it
    is exactly one bit per id (the bits past ``vocab`` in its last byte clear)."""
    if len(allow) != (vocab + 7) // 8:
        return None
    bits = np.unpackbits(np.frombuffer(allow, dtype=np.uint8), bitorder="little")
    if bits[vocab:].any():
        return None
    return bits[:vocab].astype(bool)


def verify_answer(
    logits: np.ndarray, spec: SampleSpec, draft: Sequence[int], position: int
) -> np.ndarray:
    """The answer to a verify window (wire-2 §3.16) whose stage made
    ``logits``, ``[1, k + 1, vocab]`` for ``k`` drafted ids; ``position`` is
    the chunk's (its first token's place), so row ``i`` draws at ``position
    + i + 1``.

    ``ProtocolError`` 400 ``bad_draft`` for an output that is no such rows
    (a stub's other input) or a draft outside the vocabulary. Rows without a
    finite logit (a broken stage) are answered as they are, as §3.13 says."""
    rows = len(draft) + 1
    if (
        logits.ndim != 3
        or logits.dtype.kind in "iub"  # ids or flags, no logits
        or logits.shape[:2] != (1, rows)
        or not 0 < logits.shape[2] < MAX_SAMPLED_VOCAB
    ):
        raise _refuse_window(f"the stage made shape {logits.shape}, not [1, {rows}, vocab]")
    if max(draft) >= logits.shape[2]:
        raise _refuse_window(f"a drafted id is past the vocabulary of {logits.shape[2]}")
    window = logits[0]
    if not np.isfinite(window).any(axis=1).all():
        return logits
    tokens = verify_sampled(window, draft, _sampler(spec), start_position=position + 1)
    if spec.logprobs is None:
        return np.array([tokens], dtype=np.int32)
    answer = [logprob_row(window[i], token, spec.logprobs) for i, token in enumerate(tokens)]
    return np.array(answer, dtype=np.float32)


def logprob_row(raw: np.ndarray, token: int, k: int) -> list[float]:
    """One §3.13 logprobs row: ``token``, its logprob, then the ``k`` most
    likely (id, logprob) pairs of the raw row (log-softmax, floored at
    ``LOGPROB_FLOOR``), padded with (-1, 0) past a vocabulary smaller than ``k``."""
    logprobs = log_softmax(raw)
    top = top_indices(logprobs, min(k, logprobs.size)) if k else ()
    row = [float(token), max(float(logprobs[token]), LOGPROB_FLOOR)]
    for alternative in top:
        row += [float(alternative), max(float(logprobs[alternative]), LOGPROB_FLOOR)]
    return row + [-1.0, 0.0] * (k - len(top))


def _sampler(spec: SampleSpec) -> Sampler:
    """The stateless sampler of the header's parameters (logprobs: ``logprob_row``)."""
    params = SamplingParams(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, min_p=spec.min_p
    )
    return Sampler(params, spec.seed)


def _refuse_window(message: str) -> ProtocolError:
    return ProtocolError(
        f"x-meshnet-draft: {message}", code=ErrorCode.BAD_DRAFT, header="x-meshnet-draft"
    )
