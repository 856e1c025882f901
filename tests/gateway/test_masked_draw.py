"""A constrained token drawn at the last stage (its grammar's mask sent
along, wire-2 §3.13's ``X-Meshnet-Allow``) is the token the gateway draws
from the relayed logits with the grammar itself: token for token, at any
temperature, the grammar's state advanced either way."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from meshnet_gateway.openai.drawn import spec_for_last_stage
from meshnet_gateway.openai.grammar import GrammarCompiler
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_node.draw import draw_answer, mask_of
from support.smollm2 import smollm2_gguf

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "kind": {"enum": ["a", "bb", "ccc"]},
    },
    "required": ["name", "n", "kind"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = ModelTokenizer.load(smollm2_gguf())
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + 64)  # a padded logits row


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, logprobs=3),
    ],
    ids=["greedy", "t1", "cuts"],
)
def test_the_last_stage_draws_what_the_gateway_would(
    compiler: GrammarCompiler, params: SamplingParams
) -> None:
    grammar = compiler.json_schema(SCHEMA, "response_format")
    here = Sampler(params, 11, grammar.constraint())
    there = Sampler(params, 11, grammar.constraint())
    stops = frozenset({2})
    here.begin([5, 6, 7], stops)
    there.begin([5, 6, 7], stops)
    rng = np.random.default_rng(3)
    drawn_here: list[int] = []
    drawn_there: list[int] = []
    for step in range(80):
        logits = (rng.standard_normal(compiler.width) * 4).astype(np.float32)
        position = 3 + step
        spec = anyio.run(spec_for_last_stage, there)
        assert spec is not None and spec.allow is not None
        assert mask_of(spec.allow, compiler.width) is not None
        answer = draw_answer(logits[None, :], spec, position)
        token = int(answer[0, 0])
        there.record(None, token)
        drawn_there.append(token)
        drawn_here.append(here(logits, position))
        if token in stops:
            break
    assert drawn_there == drawn_here
    assert drawn_here[-1] in stops  # the grammar let the answer end


def test_a_mask_of_another_width_or_with_stray_bits_is_not_used() -> None:
    assert mask_of(b"\xff", 9) is None  # 9 ids need 2 bytes
    assert mask_of(b"\xff\x03", 9) is None  # bit 9 is past the row
    assert mask_of(b"\xff\x01", 9) is not None
    row = np.zeros((1, 9), dtype=np.float32)
    from meshnet_proto.lowlevel import SampleSpec

    spec = SampleSpec(seed=1, allow=b"\xff\x03")
    assert draw_answer(row, spec, 0) is row  # answered as logits: the sender draws
    none_finite = SampleSpec(seed=1, allow=b"\x01\x00")
    row[0, 0] = -np.inf
    assert draw_answer(row, none_finite, 0) is row
