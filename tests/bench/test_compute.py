"""``meshnet bench --only compute`` in its smallest mode (toy files, llama.cpp
not found: the issue's figures quoted), and the llama.cpp plumbing against
stand-in binaries. No timing is asserted."""

from __future__ import annotations

import math
import stat
import sys
from pathlib import Path

import pytest

from meshnet_bench import _llama_cpp as llama
from meshnet_bench import compute
from meshnet_bench._result import BenchOptions
from meshnet_bench.runner import SECTIONS, render


@pytest.mark.slow  # four server processes start, each importing torch
def test_compute_section_tiny_reports_every_figure_against_the_quoted_baseline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(llama.ENV, str(tmp_path))  # no llama.cpp there: quoted
    lines: list[str] = []
    result = compute.run(BenchOptions(tiny=True, progress=lines.append))
    keys = result.keys
    assert "compute" in SECTIONS
    assert set(keys) == set(compute.KEYS)
    for figure in ("prefill", "decode", "streams16", "scaling16", "stages2", "bf16", "ready",
                   "busy"):  # fmt: skip
        for side in ("meshnet", "baseline", "ratio"):
            value = keys[f"compute_{figure}_{side}"]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (figure, side)
    # Quoted: llama.cpp's side is the figure, named so.
    assert keys["compute_llama_cpp"] == "quoted"
    assert keys["compute_prefill_baseline"] == llama.QUOTED["prefill_tok_s"]
    assert keys["compute_ready_baseline"] == llama.QUOTED["ready_s"]
    assert keys["compute_llama_busy_over_quiet"] is None
    # The ready figure is a start that maps the cache a first start wrote.
    assert isinstance(keys["compute_ready_cold"], float) and keys["compute_ready_cold"] > 0
    assert any("weights cache cold" in note for note in result.notes)
    assert keys["compute_errors"] == "0"
    assert keys["compute_amx"] in (0, 1)
    text = render([result], keys, "header")
    assert "quoted" in text and "AMX" in text
    assert len(result.rows) == 8
    assert any("busy loops" in row["figure"] for row in result.rows)
    assert any("prefill" in line for line in lines)


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
asked = []
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        asked.append(self.path)
        self.send_response(200 if len(asked) > 2 else 503)  # loading, then ready
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_llama_cpp_directory_is_found_run_and_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _script(tmp_path / "llama-bench",
            "import json, sys\nassert '-t' in sys.argv and '-r' in sys.argv\n"
            "print(json.dumps([{'n_prompt': 512, 'avg_ts': 117.5}]))\n")  # fmt: skip
    _script(tmp_path / "llama-server", FAKE_SERVER)
    monkeypatch.setenv(llama.ENV, str(tmp_path))
    build, found = llama.find()
    assert build is not None and found == f"{llama.ENV}={tmp_path}"
    assert llama.llama_bench(build, tmp_path / "m.gguf", prompt=512, generate=0) == 117.5
    with llama.llama_server(build, tmp_path / "m.gguf", ["-c", "64"]) as server:
        assert server.ready_s > 0 and server.url.startswith("http://127.0.0.1:")
        pid = server.pid
    assert not Path(f"/proc/{pid}").exists()  # stopped and reaped


def test_a_directory_without_llama_cpp_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "llama-bench").write_text("not executable")
    monkeypatch.setenv(llama.ENV, str(tmp_path))
    build, why = llama.find()
    assert build is None and "no executable llama-bench" in why
