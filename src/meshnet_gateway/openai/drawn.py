"""What the last stage answers a generation's chunk: logits, or a drawn token.

With ``X-Meshnet-Sample`` (wire-2 §3.13) the answer is the token the last
stage drew — int32 ``[1, 1]``, or with ``logprobs=k`` float32 ``[1, 2 + 2k]``
(the id, its logprob, then ``k`` (id, logprob) pairs, padded with id -1 when
the vocabulary is smaller than ``k``). A constrained generation's chunk
carries its grammar's mask of the step too (``X-Meshnet-Allow``), so the
last stage draws it where the logits are; the grammar's state stays here
and advances with the drawn token. A chain whose last stage ignores the
header answers the logits ``[1, vocab]`` instead, and the gateway draws from
them with the same function (a float32 row exactly ``2 + 2k`` wide reads as
the logprobs answer: no real vocabulary has 42 ids or fewer). Anything else
is the last stage's fault: 502.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import anyio
import numpy as np

from meshnet_model.sampling import Logprobs, Sampler
from meshnet_proto import MeshnetError
from meshnet_proto.lowlevel import MAX_ALLOW_VALUE, SampleSpec

from .grammar import GrammarFailed, grammar_error

__all__ = ["Answer", "Drawn", "read_answer", "spec_for_last_stage"]


@dataclass(frozen=True, slots=True)
class Drawn:
    """A token the last stage drew, and its logprobs when they were asked."""

    token: int
    logprobs: Logprobs | None = None


# What a run's last chunk is answered: the logits (``[vocab]``) or the drawn token.
Answer = np.ndarray | Drawn


async def spec_for_last_stage(sampler: Sampler) -> SampleSpec | None:
    """The draw the last stage can make next for ``sampler``, or None while
    it needs more than the logits and a mask (``Sampler.stateless``,
    ``Sampler.masked_stateless``). The mask is computed in a worker thread
    (a grammar's first step may take milliseconds); one that compresses
    past ``MAX_ALLOW_VALUE`` is not sent, and the logits come up instead."""
    spec = _plain_spec(sampler)
    if spec is None or not sampler.masked_stateless:
        return spec
    assert sampler.constraint is not None
    try:
        mask = await anyio.to_thread.run_sync(sampler.mask, sampler.constraint.width)
    except GrammarFailed as exc:
        raise grammar_error(exc) from None
    masked = replace(spec, allow=mask)
    value = masked.allow_value()
    return masked if value is not None and len(value) <= MAX_ALLOW_VALUE else None


def _plain_spec(sampler: Sampler) -> SampleSpec | None:
    if not (sampler.stateless or sampler.masked_stateless):
        return None
    params = sampler.params
    return SampleSpec(
        seed=sampler.seed,
        temperature=params.temperature,
        top_p=params.top_p,
        # A cut at or past the vocabulary is no cut: the wire's range ends at 2**31.
        top_k=params.top_k if params.top_k < 2**31 else 0,
        min_p=params.min_p,
        logprobs=params.logprobs,
    )


def bad_answer(url: str, what: str) -> MeshnetError:
    """502: the last stage's answer is none the sender can use (``what`` says why)."""
    return MeshnetError(
        f"{url}: the last stage answered {what}",
        code="downstream_bad_response",
        status=502,
        hop=url,
    )


def read_answer(tensor: np.ndarray, sample: SampleSpec | None, url: str) -> Answer:
    """The answer ``tensor`` to a chunk sent with ``sample`` (or without),
    checked: logits as float32 ``[vocab]``, or the ``Drawn`` token."""
    if tensor.ndim != 2 or tensor.shape[0] != 1:
        raise bad_answer(url, f"shape {tensor.shape}, not logits [1, vocab] or a drawn token")
    if sample is not None and tensor.dtype == np.int32:
        if tensor.shape != (1, 1) or tensor[0, 0] < 0:
            raise bad_answer(url, f"an int32 {tensor.shape} with {tensor[0, 0]}, not one token id")
        if sample.logprobs is not None:
            raise bad_answer(url, "a token without the logprobs asked for")
        return Drawn(int(tensor[0, 0]))
    if (
        sample is not None
        and sample.logprobs is not None
        and tensor.shape[1] == 2 + 2 * sample.logprobs
    ):
        return with_logprobs(tensor[0], url)
    if tensor.dtype == np.int32:
        raise bad_answer(url, "int32 values to a chunk that asked for logits")
    return np.asarray(tensor[0], dtype=np.float32)


def with_logprobs(row: np.ndarray, url: str) -> Drawn:
    values = row.astype(np.float64)
    ids = values[0::2]
    if not (np.isfinite(values).all() and (ids == np.floor(ids)).all() and ids[0] >= 0):
        raise bad_answer(url, "a drawn token whose ids are not whole numbers")
    top = tuple(
        (int(token), float(logprob))
        for token, logprob in zip(ids[1:], values[3::2], strict=True)
        if token >= 0
    )
    return Drawn(int(ids[0]), Logprobs(token=int(ids[0]), logprob=float(values[1]), top=top))
