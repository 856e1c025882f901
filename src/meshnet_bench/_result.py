"""What one comparison of ``meshnet bench`` takes and gives back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """How big and how long: ``quick`` keeps the whole bench to a few minutes
    (see ``runner.QUICK_BUDGET_S``; the runner says when a run took longer).

    ``tiny`` is for the test suite's smoke test: the smallest sizes that still
    exercise every code path, with no claim to mean anything.
    ``progress`` takes one human-readable line per step (stderr by default).
    """

    quick: bool = False
    tiny: bool = False
    async_backend: str = "trio"
    progress: Callable[[str], None] = _stderr


@dataclass(slots=True)
class SectionResult:
    """One comparison's outcome.

    ``keys`` are the JSON keys this section owns (``meshnet bench --json``
    merges every section's keys into one flat object). ``rows`` are the
    printed table's rows, each a mapping column -> cell text, in order.
    ``notes`` are one-line readings printed under the table. ``skipped``: the
    section did not run for want of torch or the model (its keys are null and
    no target of theirs is judged).
    """

    title: str
    keys: dict[str, float | int | str | None] = field(default_factory=dict)
    rows: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: bool = False
