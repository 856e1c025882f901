"""A checkpoint's own generation defaults (``generation_config.json``), applied
where a request leaves a parameter out.

What is read (anything else in the file is ignored, see docs/openai-api.md):

* ``do_sample: false`` written in the file → greedy (temperature 0) unless the
  request names a temperature; transformers' ``generate`` is greedy then.
* ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` →
  the request's default for each (the first four when ``do_sample`` is not
  false), as vLLM applies them.
* ``max_new_tokens`` → the default ``max_tokens`` (still capped by the context).

A value of the wrong type or out of the API's range is a clear error at
gateway start (the file is the operator's), never a surprise per request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from meshnet_model.sampling import REPETITION_PENALTY, SamplingParams

__all__ = ["GenerationDefaults"]

FILE = "generation_config.json"


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def load(cls, directory: str | Path) -> GenerationDefaults:
        path = Path(directory) / FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} is not a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = FILE) -> GenerationDefaults:
        def number(key: str, low: float, high: float) -> float | None:
            value = raw.get(key)
            if value is None:
                return None
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or not low <= value <= high:
                raise ValueError(f"{source}: {key}={value!r} is not a number in [{low}, {high}]")
            return float(value)

        def count(key: str) -> int | None:
            value = raw.get(key)
            if value is None:
                return None
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{source}: {key}={value!r} is not a non-negative integer")
            return value

        temperature = number("temperature", 0.0, 2.0)
        top_p = number("top_p", 0.0, 1.0)
        top_k = count("top_k")
        min_p = number("min_p", 0.0, 1.0)
        repetition = number("repetition_penalty", *REPETITION_PENALTY)
        if raw.get("do_sample") is False:
            # transformers ignores temperature/top_p/top_k/min_p when do_sample
            # is off (its repetition_penalty still applies to greedy search).
            temperature, top_p, top_k, min_p = 0.0, None, None, None
        return cls(
            temperature=temperature,
            top_p=top_p or None,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition,
            max_new_tokens=count("max_new_tokens") or None,
        )

    def sampling(self, given: SamplingParams, explicit: frozenset[str]) -> SamplingParams:
        """``given`` (the request's, with the API's defaults filled in) with each
        parameter the request did not name (``explicit``) taken from here."""
        changes: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and name not in explicit:
                changes[name] = value
        return replace(given, **changes) if changes else given
