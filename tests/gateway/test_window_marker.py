"""The window answer's marker, ``X-Meshnet-Accepted`` (wire-2 §3.16), at the gateway.

A last stage that draws (§3.13) but does not verify windows ignores
``X-Meshnet-Draft`` and answers int32 ``[1, 1]``: the token drawn after the
window's *last* row. Without the marker that answer looks like a window
whose first draft was rejected, and the token is for another position. The
gateway reads the count: without it, the window was not verified (the
generation goes on plainly, as for logits); with one the tokens contradict,
the last stage lied (502).
"""

from __future__ import annotations

import numpy as np
import pytest

from meshnet_gateway.openai.drawn import Drawn
from meshnet_gateway.openai.speculation import Speculate
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_gateway.openai.window_answer import read_window
from meshnet_model.sampling import SamplingParams
from meshnet_node.draw import draw_answer
from meshnet_proto import MeshnetError, WireHeaders
from meshnet_proto.lowlevel import SampleSpec
from support.fake_verifier import FakeVerifier, ScriptModel

from .test_speculation import GREEDY, WARM, P, model, plain, run, same, tokenizer, value

__all__ = ["tokenizer"]  # the module's fixture, shared

pytestmark = pytest.mark.anyio

SPEC = SampleSpec(seed=1)
DRAFTS = [5, 6, 7]


class DrawsPastTheDrafts(FakeVerifier):
    """A last stage with §3.13 but not §3.16: a window is a plain sampled
    chunk to it, answered the token drawn after its last row, int32 ``[1, 1]``,
    without ``X-Meshnet-Accepted``."""

    def __init__(self, script: ScriptModel) -> None:
        super().__init__(script, windows_as_logits=True)  # runs windows plainly, no count

    async def forward(self, headers: WireHeaders, ids: np.ndarray) -> tuple[int, object]:
        status, answer = await super().forward(headers, ids)
        if status == 200 and headers.draft is not None and headers.sample is not None:
            assert isinstance(answer, np.ndarray)  # the last row's logits: draw from them
            answer = draw_answer(answer, headers.sample, (headers.position or 0) + ids.size)
        return status, answer


class MiscountingVerifier(FakeVerifier):
    """Verifies windows, but its count of accepted drafts is off by one."""

    def accepted(self, headers: WireHeaders, answer: np.ndarray) -> int | None:
        count = super().accepted(headers, answer)
        if count is None or headers.draft is None:
            return count
        return count + 1 if count < len(headers.draft) else count - 1


# ------------------------------------------------------------------ read_window


def test_tokens_without_the_count_are_a_window_never_verified() -> None:
    assert read_window(np.array([[9]], "<i4"), SPEC, DRAFTS, "u", None) is None
    assert read_window(np.array([[5, 9]], "<i4"), SPEC, DRAFTS, "u", None) is None
    assert read_window(np.array([[9]], "<i4"), SPEC, DRAFTS, "u", 0) == [Drawn(9)]
    whole = read_window(np.array([[5, 6, 7, 1]], "<i4"), SPEC, DRAFTS, "u", 3)
    assert whole == [Drawn(5), Drawn(6), Drawn(7), Drawn(1)]
    rows = np.array([[5, -0.1, 5, -0.1], [4, -2.0, 6, -0.5]], "<f4")  # logprobs=1: one a token
    drawn = read_window(rows, SampleSpec(seed=1, logprobs=1), DRAFTS, "u", 1)
    assert drawn is not None and [d.token for d in drawn] == [5, 4]
    assert read_window(rows, SampleSpec(seed=1, logprobs=1), DRAFTS, "u", None) is None


@pytest.mark.parametrize(
    ("tokens", "count"),
    [
        ([5, 6, 9], 1),  # fewer than its tokens say
        ([5, 6, 9], 3),  # more
        ([9], 1),  # more than it has
        ([5, 6], 1),  # "rejected" draft 2 (6), yet answered 6 in its place
    ],
    ids=["fewer", "more", "past", "rejected-but-equal"],
)
def test_a_count_that_contradicts_the_tokens_is_502(tokens: list[int], count: int) -> None:
    with pytest.raises(MeshnetError) as caught:
        read_window(np.array([tokens], "<i4"), SPEC, DRAFTS, "http://last", count)
    assert (caught.value.status, caught.value.code) == (502, "downstream_bad_response")
    assert caught.value.hop == "http://last"


def test_logits_with_a_count_are_502() -> None:
    with pytest.raises(MeshnetError) as caught:
        read_window(np.zeros((1, 320), "<f4"), SPEC, DRAFTS, "u", 0)
    assert (caught.value.status, caught.value.code) == (502, "downstream_bad_response")


# ------------------------------------------------------------------ generations


@pytest.mark.parametrize("params", [GREEDY, WARM], ids=["greedy", "warm"])
async def test_a_last_stage_that_ignores_the_drafts_is_fallen_back_from(
    tokenizer: ModelTokenizer, params: SamplingParams
) -> None:
    """Its ``[1, 1]`` answers carry no count: the gateway uses none of them,
    deletes the session and goes on plainly — the text is the plain one."""
    script = model({P + 9: 200})
    fake = DrawsPastTheDrafts(script)
    spec = await run(fake, tokenizer, Speculate(8, 2), params)
    assert spec.error is None and fake.windows
    same(spec.result, (await plain(tokenizer, script, params=params)).result)
    assert value(spec.metrics, "fallbacks") == 1
    first = fake.seen[0].session
    assert first in fake.deleted
    assert all(h.draft is None for h in fake.seen if h.session != first)


async def test_a_miscounted_window_fails_the_generation_502(tokenizer: ModelTokenizer) -> None:
    spec = await run(MiscountingVerifier(model({P + 9: 200})), tokenizer, Speculate(8, 2))
    assert spec.error is not None and spec.fake.windows
    assert (spec.error.status, spec.error.code) == (502, "downstream_bad_response")
    assert value(spec.metrics, "fallbacks") == 0
