"""``n`` > 1: several choices for one prompt, as OpenAI and vLLM serve them.

Each choice is its own generation (its own chain session and sampler). The
first runs alone until its prompt is prefilled; the others start then, so
that they find the prompt in the chain's prefix cache (wire-2 §3.10) and
their decode steps batch with the first's on the nodes. Greedy choices are
therefore all equal; sampled ones each draw from their own seed stream
(``choice_seed``), so a request's choices differ from one another while
the same request with the same ``seed`` gives the same choices again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import numpy as np

from .output import GenerationResult

__all__ = ["RunChoice", "choice_seed", "first_failure", "run_choices"]

# The seed a wire-2 sample spec carries is below 10**19 (§3.13): a derived
# seed stays under it, so a choice can still be drawn at the last stage.
_SEED_BOUND = 10**19

# One choice: its index, and what to call once its prompt is prefilled
# (None: nothing); answers its result.
RunChoice = Callable[[int, Callable[[], None] | None], Awaitable[GenerationResult]]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index``: the request's own for the first (so
    ``n: 1`` and the first of ``n: 3`` are the same draw), one derived from
    it for each other; no seed stays no seed (each sampler then draws fresh
    entropy)."""
    if seed is None or index == 0:
        return seed
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)
    return int(state[0]) % _SEED_BOUND


async def run_choices(count: int, run_one: RunChoice) -> list[GenerationResult]:
    """Every choice's result, in index order; the first failure ends them all
    and is raised as itself (not as a group), as one generation's would be."""
    if count == 1:
        return [await run_one(0, None)]
    results: dict[int, GenerationResult] = {}
    prefilled = anyio.Event()

    async def first() -> None:
        try:
            results[0] = await run_one(0, prefilled.set)
        finally:
            prefilled.set()  # max_tokens 0 never prefills; a failure ends the rest anyway

    async def later(index: int) -> None:
        await prefilled.wait()
        results[index] = await run_one(index, None)

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(first)
            for index in range(1, count):
                group.start_soon(later, index)
    except BaseExceptionGroup as failures:
        raise first_failure(failures) from None
    return [results[index] for index in range(count)]


def first_failure(group: BaseExceptionGroup) -> BaseException:
    """The failure that ended the choices, rather than the cancellations it
    caused in the others; the group itself if it holds nothing else."""
    cancelled = anyio.get_cancelled_exc_class()
    for failure in group.exceptions:
        if isinstance(failure, BaseExceptionGroup):
            failure = first_failure(failure)
        if not isinstance(failure, cancelled) and not isinstance(failure, BaseExceptionGroup):
            return failure
    return group
