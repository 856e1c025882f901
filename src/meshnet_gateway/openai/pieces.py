"""A prompt's prefill sent in pieces, each waiting its turn for the prefill budget.

Issue 37: a prompt used to be admitted against the gateway's prefill budget
(``--max-prefill-tokens``) as a whole, and one longer than the budget went
alone — every other client's prompt waited for its whole prefill. Now the
prefill is cut into pieces of one window of chunks (``--chunk-tokens`` times
the inflight window: what one run would have on the wire at once anyway),
each sent as its own run at the session's position, once the admission
control grants its tokens (``Ticket.prefill``, fair across clients), and
given back as soon as that run is answered. Between two pieces of a long
prompt, other requests' pieces go down the chain.

Each piece is one chain call with its own ``--timeout`` (a wait for budget
is no chain call); the cached-prefix ``attach`` goes with the first piece
only, the last stage's draw (``sample``) with the last only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import numpy as np

from meshnet_proto.lowlevel import SampleSpec

from .drawn import Answer

__all__ = ["PrefillGate", "run_in_pieces"]

# ``gate(tokens)``: held while a piece of ``tokens`` prompt tokens is on the
# chain (``admitted.admission_gate``: its admission ticket's grants).
PrefillGate = Callable[[int], AbstractAsyncContextManager[object]]


class _RunOnce(Protocol):
    async def __call__(
        self, ids: np.ndarray, *, attach: str | None, sample: SampleSpec | None
    ) -> Answer: ...


async def run_in_pieces(
    run: _RunOnce,
    ids: np.ndarray,
    window: int,
    gate: PrefillGate,
    attach: str | None,
    sample: SampleSpec | None,
) -> Answer:
    """``run`` over ``ids`` (``[1, tokens]``) one piece of ``window`` tokens
    at a time, each inside ``gate``; the last piece's answer."""
    window = max(1, window)
    total = ids.shape[1]
    answer: Answer | None = None
    for start in range(0, max(total, 1), window):
        piece = ids[:, start : start + window]
        last = start + window >= total
        async with gate(piece.shape[1]):
            answer = await run(
                piece, attach=attach if start == 0 else None, sample=sample if last else None
            )
    assert answer is not None  # at least one piece ran
    return answer
