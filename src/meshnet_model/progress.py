"""Progress while a stage's tensors are read: bytes so far out of the stage's total.

A loader is handed a ``LoadProgress`` and calls ``on_bytes(n)`` with the
stored bytes of each tensor it reads (the checkpoint classes do it, once per
tensor: ``formats.safetensors.Checkpoint``, ``formats.gguf.checkpoint``). The
default, ``NO_PROGRESS``, does nothing: a library user sees nothing unless
they ask.

``reporting(plan)`` is what the node uses (``meshnet_node.model_stage``; so
``meshnet-node`` and ``meshnet run`` alike): at log level info or below, one
line when the load starts reading (``loading N tensors, X MiB for layers a:b
from FILE``, written with the first tensor read) and one when it ends (the
time and the bytes); in between a tqdm bar when stderr is a terminal (at
warning too), else a line at each ~25 % step once the load has taken a few
seconds (a 0.5 s load needs no progress lines). tqdm rather than
rich: it is already in every install (``gguf``, a base dependency, requires
it), imports in ~70 ms against rich's ~170 ms, and draws one line on stderr
that leaves the log lines around it readable.

Nothing here imports the rest of the package: the checkpoint readers import
this module.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

__all__ = [
    "NO_PROGRESS",
    "LoadPlan",
    "LoadProgress",
    "LoadReporter",
    "reporting",
]

LOGGER = "meshnet.load"
# The servers' log format (meshnet_runtime.lifecycle.configure_logging), for
# the lines printed before the process has configured logging.
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MIB = 1024 * 1024


class LoadProgress(Protocol):
    def on_bytes(self, n: int) -> None:
        """``n`` more stored bytes of the stage's tensors were read."""


class _NoProgress:
    def on_bytes(self, n: int) -> None:
        pass


NO_PROGRESS: LoadProgress = _NoProgress()


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What a stage's load will read: its tensors, their stored bytes, from where."""

    tensors: int
    total: int  # stored bytes (the file's, before any conversion)
    layers: range
    source: str

    @property
    def span(self) -> str:
        return f"{self.layers.start}:{self.layers.stop}"


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class LoadReporter:
    """The lines (and on a terminal, the bar) of one stage's load.

    ``emit`` takes each line (a logger's ``info``). ``bar``: a stream to draw
    a tqdm bar on (a terminal) instead of the step lines. A step line is
    written when the bytes read cross a multiple of ``step`` (25 %) below
    100 %, saying the share actually read, and only once ``slow_after``
    seconds have passed since the start: a fast load says only when it
    started and when it ended.
    """

    def __init__(
        self,
        plan: LoadPlan,
        emit: Callable[[str], None],
        *,
        bar: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        step: float = 0.25,
        slow_after: float = 2.0,
    ) -> None:
        self.plan, self.emit, self.clock = plan, emit, clock
        self.step, self.slow_after = step, slow_after
        self.done = 0
        self.started: float | None = None
        self._steps_passed = 0
        self._announced = False
        self._bar_stream = bar
        self._bar: Any = None

    def start(self) -> None:
        """The load begins; its line waits for the first tensor read (``announce``)."""
        self.started = self.clock()

    def announce(self) -> None:
        """The start line, once. Written when the first tensor has been read,
        not before: a load refused before it reads anything (torch missing, no
        such CUDA device, a tensor type it cannot decode) stays the one line
        of its refusal."""
        if self._announced:
            return
        self._announced = True
        p = self.plan
        self.emit(
            f"loading {p.tensors} tensors, {_mib(p.total)} for layers {p.span} from {p.source}"
        )
        if self._bar_stream is not None:
            # After the line, not before it: a log line written while the bar
            # is drawn would land on the bar's own line.
            from tqdm import tqdm  # only on a terminal

            self._bar = tqdm(
                total=p.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"layers {p.span}",
                file=self._bar_stream,
                leave=False,
                dynamic_ncols=True,
            )

    def on_bytes(self, n: int) -> None:
        self.announce()
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        total = self.plan.total
        if not total or self.done >= total:
            return  # all read: the end line says it
        passed = int(self.done / total / self.step)
        if passed <= self._steps_passed:
            return
        self._steps_passed = passed
        elapsed = self.clock() - (self.started or 0.0)
        if elapsed >= self.slow_after:
            # The share actually read: one large tensor may cross several steps.
            percent = int(100 * self.done / total)
            self.emit(
                f"loaded {percent}% of layers {self.plan.span}: {_mib(self.done)} of "
                f"{_mib(total)} in {elapsed:.1f} s"
            )

    def finish(self) -> None:
        self.announce()  # a stage of no tensors still says it loaded
        self.close()  # the bar cleared before the end line
        elapsed = self.clock() - (self.started or 0.0)
        rate = f", {self.done / MIB / elapsed:.0f} MiB/s" if elapsed > 0 else ""
        self.emit(
            f"loaded layers {self.plan.span}: {self.plan.tensors} tensors, "
            f"{_mib(self.done)} in {elapsed:.1f} s{rate}"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


@contextmanager
def reporting(
    plan: LoadPlan, *, level: str = "info", stream: TextIO | None = None
) -> Iterator[LoadProgress]:
    """The progress of one load, for its duration (module docstring).

    The lines are log records at info: where the process has configured
    logging (``meshnet run``, an embedder) its configuration decides whether
    they show; where it has not yet (``meshnet-node`` loads its stage first,
    so that a bad checkpoint is one line and nothing else) ``level`` does, and
    they get a handler of their own on ``stream`` for the load's duration, in
    the servers' format. The bar, on a terminal, is not a log record but a
    display that goes when the load ends (as transformers' and llama.cpp's
    loaders draw theirs): it shows at ``level`` warning too — ``meshnet run``'s
    default — and ``error``/``critical`` silence it. The end line is written
    only when the load succeeded.
    """
    stream = sys.stderr if stream is None else stream
    wanted = logging.getLevelName(level.upper())
    log = logging.getLogger(LOGGER)
    configured = bool(logging.getLogger().handlers)
    lines = log.isEnabledFor(logging.INFO) if configured else wanted <= logging.INFO
    bar = stream if _isatty(stream) and wanted <= logging.WARNING else None
    if not lines and bar is None:
        yield NO_PROGRESS
        return
    handler: logging.Handler | None = None
    if lines and not configured:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    reporter = LoadReporter(plan, log.info if lines else _drop, bar=bar)
    try:
        reporter.start()
        yield reporter
        reporter.finish()
    finally:
        reporter.close()
        if handler is not None:
            log.removeHandler(handler)
            log.setLevel(logging.NOTSET)
            log.propagate = True


def _drop(line: str) -> None:
    pass
