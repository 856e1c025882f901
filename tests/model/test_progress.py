"""A stage's load says what it reads (``meshnet_model.progress``).

Issue 22: 8 to 9 s of silence while the 135M model loaded, minutes for a 3B.
Now, at log level info: a line when the load starts (tensors, MiB, layers,
file), lines at ~25 % steps once it has taken a few seconds, a line at the
end with the time and the bytes; a bar on a terminal. Library users who pass
nothing see nothing. The clock is injected: no wall-clock assert.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet_model.progress import NO_PROGRESS, LoadPlan, LoadReporter, reporting
from meshnet_model.stage.weights import StageWeights
from meshnet_model.testing import small_config, write_checkpoint
from support.gateway import clean_env, spawn, stop
from support.smollm2 import GGUF_NAME, smollm2_gguf

MIB = 1024 * 1024
PLAN = LoadPlan(tensors=8, total=8 * MIB, layers=range(2, 6), source="model.gguf")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_load_says_its_start_each_quarter_and_its_end() -> None:
    lines: list[str] = []
    clock = Clock()
    reporter = LoadReporter(PLAN, lines.append, clock=clock, slow_after=2.0)
    reporter.start()
    for _ in range(8):  # one MiB a tensor, 3 s each
        clock.now += 3.0
        reporter.on_bytes(MIB)
    reporter.finish()
    assert lines == [
        "loading 8 tensors, 8.0 MiB for layers 2:6 from model.gguf",
        "loaded 25% of layers 2:6: 2.0 MiB of 8.0 MiB in 6.0 s",
        "loaded 50% of layers 2:6: 4.0 MiB of 8.0 MiB in 12.0 s",
        "loaded 75% of layers 2:6: 6.0 MiB of 8.0 MiB in 18.0 s",
        "loaded layers 2:6: 8 tensors, 8.0 MiB in 24.0 s, 0 MiB/s",
    ]


def test_a_fast_load_says_only_its_start_and_its_end() -> None:
    lines: list[str] = []
    clock = Clock()
    reporter = LoadReporter(PLAN, lines.append, clock=clock, slow_after=2.0)
    reporter.start()
    for _ in range(8):
        clock.now += 0.1
        reporter.on_bytes(MIB)
    reporter.finish()
    assert len(lines) == 2 and lines[0].startswith("loading 8 tensors")
    assert lines[1] == "loaded layers 2:6: 8 tensors, 8.0 MiB in 0.8 s, 10 MiB/s"


def test_a_step_line_says_the_share_read_when_one_tensor_crosses_several_steps() -> None:
    lines: list[str] = []
    clock = Clock()
    reporter = LoadReporter(PLAN, lines.append, clock=clock, slow_after=2.0)
    reporter.start()
    clock.now += 5.0
    reporter.on_bytes(7 * MIB)  # 87.5 %: past 25, 50 and 75 at once — one line
    clock.now += 5.0
    reporter.on_bytes(MIB)  # 100 %: the end line's, no step line
    reporter.finish()
    assert lines[1:] == [
        "loaded 87% of layers 2:6: 7.0 MiB of 8.0 MiB in 5.0 s",
        "loaded layers 2:6: 8 tensors, 8.0 MiB in 10.0 s, 1 MiB/s",
    ]


@contextlib.contextmanager
def unconfigured_logging() -> Iterator[None]:
    """The root logger without handlers, as in meshnet-node before it configures
    logging (inside the test's body: pytest attaches its own for each phase)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved


def test_reporting_writes_log_lines_before_logging_is_configured() -> None:
    stream = io.StringIO()  # not a terminal: lines, no bar
    with unconfigured_logging(), reporting(PLAN, level="info", stream=stream) as progress:
        progress.on_bytes(8 * MIB)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert re.search(r" INFO meshnet\.load: loading 8 tensors, 8\.0 MiB for layers 2:6 ", lines[0])
    assert re.search(r" INFO meshnet\.load: loaded layers 2:6: 8 tensors, 8\.0 MiB in ", lines[1])
    # The handler was the load's only: nothing is left attached.
    assert not logging.getLogger("meshnet.load").handlers


def test_reporting_is_silent_above_info_and_after_a_failed_load_has_no_end_line() -> None:
    stream = io.StringIO()
    with unconfigured_logging(), reporting(PLAN, level="warning", stream=stream) as progress:
        assert progress is NO_PROGRESS
    assert stream.getvalue() == ""
    # Refused before the first tensor was read (torch missing, a type it
    # cannot decode): no line of the load's beside the refusal's one line.
    with (
        unconfigured_logging(),
        pytest.raises(RuntimeError),
        reporting(PLAN, level="info", stream=stream),
    ):
        raise RuntimeError("no torch")
    assert stream.getvalue() == ""
    # Failed after a tensor: the start line, and no end line.
    with (
        unconfigured_logging(),
        pytest.raises(RuntimeError),
        reporting(PLAN, level="info", stream=stream) as progress,
    ):
        progress.on_bytes(MIB)
        raise RuntimeError("bad tensor")
    assert [line.split(": ", 1)[1] for line in stream.getvalue().splitlines()] == [
        "loading 8 tensors, 8.0 MiB for layers 2:6 from model.gguf"
    ]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_steps_are_a_bar() -> None:
    stream = FakeTerminal()
    with unconfigured_logging(), reporting(PLAN, level="info", stream=stream) as progress:
        for _ in range(8):
            progress.on_bytes(MIB)
    out = stream.getvalue()
    # tqdm's bar, in bytes (it redraws at most every 0.1 s: how far it got varies).
    assert re.search(r"\rlayers 2:6: +\d+%\|.*/8\.00M \[", out), out
    assert "loaded 25%" not in out  # no step lines beside the bar
    assert "loaded layers 2:6: 8 tensors, 8.0 MiB in " in out


def test_on_a_terminal_at_warning_the_bar_shows_without_the_lines() -> None:
    """``meshnet run``'s default level: the bar, which goes when the load ends."""
    stream = FakeTerminal()
    with unconfigured_logging(), reporting(PLAN, level="warning", stream=stream) as progress:
        progress.on_bytes(8 * MIB)
    out = stream.getvalue()
    assert re.search(r"\rlayers 2:6: +\d+%\|", out) and "meshnet.load" not in out, out
    stream = FakeTerminal()
    with unconfigured_logging(), reporting(PLAN, level="error", stream=stream) as progress:
        assert progress is NO_PROGRESS
    assert stream.getvalue() == ""


class Counted:
    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def on_bytes(self, n: int) -> None:
        self.bytes += n
        self.calls += 1


def test_a_loader_reports_every_tensor_of_its_stage_once(tmp_path: Path) -> None:
    from meshnet_model.identity import load_plan

    config = small_config(num_hidden_layers=4, tie_word_embeddings=True)
    directory = write_checkpoint(tmp_path / "ckpt", config, seed=0)
    for layers in (range(0, 2), range(2, 4), range(0, 4)):  # the tied head reads the embedding
        plan = load_plan(directory, layers, config)
        counted = Counted()
        StageWeights.load(directory, layers, progress=counted)
        assert (counted.calls, counted.bytes) == (plan.tensors, plan.total), layers


# -- the real model, as a user starts it ---------------------------------------------------

_START = re.compile(
    r" INFO meshnet\.load: loading (\d+) tensors, ([\d.]+) MiB for layers (\d+:\d+) from (\S+)$"
)
_STEP = re.compile(r" INFO meshnet\.load: loaded (\d+)% of layers (\d+:\d+): ([\d.]+) MiB of ")
_END = re.compile(
    r" INFO meshnet\.load: loaded layers (\d+:\d+): (\d+) tensors, ([\d.]+) MiB in [\d.]+ s"
)


def _load_lines(stderr: str, layers: str) -> tuple[re.Match[str], list[int], re.Match[str]]:
    """The start, step percentages and end line of the load of ``layers``."""
    lines = stderr.splitlines()
    starts = [m for m in map(_START.search, lines) if m and m.group(3) == layers]
    ends = [m for m in map(_END.search, lines) if m and m.group(1) == layers]
    steps = [int(m.group(1)) for m in map(_STEP.search, lines) if m and m.group(2) == layers]
    assert len(starts) == 1 and len(ends) == 1, stderr
    return starts[0], steps, ends[0]


def _check_load(stderr: str, layers: str, tensors: int) -> None:
    start, steps, end = _load_lines(stderr, layers)
    assert start.group(4) == GGUF_NAME
    assert int(start.group(1)) == tensors == int(end.group(2))
    assert float(start.group(2)) == float(end.group(3)) > 0  # every byte counted, once
    # Step lines appear only when the load took a few seconds: how many is the
    # machine's business; their order and range are not.
    assert steps == sorted(set(steps)) and all(0 < p < 100 for p in steps), steps


@pytest.mark.slow
def test_a_node_loading_the_real_model_says_so_on_stderr() -> None:
    """meshnet-node with its stderr a pipe (not a terminal): log lines, no bar."""
    gguf = smollm2_gguf()
    proc, _ = spawn("meshnet_node", "--model", str(gguf), "--layers", "0:15",
                    "--log-level", "info", timeout=240.0)  # fmt: skip
    assert stop(proc) == 0
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    # Layers 0..14 (9 tensors each) and the embedding.
    _check_load(stderr, "0:15", tensors=15 * 9 + 1)
    assert "%|" not in stderr  # no tqdm bar on a pipe


@pytest.mark.slow
def test_meshnet_run_reports_each_stages_load() -> None:
    gguf = smollm2_gguf()
    # At info: meshnet run's default level is warning, which shows the bar on a
    # terminal but not the log lines.
    argv = [sys.executable, "-m", "meshnet_cli", "run", "--model", str(gguf),
            "--stages", "2", "--port", "0", "--log-level", "info"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready, _, _ = select.select([proc.stdout], [], [], 240)
        assert ready, "no ready line within 240 s"
        assert " listening on " in proc.stdout.readline()
        assert stop(proc) == 0
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 30 layers in two: the embedding on the first, the tied head and the norm on the last.
    _check_load(stderr, "0:15", tensors=15 * 9 + 1)
    _check_load(stderr, "15:30", tensors=15 * 9 + 2)


@pytest.mark.slow
def test_a_node_on_a_terminal_draws_a_bar_between_its_lines() -> None:
    """meshnet-node with its stderr a terminal (a pseudo-terminal of 100 columns)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    gguf = smollm2_gguf()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    argv = [sys.executable, "-m", "meshnet_node", "--port", "0", "--model", str(gguf),
            "--layers", "0:15", "--log-level", "info"]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True,
                            env=clean_env())  # fmt: skip
    os.close(slave)
    out = b""
    try:
        assert proc.stdout is not None
        while True:  # bounded: the ready line, or the 240 s without any output
            ready, _, _ = select.select([master, proc.stdout], [], [], 240)
            assert ready, "no ready line within 240 s"
            if master in ready:
                out += os.read(master, 65536)
            if proc.stdout in ready:
                assert " listening on " in proc.stdout.readline()
                break
        assert stop(proc) == 0
        with contextlib.suppress(OSError):  # EIO once the terminal's last writer is gone
            while select.select([master], [], [], 1)[0]:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                out += chunk
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    start = text.index("loading 136 tensors, 60.4 MiB for layers 0:15")
    bar = text.index("\rlayers 0:15:", start)  # tqdm's bar, after the start line
    end = text.index("loaded layers 0:15: 136 tensors, 60.4 MiB in ", bar)
    assert "%|" in text[bar:end] and "loaded 25%" not in text, text
