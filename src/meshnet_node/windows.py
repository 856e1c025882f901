"""Verify windows at a node (wire-2 §3.16): what the ids, the answer and
``/metrics`` say about them.

A window is one sampled chunk ``[t, d1 … dk]`` with ``X-Meshnet-Draft:
d1,…,dk``. Every stage computes it as one chunk (its ``StageContext`` says
``logit_rows = k + 1``: the queries attend one by one, and the last stage's
head makes all ``k + 1`` rows); the node whose input is token ids checks
that the chunk's ids 1 … k are the drafts (``check_drafted_ids``, before
its stage runs); the node that answers verifies the rows
(``draw.verify_answer``, through ``SampledAnswers``), counts the window
(``WindowCounts``) and says in its answer how many drafts it accepted
(``X-Meshnet-Accepted``, ``window_accepted``): without that count a sender
cannot tell a window's one token from the one token a last stage that
ignored the drafts drew after the window's last row.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from meshnet_proto import ErrorCode, ProtocolError, WireHeaders
from meshnet_proto.lowlevel import SampleSpec, Ticket
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.metrics import Tally

from .draw import draw_answer, verify_answer

__all__ = [
    "SampledAnswers",
    "WindowCounts",
    "answered_tokens",
    "check_drafted_ids",
    "logit_rows",
    "sampled_answer",
    "window_accepted",
]


def logit_rows(headers: WireHeaders) -> int:
    """The rows of logits a last stage makes of the chunk: a window's ``k + 1``, else 1."""
    return 1 if headers.draft is None else len(headers.draft) + 1


def answered_tokens(shape: tuple[int, ...], dtype: str) -> int | None:
    """The tokens of a window's answer of ``shape`` and ``dtype``: int32
    ``[1, n]``, or one logprobs row per token ``[n, 2 + 2L]``; None for rows
    of logits (``[1, k + 1, vocab]``, a broken stage's, answered as they are)."""
    if len(shape) != 2:
        return None
    return shape[1] if dtype == "int32" else shape[0]


def window_accepted(headers: WireHeaders, shape: tuple[int, ...], dtype: str) -> int | None:
    """``X-Meshnet-Accepted`` of the answer of ``shape`` and ``dtype`` that the
    node that answers makes for the request ``headers``: a window's ``n - 1``
    (wire-2 §3.16), None for any other answer (a plain chunk's, logits)."""
    if headers.draft is None or headers.sample is None:
        return None
    tokens = answered_tokens(shape, dtype)
    return None if tokens is None else tokens - 1


def check_drafted_ids(headers: WireHeaders, tensor: np.ndarray) -> None:
    """A window of token ids (the input of the stage owning layer 0) must be
    ``[t, d1 … dk]`` for the drafts it names: 400 ``bad_draft`` otherwise,
    before anything runs. Hidden states carry no ids to check."""
    draft = headers.draft
    if draft is None or tensor.dtype != np.int32:
        return
    # The core checked the shape: int32 [1, k + 1].
    if tensor[0, 1:].tolist() != list(draft):
        raise ProtocolError(
            "x-meshnet-draft: the chunk's tokens after its first are not the drafted ids",
            code=ErrorCode.BAD_DRAFT,
            header="x-meshnet-draft",
        )


def sampled_answer(
    output: np.ndarray,
    sample: SampleSpec,
    draft: tuple[int, ...] | None,
    position: int,
    tokens: int,
) -> np.ndarray:
    """What the node that answers a sampled chunk of ``tokens`` at
    ``position`` answers: the token drawn after it (§3.13), or a window's
    verified tokens (§3.16)."""
    if draft is None:
        return draw_answer(output, sample, position + tokens)
    return verify_answer(output, sample, draft, position)


class SampledAnswers:
    """The answers of the node that answers sampled chunks (wire-2 §3.13,
    §3.16), drawn off the event loop where a draw costs more than the
    thread's hand-off, and its windows counted on ``/metrics``."""

    def __init__(self, codecs: CodecPool, registry: CollectorRegistry) -> None:
        self.codecs = codecs
        self.windows = WindowCounts(registry)

    async def answer(self, output: np.ndarray, headers: WireHeaders, ticket: Ticket) -> np.ndarray:
        """The answer to the sampled chunk of ``ticket`` whose stage made ``output``."""
        sample, draft = headers.sample, headers.draft
        assert sample is not None
        # A draw sorts O(vocab): off the loop, unless a plain argmax is
        # cheaper than the thread's hand-off.
        plain = sample.greedy and sample.logprobs is None
        cost = output.nbytes if plain else self.codecs.inline_bytes
        at = (ticket.position, ticket.tokens)
        answer = await self.codecs.run(cost, sampled_answer, output, sample, draft, *at)
        if draft is not None:
            self.windows.count(draft, answer)
        return answer


class WindowCounts:
    """``/metrics`` of the windows this last stage verified: how many, the
    drafts they carried and the drafts accepted (acceptance = their ratio)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.windows = Tally(
            "meshnet_windows_verified", "Verify windows answered (wire-2 §3.16)", registry=registry
        )
        self.drafted = Tally(
            "meshnet_window_drafted_tokens", "Drafted tokens in verify windows", registry=registry
        )
        self.accepted = Tally(
            "meshnet_window_accepted_tokens",
            "Drafted tokens the target accepted in verify windows",
            registry=registry,
        )
        for tally in (self.windows, self.drafted, self.accepted):
            tally.labels()  # shown from the start, at 0

    def count(self, draft: tuple[int, ...], answer: np.ndarray) -> None:
        """A window's answer: the accepted drafts then one token of the
        target's own (rows of logits, a broken stage's, count nothing)."""
        tokens = answered_tokens(answer.shape, answer.dtype.name)
        if tokens is None:
            return
        self.windows.inc()
        self.drafted.inc(len(draft))
        self.accepted.inc(tokens - 1)
