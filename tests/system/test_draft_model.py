"""A draft model at the gateway, over real processes (issue 38, ``--draft-model``).

SmolLM2-135M-Instruct (Q4_1 GGUF) split over 2 node processes, and gateway
processes over that chain: ``--speculate off``, prompt lookup (the default)
and ``--draft-model`` naming the same file — a draft model that is the
target itself, so nearly every draft is right. On free prose, where prompt
lookup finds little to copy, greedy answers are equal character for
character, the draft model's drafts are accepted more than 90 % of the
time (and lookup's far less), the access line and ``/info`` name the
drafter, and the draft sessions are gone once the answers are.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from support.gateway import stop
from support.model_surface import info, spawn_logged
from support.smollm2 import smollm2_gguf
from support.speculation import PREFIX, chat_text, spec_counters

pytestmark = pytest.mark.slow

LAYERS = 30  # SmolLM2-135M's
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe a walk through an autumn forest.",
]
TOKENS = 48


@contextmanager
def gateways(logs: Path) -> Iterator[dict[str, str]]:
    """Two nodes over SmolLM2's layers; the URLs of a gateway per drafter
    ("off", "lookup", "model")."""
    model = str(smollm2_gguf())
    with ExitStack() as stack:

        def start(module: str, args: list[str], name: str) -> str:
            proc, url = spawn_logged(module, args, logs / f"{name}.log")
            stack.callback(lambda: proc.poll() is None and stop(proc))
            return url

        flags = ["--model", model, "--threads", "1"]
        last = start("meshnet_node", [*flags, "--layers", f"{LAYERS // 2}:{LAYERS}"], "node1")
        first = start(
            "meshnet_node", [*flags, "--layers", f"0:{LAYERS // 2}", "--next", last], "n0"
        )
        entry = ["--entry", first, "--model", model, "--log-level", "info"]
        yield {
            "off": start("meshnet_gateway", [*entry, "--speculate", "off"], "off"),
            "lookup": start("meshnet_gateway", entry, "lookup"),
            "model": start("meshnet_gateway", [*entry, "--draft-model", model], "model"),
        }


def test_a_draft_model_drafts_free_prose_and_answers_what_plain_decoding_does(
    tmp_path: Path,
) -> None:
    with gateways(tmp_path) as urls:
        for prompt in PROSE:
            expected = chat_text(urls["off"], prompt, TOKENS)
            assert chat_text(urls["model"], prompt, TOKENS) == expected, prompt
            assert chat_text(urls["lookup"], prompt, TOKENS) == expected, prompt
        model, lookup = (
            {k.removeprefix(PREFIX): v for k, v in spec_counters(url).items()}
            for url in (urls["model"], urls["lookup"])
        )
        document = info(urls["model"])
        assert info(urls["lookup"])["speculate"]["drafter"] == "lookup"
        assert info(urls["off"])["speculate"] is None
    drafted, accepted = model["drafted_tokens_total"], model["accepted_tokens_total"]
    assert drafted >= TOKENS and accepted / drafted > 0.9, model
    assert model["fallbacks_total"] == 0
    # The same answers drafted by prompt lookup: little of free prose is a copy.
    assert lookup["accepted_tokens_total"] < accepted / 2, (lookup, model)
    speculate = document["speculate"]
    assert speculate["drafter"] == "model"
    draft = speculate["draft_model"]
    assert draft["model"] == smollm2_gguf().stem and draft["layers"] == LAYERS
    assert (draft["sessions"], draft["kv_bytes_in_use"]) == (0, 0)  # ended with the answers
    assert 0 < draft["kv_budget_bytes"] <= 1024**3
    lines = re.findall(
        r" drafted=(\d+) accepted=(\d+) drafter=(\w+) ", (tmp_path / "model.log").read_text()
    )
    assert len(lines) == len(PROSE) and {d for _, _, d in lines} == {"model"}
    assert sum(int(a) for _, a, _ in lines) == accepted
