"""What a newcomer meets following the README literally (issue 12's frictions).

The README's shell blocks are extracted and run as written (ports moved to
free ones, ``.venv/bin/`` pointed at this interpreter's bin directory), so a
README line that blocks, reads a file nothing made, or needs a module the
interpreter lacks fails here. The CLI's messages for the usual mistakes (no
gateway running, a gateway without a model) and the bench's exit status and
chart path are checked as a user sees them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from meshnet_bench import runner
from meshnet_cli.__main__ import build_parser
from support.gateway import clean_env, closed_port_url, release_port, spawn, stop
from support.waiting import wait_until_sync

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent


def readme_commands(heading: str) -> list[str]:
    """The indented shell lines of one README section, continuations joined."""
    text = README.read_text(encoding="utf-8")
    # The section ends at the next heading of any level: a subsection has
    # commands of its own (the real model needs a package the test has not).
    section = re.split(r"\n#{2,} ", text.split(f"\n## {heading}\n", 1)[1], maxsplit=1)[0]
    commands: list[str] = []
    pending = ""
    for line in section.splitlines():
        if not line.startswith("    "):
            continue
        code = (pending + " " + line.strip()) if pending else line[4:]
        if code.endswith("\\"):
            pending = code[:-1].rstrip()
            continue
        pending = ""
        commands.append(code)
    return commands


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_readme(heading: str, workdir: Path, ports: dict[str, int]) -> subprocess.CompletedProcess:
    """Run a README section's commands in one bash, as pasted into a shell."""
    script = "\n".join(readme_commands(heading))
    script = script.replace(".venv/bin/", f"{BIN}/")
    for old, new in ports.items():
        script = re.sub(rf"\b{old}\b", str(new), script)
    # A failing line must not leave the background servers behind.
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script + "\nwait\n"
    proc = subprocess.Popen(
        ["bash", "-c", script], cwd=workdir, env=clean_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"README block timed out; stdout {stdout!r} stderr {stderr!r}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def ignored_by_git(paths: list[str]) -> list[str]:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", *paths],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.split()


def test_every_python_line_of_the_readme_uses_the_venv() -> None:
    # Bare `python` has no ml_dtypes (nor meshnet) on a fresh machine.
    lines = [line.strip() for line in README.read_text(encoding="utf-8").splitlines()]
    bare = [line for line in lines if re.match(r"(python3?|py) ", line)
            and not line.startswith("python3 -m venv")]  # fmt: skip
    assert bare == []


def readme_sections() -> dict[str, list[str]]:
    """Every README section (any heading level) and its indented shell lines."""
    sections: dict[str, list[str]] = {}
    heading = ""
    for line in README.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            heading = line
        elif line.startswith("    "):
            sections.setdefault(heading, []).append(line.strip())
    return sections


def test_every_readme_wait_gives_up_and_each_block_has_its_own_ports() -> None:
    """Issue 43, point 3: an ``until`` loop with no bound spins for ever when
    a server fails to start; blocks sharing a port talk to whichever server
    another block left running."""
    sections = readme_sections()
    loops = [line for lines in sections.values() for line in lines if "until " in line]
    assert loops and all(line.startswith("timeout ") for line in loops), loops
    owners: dict[str, str] = {}
    for heading, lines in sections.items():
        if not any(line.rstrip().split("#")[0].rstrip().endswith("&") for line in lines):
            continue  # no server started in the background here
        for port in set(re.findall(r"(?:127\.0\.0\.1:|--port )(\d+)", "\n".join(lines))):
            assert owners.setdefault(port, heading) == heading, (port, owners[port], heading)


def test_the_readme_pipeline_runs_as_pasted_and_leaves_only_ignored_files(
    tmp_path: Path,
) -> None:
    ports = dict(zip(("8100", "8101", "8102"), free_ports(3), strict=True))
    done = run_readme("Running a pipeline by hand", tmp_path, ports)
    assert done.returncode == 0, (done.stdout, done.stderr)
    # Started together, the gateway learnt the entry's window without a warning.
    assert "cannot read the reorder window" not in done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    sent = np.load(tmp_path / "in.npy").view(ml_dtypes.bfloat16)
    out = np.load(tmp_path / "out.npy")  # plain numpy can read it: float32
    assert out.dtype == np.float32 and np.array_equal(out, sent.astype(np.float32))
    # curl read the in.bin the README made, and the echo chain gave it back.
    assert (tmp_path / "out.bin").read_bytes() == (tmp_path / "in.bin").read_bytes()
    assert (tmp_path / "in.bin").stat().st_size == 512 * 4096 * 2
    assert " 0 failed" in done.stdout  # the conformance line: the gateway passes
    created = sorted(path.name for path in tmp_path.iterdir())
    assert created == ["in.bin", "in.npy", "out.bin", "out.npy"]
    assert ignored_by_git(created) == created


def test_the_readme_model_lines_run_as_pasted(tmp_path: Path) -> None:
    ports = {"8200": free_ports(1)[0]}
    done = run_readme("A model split over nodes, and the benchmark", tmp_path, ports)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert re.search(
        r"\[finish_reason \w+, \d+ prompt \+ \d+ completion tokens[^\]]*\]", done.stderr
    )
    created = sorted(path.name for path in tmp_path.iterdir())
    assert "tiny-llama" in created
    assert ignored_by_git([f"{name}/" if name == "tiny-llama" else name for name in created])


def test_the_bench_chart_and_the_readme_files_are_ignored() -> None:
    names = ["in.npy", "out.npy", "in.bin", "out.bin", "tiny-llama/", "bench-throughput.png"]
    assert ignored_by_git(names) == names
    # The committed chart itself is not ignored.
    assert ignored_by_git(["docs/bench-throughput.png"]) == []


def test_a_gateway_started_before_its_entry_learns_the_window_quietly() -> None:
    entry = closed_port_url()
    gateway, url = spawn("meshnet_gateway", "--entry", entry, "--inflight", "4")
    node = None
    try:
        node, _ = spawn("meshnet_node", "--port", release_port(entry))
        # No request is sent: the gateway must ask again by itself.
        infos: list[dict] = []

        def asked_again() -> bool:
            infos.append(info_of(url))
            return infos[-1]["inflight"]["effective"] == 4

        wait_until_sync(asked_again, "the gateway asking its entry again", every=0.1)
        assert infos[-1]["inflight"]["entry_reorder_window"] == 16
    finally:
        assert stop(gateway) == 0
        if node is not None:
            assert stop(node) == 0
    assert gateway.stderr is not None
    stderr = gateway.stderr.read()
    assert "cannot read the reorder window" not in stderr, stderr


def info_of(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/info", timeout=60) as response:
        return json.loads(response.read())


def meshnet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshnet_cli", *args],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip


def test_send_to_no_gateway_says_it_cannot_connect(tmp_path: Path) -> None:
    source = tmp_path / "in.npy"
    np.save(source, np.zeros((1, 4, 4), np.float32))
    nowhere = closed_port_url()
    done = meshnet("send", "--gateway", nowhere, str(source), str(tmp_path / "out.npy"))
    assert done.returncode == 1
    assert done.stderr.startswith(f"meshnet send: {nowhere}: cannot connect"), done.stderr
    assert "is a gateway running there?" in done.stderr
    # No status: nobody answered, so there is no 502 from anyone.
    assert "502" not in done.stderr and "downstream" not in done.stderr


def test_generate_against_a_gateway_without_a_model_explains() -> None:
    gateway, url = spawn("meshnet_gateway", "--entry", closed_port_url(), "--log-level", "error")
    try:
        done = meshnet("generate", "--gateway", url, "--prompt", "hi")
        named = meshnet("generate", "--gateway", url, "--prompt", "hi", "--model", "m")
    finally:
        assert stop(gateway) == 0
    for result, path in ((done, "/v1/models"), (named, "/v1/completions")):
        assert result.returncode == 1
        assert f"404 on {path}: this gateway serves no OpenAI API; start it with --model DIR" in (
            result.stderr
        ), result.stderr


# ------------------------------------------------------------ the bench


def test_bench_plot_defaults_to_the_current_directory() -> None:
    args = build_parser().parse_args(["bench", "--plot"])
    assert args.plot == "bench-throughput.png"
    assert Path("bench-throughput.png") == runner.DEFAULT_PLOT


def fake_sections(keys: dict) -> object:
    return lambda options, names: ([runner.SectionResult("fake", keys=keys)], dict(keys))


@pytest.mark.parametrize(
    ("value", "tiny", "status"),
    [(0.5, False, 3), (0.9, False, 0), (0.5, True, 0)],
)
def test_a_missed_target_exits_3_except_at_tiny_sizes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: float,
    tiny: bool, status: int,
) -> None:  # fmt: skip
    monkeypatch.setattr(runner, "run_sections", fake_sections({"pipeline_efficiency": value}))
    lines: list[str] = []
    assert runner.main(quick=not tiny, tiny=tiny, out=lines.append) == status
    table = "\n".join(lines)
    assert ("not met" in table) == (value < 0.85)
    missed = "target: pipeline_efficiency 0.5 >= 0.85: not met"
    assert (missed in capsys.readouterr().err) == (status == 3)


def test_a_quick_run_over_its_budget_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(runner, "run_sections", fake_sections({"pipeline_efficiency": 0.9}))
    monkeypatch.setattr(runner, "QUICK_BUDGET_S", -1.0)  # any run is over it
    assert runner.main(quick=True, out=lambda _: None) == 0
    assert "note: --quick took 0 s, over the -1 s it usually takes" in capsys.readouterr().err
