"""The memory a node may use: cgroup v1/v2 and MemAvailable on fake trees, the
flag, and a node refusing to load — with a flag and inside a real cgroup."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshnet_model.testing import random_weights, small_config
from meshnet_model.testing.gguf import write_gguf
from meshnet_node.config import NodeConfig
from meshnet_runtime.memory import MemoryLimit, memory_limit, parse_bytes, parse_bytes_or_auto
from support.cgroup import memory_cgroup

MiB, GiB = 1024**2, 1024**3


def tree(tmp_path: Path, cgroup: str, files: dict[str, str], meminfo: int | None = 8 * GiB,
         rss: int | None = None) -> tuple[Path, Path]:  # fmt: skip
    proc, sys_root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    if meminfo is not None:
        (proc / "meminfo").write_text(
            f"MemTotal:       99999999 kB\nMemAvailable:   {meminfo // 1024} kB\n"
        )
    if rss is not None:
        (proc / "self" / "status").write_text(f"Name:\tpython\nVmRSS:\t  {rss // 1024} kB\n")
    for name, text in files.items():
        path = sys_root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc, sys_root


V1 = "5:devices:/\n4:memory:/outer/inner\n0::/\n"
V2 = "0::/outer/inner\n"


def test_v1_limit_of_the_cgroup(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V1, {"memory/outer/inner/memory.limit_in_bytes": f"{GiB}\n"})
    assert memory_limit(proc, root) == MemoryLimit(
        GiB, "cgroup memory.limit_in_bytes of /outer/inner"
    )


def test_v1_a_parent_limit_binds_and_unlimited_is_ignored(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V1, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/outer/memory.limit_in_bytes": f"{2 * GiB}\n",
        "memory/outer/inner/memory.limit_in_bytes": "9223372036854771712\n",
    })  # fmt: skip
    assert memory_limit(proc, root) == MemoryLimit(
        2 * GiB, "cgroup memory.limit_in_bytes of /outer"
    )


def test_v1_limit_less_usage_less_inactive_file_plus_own_rss(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V1, {
        "memory/outer/inner/memory.limit_in_bytes": f"{GiB}\n",
        "memory/outer/inner/memory.usage_in_bytes": f"{700 * MiB}\n",
        "memory/outer/inner/memory.stat": f"cache 1\ntotal_inactive_file {100 * MiB}\n",
    }, rss=50 * MiB)  # fmt: skip
    found = memory_limit(proc, root)
    assert found.bytes == GiB - 600 * MiB + 50 * MiB
    assert found.source == "cgroup v1 memory.limit_in_bytes - usage of /outer/inner"


def test_v2_memory_max_walks_up_and_max_is_unlimited(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V2, {
        "cgroup.controllers": "cpu memory\n",
        "outer/memory.max": f"{3 * GiB}\n",
        "outer/inner/memory.max": "max\n",
    })  # fmt: skip
    assert memory_limit(proc, root) == MemoryLimit(3 * GiB, "cgroup memory.max of /outer")
    proc, root = tree(tmp_path / "b", V2, {
        "cgroup.controllers": "memory\n",
        "outer/inner/memory.max": f"{GiB}\n",
        "outer/inner/memory.current": f"{GiB - 10 * MiB}\n",
    })  # fmt: skip
    assert memory_limit(proc, root) == MemoryLimit(
        10 * MiB, "cgroup v2 memory.max - usage of /outer/inner"
    )


def test_v2_on_a_hybrid_host_is_under_unified(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V2, {"unified/outer/inner/memory.max": f"{GiB}\n"})
    assert memory_limit(proc, root).bytes == GiB


def test_mem_available_when_no_cgroup_limits_and_unknown_when_nothing(tmp_path: Path) -> None:
    proc, root = tree(tmp_path, V1, {}, meminfo=3 * GiB, rss=100 * MiB)
    assert memory_limit(proc, root) == MemoryLimit(
        3 * GiB + 100 * MiB, "MemAvailable of /proc/meminfo"
    )
    # A smaller MemAvailable beats a cgroup limit.
    big = {"memory/outer/inner/memory.limit_in_bytes": f"{8 * GiB}"}
    proc, root = tree(tmp_path / "b", V1, big, meminfo=GiB)
    assert memory_limit(proc, root).source == "MemAvailable of /proc/meminfo"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert memory_limit(empty / "proc", empty / "sys") == MemoryLimit(None, "unknown")
    proc, root = tree(tmp_path / "c", "garbage\n4:memory:/x\n", {
        "memory/x/memory.limit_in_bytes": "not a number\n"}, meminfo=None)  # fmt: skip
    assert memory_limit(proc, root) == MemoryLimit(None, "unknown")


def test_the_byte_flags() -> None:
    assert parse_bytes("4GiB") == 4 * GiB and parse_bytes("512MiB") == 512 * MiB
    assert parse_bytes("1GB") == 10**9 and parse_bytes("1024") == 1024
    assert parse_bytes("1.5GiB") == 3 * GiB // 2 and parse_bytes("2k") == 2048
    assert parse_bytes_or_auto("auto") == "auto"
    for bad in ("", "-1", "0", "4 parsecs", "GiB", "١٢"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    config = NodeConfig.load(["--memory-limit", "4GiB", "--kv-budget-bytes", "256MiB"], {})
    assert config.memory_limit == 4 * GiB and config.kv_budget_bytes == 256 * MiB
    defaults = NodeConfig.load([], {})
    assert defaults.memory_limit == "auto" and defaults.kv_budget_bytes == "auto"
    env = NodeConfig.load([], {"MESHNET_MEMORY_LIMIT": "1GB"})
    assert env.memory_limit == 10**9
    with pytest.raises(SystemExit):
        NodeConfig.load(["--memory-limit", "lots"], {})


@pytest.fixture
def small_gguf(tmp_path: Path) -> Path:
    config = small_config()
    document = {**config.to_dict(), "model_type": "llama"}
    return write_gguf(tmp_path / "small.gguf", document, random_weights(config), qtype="Q8_0")


def node(model: Path, *flags: str, preexec_fn=None) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHNET_")}
    return subprocess.run(
        [sys.executable, "-m", "meshnet_node", "--model", str(model), "--layers", "0:2",
         "--port", "0", *flags],
        capture_output=True, text=True, env=env, timeout=60, preexec_fn=preexec_fn,
    )  # fmt: skip


def assert_refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stdout
    assert lines[0].startswith("meshnet-node: layers 0:2 of small.gguf need ")
    assert "may use" in lines[0]
    for word in words:
        assert word in lines[0]


def test_a_node_over_its_memory_limit_exits_2_with_one_line(small_gguf: Path) -> None:
    assert_refused(node(small_gguf, "--memory-limit", "1MiB"), "(--memory-limit)", "1 MiB")


def test_a_node_in_a_real_1gib_cgroup_refuses_a_2gib_stage(small_gguf: Path) -> None:
    with memory_cgroup(GiB) as (_, name, join):
        done = node(small_gguf, "--kv-budget-bytes", "2GiB", preexec_fn=join)
        assert_refused(done, "cgroup", name, "1.0 GiB")


def test_meshnet_run_checks_its_stages_together(
    small_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from meshnet_cli.__main__ import main

    assert main(["run", "--model", str(small_gguf), "--memory-limit", "100MiB", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("meshnet run: layers 0:2, 2:4 of small.gguf in one process need ")
    assert "this process may use 100 MiB (--memory-limit)" in err


def test_the_stage_exposes_its_footprint(small_gguf: Path) -> None:
    from meshnet_node.model_stage import load_model_stage

    stage = load_model_stage(small_gguf, "0:2", kv_budget_bytes="auto",
                             limit=MemoryLimit(GiB, "--memory-limit"))  # fmt: skip
    footprint = stage.describe()["footprint"]
    assert footprint["kv"] == stage.runner.budget.limit < GiB
    assert footprint["total"] == sum(footprint[k] for k in ("weights", "kv", "scratch", "runtime"))
