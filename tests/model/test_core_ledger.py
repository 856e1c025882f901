"""The core ledger (``engines.core_ledger``): stages of one machine take, before
each step, the cores free among those busy at that moment — one stream's
computing stage gets them all, busy stages split them, and a killed holder
leaks none. And the wait policy (``choice.quiet_idle_threads``) the entry
points set before torch loads its OpenMP runtime.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from meshnet_model.engines.choice import SPIN_COUNT, WAIT_POLICY_VARS
from meshnet_model.engines.core_ledger import (
    CoreLedger,
    idle_cpus,
    ledger_for,
    ledger_step,
    step_threads,
)

CORES = 4


def _ledger(path: Path, most: int | None = None, idle: int = CORES) -> CoreLedger:
    """A member of the ledger at ``path`` on a machine with ``idle`` CPUs idle
    (a quiet one by default: the suite's own load must not change a grant)."""
    return CoreLedger(path, cores=CORES, most=most, idle=lambda: idle)


def test_a_stage_alone_takes_every_core_and_its_thread_sees_the_grant(tmp_path: Path) -> None:
    ledger, other = _ledger(tmp_path / "cores"), _ledger(tmp_path / "cores")
    assert step_threads(2) == 2  # no step open: the stage's own count
    with ledger.step() as threads:
        assert threads == CORES
        assert step_threads(2) == CORES
        assert other.describe()["busy"] == 1
    assert step_threads(None) is None
    info = ledger.describe()
    assert (info["members"], info["busy"], info["steps"], info["last_threads"]) == (2, 0, 1, 4)
    assert other.describe()["busy"] == 0


class _Steps:
    """Steps of several stages overlapping in any order (a pipeline's steps)."""

    def __init__(self) -> None:
        self.open: dict[CoreLedger, AbstractContextManager[int]] = {}

    def start(self, ledger: CoreLedger) -> int:
        self.open[ledger] = ledger.step()
        return self.open[ledger].__enter__()

    def end(self, ledger: CoreLedger) -> None:
        self.open.pop(ledger).__exit__(None, None, None)


def test_busy_stages_split_the_cores_and_none_oversubscribes(tmp_path: Path) -> None:
    first, second = _ledger(tmp_path / "cores"), _ledger(tmp_path / "cores")
    steps = _Steps()
    assert steps.start(first) == CORES  # alone
    # A step that starts while another holds every core computes on one
    # thread until that step ends (a step's cost, never more)...
    assert steps.start(second) == 1
    steps.end(first)
    assert steps.start(first) == CORES // 2  # ...as the next step sees the other busy
    steps.end(second)
    assert steps.start(second) == CORES // 2
    for _ in range(3):  # from then on, both busy: half each, the cores never exceeded
        steps.end(first)
        assert steps.start(first) == CORES // 2
        steps.end(second)
        assert steps.start(second) == CORES // 2
    steps.end(first)
    steps.end(second)
    assert steps.start(second) == CORES  # alone again: every core
    steps.end(second)


def test_more_busy_stages_than_cores_take_one_thread_each(tmp_path: Path) -> None:
    ledgers = [_ledger(tmp_path / "cores") for _ in range(CORES + 2)]
    steps = _Steps()
    for ledger in ledgers[:-1]:
        steps.start(ledger)
    for ledger in ledgers[:-1]:  # each step's successor sees them all busy
        steps.end(ledger)
        assert steps.start(ledger) == 1
    assert ledgers[0].describe()["busy"] == CORES + 1


def test_a_step_takes_no_more_threads_than_the_machine_has_idle_cpus(tmp_path: Path) -> None:
    """Beside other busy processes a step computes on the CPUs left idle —
    one at least — and a quiet machine's step on every core again."""
    idle = [1]
    ledger = CoreLedger(tmp_path / "cores", cores=CORES, idle=lambda: idle[0])
    with ledger.step() as threads:
        assert threads == 1
    idle[0] = -3  # more runnable threads than CPUs
    with ledger.step() as threads:
        assert threads == 1
    idle[0] = 3
    with ledger.step() as threads:
        assert threads == 3
    idle[0] = 64
    with ledger.step() as threads:
        assert threads == CORES


def test_idle_cpus_counts_other_processes_runnable_threads(tmp_path: Path) -> None:
    """``/proc/loadavg``'s runnable threads less this process's own in state R."""
    cpus = os.cpu_count() or 1
    tasks = tmp_path / "self" / "task"
    for task, state in ((1, "R"), (2, "S"), (3, "R")):
        (tasks / str(task)).mkdir(parents=True)
        (tasks / str(task) / "stat").write_text(f"{task} (a (b) c) {state} 1 2 3\n")
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 5/200 4242\n")
    assert idle_cpus(str(tmp_path)) == cpus - 3  # 5 runnable, 2 of them ours
    (tmp_path / "loadavg").write_text("0.50 0.40 0.30 2/200 4242\n")
    assert idle_cpus(str(tmp_path)) == cpus  # only ours
    assert idle_cpus(str(tmp_path / "absent")) == cpus  # unreadable: every CPU
    assert idle_cpus() <= cpus  # the real /proc


def test_threads_is_a_stage_s_cap(tmp_path: Path) -> None:
    capped = _ledger(tmp_path / "cores", most=3)
    with capped.step() as threads:
        assert threads == 3
    assert _ledger(tmp_path / "other", most=64).most == CORES


def test_the_grant_is_given_back_when_the_step_fails(tmp_path: Path) -> None:
    ledger, other = _ledger(tmp_path / "cores"), _ledger(tmp_path / "cores")
    with pytest.raises(RuntimeError), ledger.step():
        raise RuntimeError("the engine failed")
    assert step_threads(None) is None
    with other.step() as threads:
        assert threads == CORES


def test_a_killed_holder_leaks_no_core(tmp_path: Path) -> None:
    """A real process joins, takes every core in a step and is killed in it:
    the kernel drops its locks with the process."""
    path = tmp_path / "cores"
    code = f"""
        import sys
        from meshnet_model.engines.core_ledger import CoreLedger
        ledger = CoreLedger({str(path)!r}, cores={CORES}, idle=lambda: {CORES})
        with ledger.step() as threads:
            print(threads, flush=True)
            sys.stdin.read()  # until killed
    """
    command = [sys.executable, "-c", textwrap.dedent(code)]
    holder = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == f"{CORES}\n"  # it holds them all now
        ledger = _ledger(path)
        assert ledger.describe()["members"] == 2
        with ledger.step() as threads:
            assert threads == 1  # the cores are taken: one thread until they are back
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=60) == -signal.SIGKILL
        with ledger.step() as threads:
            assert threads == CORES
        assert ledger.describe()["members"] == 1
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_closed_member_leaves(tmp_path: Path) -> None:
    ledger, other = _ledger(tmp_path / "cores"), _ledger(tmp_path / "cores")
    assert (ledger.member, other.member) == (0, 1)
    other.close()
    assert ledger.describe()["members"] == 1
    assert _ledger(tmp_path / "cores").member == 1  # its slot is free again


def test_a_file_that_cannot_be_used_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--share-cores-with .*: Is a directory$"):
        CoreLedger(tmp_path)


def test_only_torch_on_the_cpu_joins(tmp_path: Path) -> None:
    path = str(tmp_path / "cores")
    assert ledger_for(path, {"engine": "numpy", "device": "cpu"}, None) is None
    assert ledger_for(path, {"engine": "torch", "device": "cuda:0"}, None) is None
    joined = ledger_for(path, {"engine": "torch", "device": "cpu"}, 2)
    assert joined is not None and joined.most == min(2, joined.cores)
    with ledger_step(None) as nothing:
        assert nothing is None
    with ledger_step(joined) as threads:
        # Its cap, unless other processes leave fewer CPUs idle now (a busy
        # machine, or another test worker beside this one).
        assert threads == min(joined.most, max(1, joined.last_idle))


def _fresh(code: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """``code`` in a new interpreter (torch not imported yet); its JSON answer."""
    clean = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY_VARS}
    command = [sys.executable, "-c", textwrap.dedent(code)]
    done = subprocess.run(
        command,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_idle_threads_spin_briefly_unless_the_operator_chose() -> None:
    code = """
        import json, os
        from meshnet_model.engines.choice import quiet_idle_threads
        print(json.dumps([quiet_idle_threads(), os.environ.get("GOMP_SPINCOUNT")]))
    """
    assert _fresh(code) == [True, str(SPIN_COUNT)]
    assert _fresh(code, {"GOMP_SPINCOUNT": "500"}) == [False, "500"]
    assert _fresh(code, {"OMP_WAIT_POLICY": "passive"}) == [False, None]
    late = """
        import json, os, torch
        from meshnet_model.engines.choice import quiet_idle_threads
        print(json.dumps([quiet_idle_threads(), os.environ.get("GOMP_SPINCOUNT")]))
    """
    assert _fresh(late) == [False, None]  # too late: the runtime has read it


def test_the_entry_points_set_it_before_anything_loads(tmp_path: Path) -> None:
    node = """
        import json, os
        from meshnet_node.__main__ import main
        try:
            main(["--help"])
        except SystemExit:
            pass
        print(json.dumps(os.environ.get("GOMP_SPINCOUNT")))
    """
    assert _fresh(node) == str(SPIN_COUNT)
    run = f"""
        import contextlib, io, json, os, sys
        from meshnet_cli.__main__ import main
        with contextlib.redirect_stderr(io.StringIO()):
            status = main(["run", "--model", {str(tmp_path / "absent")!r}])
        print(json.dumps([status, os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules]))
    """
    assert _fresh(run) == [2, str(SPIN_COUNT), False]
