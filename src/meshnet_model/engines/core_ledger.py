"""Cores shared by the stages of one machine, according to who is busy.

Stages on one machine (the nodes of a ``meshnet run``, or ``meshnet-node
--share-cores-with FILE`` processes naming the same file) each compute with
at most ``most`` threads, and before each step take their share: the cores
divided among the stages busy at that moment (itself included), and of
those only the ones no other stage holds — at least one. With one stream
only one stage computes at a time, so it gets every core (a static split
left half of them idle: ``--stages 2`` decoded at 0.63-0.76x of one stage
on 2 cores); with every stage busy each gets its share, and none
oversubscribes the cores. A stage that starts while another holds all the
cores computes on one thread until that step ends (a step's length, and
the next steps of both then see each other busy).

The ledger is one file and locks on its bytes, open-file-description locks
(Linux ``F_OFD_SETLK``): they belong to the open file, not to the process
(unlike POSIX record locks), so stages in one process exclude each other as
processes do, and the kernel drops them when the file is closed — a killed
process leaks no core. The file's bytes are only names for locks:

* ``i`` for ``i < cores``: core ``i``, held for a step by the stage computing on it;
* ``_MEMBERS + k``: held by member ``k`` (a stage that joined) for its life;
* ``_BUSY + k``: held by member ``k`` during each of its steps.

Where the platform has no such locks (not Linux), ``supported()`` is False and
stages keep a static share (``choice.share_cores``).

A stage also takes no more threads than the machine has idle CPUs at the
step's start (``idle_cpus``: the CPUs less other processes' threads
runnable now, from ``/proc``) — at least one. Beside other busy
processes a two-thread step waits at each of its ~200 barriers for both
threads to be scheduled; one thread never waits (issue 39 part 6: at two
busy loops on 2 cores, ``meshnet run --stages 2`` decoded at 0.36x of quiet
with two-thread steps, and at 0.66x with one; measured).

A step's count reaches torch through this thread's grant (``step_threads``),
which the engine reads where it sets its thread count; changing torch's count
per step costs ~0.1-0.3 µs under libgomp (measured), nothing beside a step.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

from .choice import usable_cores

__all__ = ["CoreLedger", "idle_cpus", "ledger_for", "ledger_step", "step_threads", "supported"]

# Far above any machine's cores, so the regions never overlap.
_MEMBERS = 1 << 24
_BUSY = 1 << 25
MAX_MEMBERS = 4096

# struct flock on Linux (64-bit off_t): l_type, l_whence, l_start, l_len,
# l_pid (0 for open-file-description locks), padded to the kernel's size.
_FLOCK = struct.Struct("hhqqi4x")
_SETLK: int | None = getattr(fcntl, "F_OFD_SETLK", None)
_GETLK: int | None = getattr(fcntl, "F_OFD_GETLK", None)


class _Grant(threading.local):
    """This thread's grant while a step is open (None: no step)."""

    threads: int | None = None


_grant = _Grant()


def idle_cpus(proc: str = "/proc") -> int:
    """The machine's CPUs less the threads of other processes runnable now
    (``/proc/loadavg``'s fourth field less this process's threads in state
    R): this process's own threads — the stage handing work to another, the
    event loop — are its business, not a neighbour's. Every CPU when
    unreadable."""
    cpus = os.cpu_count() or 1
    try:
        with open(f"{proc}/loadavg", "rb") as loadavg:
            runnable = int(loadavg.read().split()[3].split(b"/")[0])
        own = 0
        for task in os.listdir(f"{proc}/self/task"):
            # A thread that ended meanwhile is skipped; "pid (name) S ...":
            # the state follows the last ")".
            with suppress(OSError), open(f"{proc}/self/task/{task}/stat", "rb") as stat:
                own += stat.read().rpartition(b")")[2].split()[0] == b"R"
    except (OSError, ValueError, IndexError):
        return cpus
    return cpus - max(0, runnable - own)


def supported() -> bool:
    """Whether this platform has open-file-description locks (Linux >= 3.15)."""
    return _SETLK is not None and _GETLK is not None


def step_threads(default: int | None) -> int | None:
    """The threads this thread's step computes with: the ledger's grant while a
    step is open in this thread (``CoreLedger.step``), else ``default``."""
    threads = _grant.threads
    return default if threads is None else threads


def ledger_for(path: str, engine: dict[str, Any], most: int | None) -> CoreLedger | None:
    """The ledger a stage computing as ``engine`` (its ``describe()``) joins:
    torch on the CPU only — numpy's BLAS pool is one for the whole process,
    and a GPU's threads are not the machine's cores."""
    if engine.get("engine") != "torch" or engine.get("device") != "cpu":
        return None
    return CoreLedger(path, most=most)


def ledger_step(ledger: CoreLedger | None) -> AbstractContextManager[int | None]:
    """Around a step: the ledger's cores for it, or nothing where there is none."""
    return nullcontext() if ledger is None else ledger.step()


class CoreLedger:
    """One stage's membership of a core ledger file (one step at a time)."""

    def __init__(
        self,
        path: str | Path,
        *,
        most: int | None = None,
        cores: int | None = None,
        idle: Callable[[], int] = idle_cpus,
    ) -> None:
        """Join the ledger at ``path`` (created if absent). ``cores``: the cores
        shared (default: those this process may run on); ``most``: this stage's
        own cap (``--threads``; default: every core); ``idle``: the machine's
        idle CPUs now (``idle_cpus``).

        Raises ``ValueError`` naming the file when it cannot be used."""
        if not supported():
            reason = "this platform has no open-file-description locks (Linux only)"
            raise ValueError(f"--share-cores-with {path}: {reason}")
        self.path = str(path)
        self.cores = max(1, cores if cores is not None else usable_cores())
        self.most = max(1, min(most or self.cores, self.cores))
        self._idle = idle
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ValueError(f"--share-cores-with {path}: {exc.strerror}") from None
        # The kernel drops every lock of the file with its descriptor.
        self._closer = weakref.finalize(self, os.close, self._fd)
        member = next((k for k in range(MAX_MEMBERS) if self._lock(_MEMBERS + k)), None)
        if member is None:
            self.close()
            raise ValueError(f"--share-cores-with {path}: {MAX_MEMBERS} stages share it already")
        self.member = member
        self.steps = 0
        self.last_threads = 0  # the last step's grant (0: no step yet)
        self.last_idle = 0  # the idle CPUs the last step saw
        self._busy = False  # within a step (GETLK does not report our own lock)

    def close(self) -> None:
        """Leave the ledger: every lock goes with the descriptor."""
        self._closer()

    @contextmanager
    def step(self) -> Iterator[int]:
        """A step's cores: the threads granted (also ``step_threads`` in this
        thread), given back when the block ends, however it ends."""
        threads = self._take()
        _grant.threads = threads
        try:
            yield threads
        finally:
            _grant.threads = None
            self._give_back()

    def describe(self) -> dict[str, Any]:
        """For ``/info``: the file, the cores, this stage's cap, its last grant
        and the idle CPUs it saw, and how many stages are members and busy now."""
        return {
            "file": self.path,
            "cores": self.cores,
            "most": self.most,
            "members": self._count(_MEMBERS),
            "busy": self._count(_BUSY),
            "steps": self.steps,
            "last_threads": self.last_threads,
            "last_idle": self.last_idle,
        }

    def _take(self) -> int:
        # Busy first, then count: two stages starting together see each other.
        self._lock(_BUSY + self.member)
        self._busy = True
        self.last_idle = self._idle()
        share = max(1, min(self.most, self.cores // self._count(_BUSY), self.last_idle))
        held = 0
        for lo, hi in self._free_cores():
            want = min(hi - lo, share - held)
            if want <= 0:
                break
            held += want if self._lock(lo, want) else 0  # lost a race: fewer threads
        self.steps += 1
        self.last_threads = max(1, held)
        return self.last_threads

    def _give_back(self) -> None:
        self._fcntl(fcntl.F_UNLCK, 0, self.cores)
        self._fcntl(fcntl.F_UNLCK, _BUSY + self.member, 1)
        self._busy = False

    def _free_cores(self) -> list[tuple[int, int]]:
        """The runs of cores no other stage holds, lowest first."""
        free, at = [], 0
        for lo, hi in sorted(self._held(0, self.cores)):
            if lo > at:
                free.append((at, lo))
            at = max(at, hi)
        return free + ([(at, self.cores)] if at < self.cores else [])

    def _count(self, base: int) -> int:
        """Members (``_MEMBERS``) or busy members (``_BUSY``), this one included
        (GETLK reports only the others' locks)."""
        others = sum(hi - lo for lo, hi in self._held(base, base + MAX_MEMBERS))
        return others + (1 if base == _MEMBERS else int(self._busy))

    def _held(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The byte ranges within ``[lo, hi)`` other members hold: found one lock
        at a time (GETLK reports one), the range split around each."""
        assert _GETLK is not None
        found, todo = [], [(lo, hi)]
        while todo:
            lo, hi = todo.pop()
            probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, lo, hi - lo, 0)
            kind, _, start, length, _ = _FLOCK.unpack(fcntl.fcntl(self._fd, _GETLK, probe))
            if kind == fcntl.F_UNLCK:
                continue
            start, end = max(lo, start), hi if length == 0 else min(hi, start + length)
            found.append((start, end))
            # Never an empty range: a length of 0 means "to the end of the file".
            todo += [(a, b) for a, b in ((lo, start), (end, hi)) if a < b]
        return found

    def _lock(self, start: int, length: int = 1) -> bool:
        """These bytes' lock, if no other member holds any of them."""
        try:
            self._fcntl(fcntl.F_WRLCK, start, length)
        except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held elsewhere
            return False
        return True

    def _fcntl(self, kind: int, start: int, length: int) -> None:
        assert _SETLK is not None
        fcntl.fcntl(self._fd, _SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
