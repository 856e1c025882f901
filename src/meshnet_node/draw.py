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
"""

from __future__ import annotations

import numpy as np

from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_proto import ProtocolError
from meshnet_proto.lowlevel import SampleSpec

__all__ = ["MAX_SAMPLED_VOCAB", "check_sampled_head", "draw_answer"]

# Ids travel exactly in a float32 answer up to here.
MAX_SAMPLED_VOCAB = 2**24


def _refuse(message: str) -> ProtocolError:
    return ProtocolError(message, code="bad_sample", status=400, header="x-meshnet-sample")


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
    params = SamplingParams(
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        min_p=spec.min_p,
        logprobs=spec.logprobs,
    )
    sampler = Sampler(params, spec.seed)
    token = sampler(logits[0], position)
    if spec.logprobs is None:
        return np.array([[token]], dtype=np.int32)
    chosen = sampler.last
    assert chosen is not None  # params.logprobs is set
    row = [float(token), chosen.logprob]
    for alternative, logprob in chosen.top:
        row += [float(alternative), logprob]
    row += [-1.0, 0.0] * (spec.logprobs - len(chosen.top))  # a vocabulary smaller than k
    return np.array([row], dtype=np.float32)
