"""The OpenAI-surface fuzz harness (fuzz/fuzz_openai_surface.py), bounded, in CI.

A real chain (two model nodes, a gateway with --model) takes mutated /v1
request bodies; every answer must be a whole HTTP answer — 200, or a 4xx
with the OpenAI error body — with no 5xx, nothing logged as an error, no
hang, and the chain answers a greedy question as before. The harness is
shown to catch a planted bug, and every input it (or issue 13) flagged is
replayed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from meshnet_gateway.openai.requests import REFUSED
from meshnet_gateway.openai.tokenizer import ModelTokenizer

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"


def load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fuzz_openai_surface", FUZZ / "fuzz_openai_surface.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


harness = load_harness()
REGRESSIONS = sorted((FUZZ / "regressions").glob("openai-*.bin"))
CI_RUNS = 250  # a few seconds on the 2-core CI box; the long run is in fuzz/README.md

pytestmark = pytest.mark.anyio


async def test_bounded_fuzz_run_over_the_openai_surface() -> None:
    chain = await harness.run_bounded_async(seconds=None, runs=CI_RUNS, seed=20261201)
    assert chain.inputs == CI_RUNS
    # The run reached generation, not only the parser's refusals.
    assert {200, 400} <= set(chain.statuses)


async def test_every_flagged_input_replays_cleanly() -> None:
    assert len(REGRESSIONS) >= 6
    async with harness.running_chain() as chain:
        for path in REGRESSIONS:
            status = await chain.run_input(path.read_bytes())
            assert status in (200, 400), path.name
        await chain.check_alive()


async def test_the_harness_catches_an_unhandled_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ModelTokenizer.encode

    def buggy(self, text, **kwargs):  # type: ignore[no-untyped-def]
        if "planted" in text:
            raise RuntimeError("planted bug")
        return original(self, text, **kwargs)

    monkeypatch.setattr(ModelTokenizer, "encode", buggy)
    async with harness.running_chain() as chain:
        body = b'{"model": "fuzz-model", "prompt": "planted", "max_tokens": 1}'
        with pytest.raises(harness.InvariantBroken, match="500"):
            await chain.run_input(harness.encode_input(harness.PATHS[0], body))
        chain.errors.records.clear()
        await chain.check_alive()  # the gateway survived its bug


def test_the_answer_checker_refuses_what_a_gateway_must_not_send() -> None:
    error = (
        b'{"error": {"message": "m", "type": "invalid_request_error", "param": null, "code": null}}'
    )
    ok = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)
    assert harness.check_answer(ok) == 400
    for bad in (
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
        b"6\r\ndata: \r\n0\r\n\r\n",
        b"garbage",
    ):
        with pytest.raises(harness.InvariantBroken):
            harness.check_answer(bad)


def test_the_fuzzer_mutates_every_field_the_api_implements_or_refuses() -> None:
    """Issue 22's fields (docs/openai-api.md): each implemented one and each one
    refused by name is a field the harness mutates, so a hostile value of any
    of them is tried against the no-500 invariants."""
    implemented = {"top_logprobs", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                   "stop_token_ids", "response_format", "best_of", "metadata",
                   "prompt_cache_key", "safety_identifier", "tools", "tool_choice",
                   "parallel_tool_calls"}  # fmt: skip
    missing = (implemented | set(REFUSED)) - set(harness.FIELDS)
    assert not missing, sorted(missing)
