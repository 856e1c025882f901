"""Asking a real-model gateway for a chat answer, and reading its
speculation counters (the system tests of wire-2 §3.16's gateway side)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from support.model_surface import post
from support.security import get
from support.smollm2 import smollm2_gguf

PREFIX = "meshnet_openai_speculative_"


def chat_text(url: str, prompt: str, max_tokens: int, **sampling: Any) -> str:
    """The answer's text (greedy unless ``sampling`` says otherwise)."""
    body = {
        "model": smollm2_gguf().stem,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **(sampling or {"temperature": 0}),
    }
    answer = post(url, "/v1/chat/completions", body)
    assert answer.status == 200, answer.body[:500]
    return str(json.loads(answer.body)["choices"][0]["message"]["content"])


def spec_counters(url: str) -> dict[str, float]:
    """The gateway's ``meshnet_openai_speculative_*`` samples, by full name."""
    answer = get(url, "/metrics")
    assert answer.status == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(answer.body.decode())
        for sample in family.samples
        if sample.name.startswith(PREFIX)
    }
