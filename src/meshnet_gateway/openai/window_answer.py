"""What the last stage answers a verify window (wire-2 §3.16), checked.

A window ``[t, d1 … dk]`` is answered the tokens it yields: int32 ``[1, n]``,
or with ``logprobs=L`` float32 ``[n, 2 + 2L]`` (one §3.13 row per token), for
``1 ≤ n ≤ k + 1`` — the accepted drafts, then the target's own token. The
session keeps ``t`` and the first ``n - 1`` of them, so those must be the
drafts the window carried: an answer that departs from its drafts before
its last token would leave the nodes holding tokens the generation never
had, and is the last stage's fault (502), as is any other shape.

The answer says how many drafts it accepted (``X-Meshnet-Accepted``),
which must agree with its tokens (502 otherwise). A last stage that does
not verify windows computes the window as a plain chunk and answers the
logits of its last position (``[1, vocab]``), or — one that draws (§3.13)
but ignores the drafts — the token drawn after that last position, with
no count: that is no fault, and is told apart (None) so the generation
can go on plainly. Without the count such a token is indistinguishable
from a window whose first draft was rejected, and is for another position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet_proto import MeshnetError
from meshnet_proto.lowlevel import SampleSpec

from .drawn import Drawn, bad_answer, with_logprobs

__all__ = ["read_window"]


def _bad(url: str, what: str) -> MeshnetError:
    return bad_answer(url, f"a verify window {what}")


def read_window(
    tensor: np.ndarray, sample: SampleSpec, drafts: Sequence[int], url: str, accepted: int | None
) -> list[Drawn] | None:
    """The tokens a window of ``drafts`` yields, whose answer said it
    ``accepted`` that many (its X-Meshnet-Accepted); None for logits or for
    tokens without the count (a last stage that did not verify the window)."""
    drawn = _tokens(tensor, sample, drafts, url)
    if accepted is None:
        return None
    if drawn is None:
        raise _bad(url, f"with logits, yet said it accepted {accepted} drafts")
    ids = [one.token for one in drawn]
    # wire-2 §3.16: a = n - 1, and the last token is not draft a + 1 when a < k.
    if accepted != len(ids) - 1 or (accepted < len(drafts) and ids[-1] == drafts[accepted]):
        raise _bad(url, f"{ids}, yet said it accepted {accepted} of its drafts {list(drafts)}")
    return drawn


def _tokens(
    tensor: np.ndarray, sample: SampleSpec, drafts: Sequence[int], url: str
) -> list[Drawn] | None:
    """The tokens of a window's answer, or None for logits."""
    most = len(drafts) + 1
    if tensor.ndim != 2 or tensor.shape[0] < 1:
        raise _bad(url, f"with shape {tensor.shape}")
    if sample.logprobs is None:
        if tensor.dtype != np.int32:
            _check_logits(tensor, url)
            return None
        if tensor.shape[0] != 1 or not 1 <= tensor.shape[1] <= most:
            raise _bad(url, f"int32 {tensor.shape}, not [1, 1..{most}]")
        if (tensor < 0).any():
            raise _bad(url, "with a negative id")
        drawn = [Drawn(int(token)) for token in tensor[0]]
    else:
        width = 2 + 2 * sample.logprobs
        if tensor.dtype != np.float32 or tensor.shape[1] != width:
            _check_logits(tensor, url)
            return None
        if tensor.shape[0] > most:
            raise _bad(url, f"{tensor.shape[0]} tokens, more than its {most}")
        drawn = [with_logprobs(row, url) for row in tensor]
    ids = [one.token for one in drawn]
    if ids[:-1] != list(drafts[: len(ids) - 1]):
        raise _bad(url, f"{ids}, which departs from its drafts {list(drafts)} before its end")
    return drawn


def _check_logits(tensor: np.ndarray, url: str) -> None:
    """One float row (``[1, vocab]``) is the logits a plain chunk is answered
    (read as ``drawn.read_answer`` reads them: any dtype but int32)."""
    if tensor.dtype == np.int32 or tensor.shape[0] != 1:
        raise _bad(url, f"{tensor.dtype} {tensor.shape}, neither tokens nor logits")
