"""Speculative decoding at the gateway (issue 38, wire-2 §3.16), the loop's logic.

The gateway's generation in process against a scripted last stage
(``support.fake_verifier``) that holds each session's tokens, routes chunks
by ``X-Meshnet-After`` and verifies windows with the node's own functions,
over a "model" that prefers a repeated pattern (``D`` … ``W``, twenty
tokens) so that prompt lookup drafts well. Every case compares with the
same generation with speculation off: the tokens, text, finish reason and
logprobs are those plain decoding gives — greedy and seeded at temperature
0.8, one window or several in flight, a rejection in the first window and
after a whole one, a
stop id, a stop string or ``max_tokens`` inside a window, a chain that
answers windows with logits, samplers that need their history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from meshnet_cli.run_flags import GATEWAY_ONLY
from meshnet_gateway.access import AccessRecord, line
from meshnet_gateway.config import GatewayConfig
from meshnet_gateway.openai.drawn import Drawn
from meshnet_gateway.openai.generation import ChainSession, generate
from meshnet_gateway.openai.metrics import GenerationMetrics
from meshnet_gateway.openai.output import GenerationResult
from meshnet_gateway.openai.prefix_index import PrefixIndex
from meshnet_gateway.openai.speculation import PLAIN_AFTER_REFUSAL, Speculate
from meshnet_gateway.openai.timing import RequestTiming
from meshnet_gateway.openai.tokenizer import ModelTokenizer
from meshnet_gateway.openai.window_answer import read_window
from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_proto import MeshnetError, WireHeaders
from meshnet_proto.lowlevel import SampleSpec
from meshnet_runtime.codec_pool import CodecPool
from meshnet_runtime.downstream import DownstreamPool
from support.fake_verifier import FakeVerifier, ScriptModel, fake_verifier, scripted_settings
from support.openai import write_model_dir

pytestmark = pytest.mark.anyio

PATTERN = list(range(40, 60))  # "DEFGHIJKLMNOPQRSTUVW" in the test tokenizer
PROMPT = PATTERN * 3
P = len(PROMPT)  # the first generated token's position
VOCAB = 320
EOS = 1
GREEDY = SamplingParams(temperature=0.0)
WARM = SamplingParams(temperature=0.8)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    return ModelTokenizer.load(write_model_dir(tmp_path_factory.mktemp("spec") / "m"))


def model(deviations: dict[int, int] | None = None) -> ScriptModel:
    return ScriptModel(PATTERN, VOCAB, deviations)


@dataclass
class Run:
    result: GenerationResult
    fake: FakeVerifier
    chain: ChainSession
    metrics: GenerationMetrics
    prefix: PrefixIndex | None
    error: MeshnetError | None = None  # the generation's failure, if it failed


async def run(
    fake: FakeVerifier,
    tokenizer: ModelTokenizer,
    speculate: Speculate | None,
    params: SamplingParams = GREEDY,
    *,
    max_tokens: int = 30,
    stop: Sequence[str] = (),
    sample_at: str = "last-stage",
    prefix: bool = False,
) -> Run:
    metrics = GenerationMetrics(CollectorRegistry())
    index = PrefixIndex() if prefix else None
    settings = scripted_settings(speculate, index)
    async with fake_verifier(fake) as url:
        pool = DownstreamPool(url)
        chain = ChainSession(pool, CodecPool(), settings, metrics=metrics)
        result, error = GenerationResult(len(PROMPT)), None
        try:
            result = await generate(
                chain,
                tokenizer,
                PROMPT,
                max_tokens=max_tokens,
                sampler=Sampler(params, 7),
                stop=stop,
                sample_at=sample_at,
                speculate=speculate,
            )
        except MeshnetError as exc:  # caught here: the fake's task group would wrap it
            error = exc
        finally:
            await chain.close()
            await pool.aclose()
    return Run(result, fake, chain, metrics, index, error)


async def plain(tokenizer: ModelTokenizer, script: ScriptModel, **kwargs: object) -> Run:
    return await run(FakeVerifier(script), tokenizer, None, **kwargs)  # type: ignore[arg-type]


def same(mine: GenerationResult, theirs: GenerationResult) -> None:
    assert mine.completion_tokens > 0
    assert mine.token_ids == theirs.token_ids
    assert (mine.text, mine.finish_reason) == (theirs.text, theirs.finish_reason)
    assert mine.completion_tokens == theirs.completion_tokens
    assert mine.logprobs == theirs.logprobs


def value(metrics: GenerationMetrics, name: str) -> float:
    return float(getattr(metrics.speculation, name)._value.get())


@pytest.mark.parametrize("windows", [1, 2, 3])
@pytest.mark.parametrize("params", [GREEDY, WARM], ids=["greedy", "seeded-0.8"])
async def test_windows_give_exactly_the_plain_tokens(
    tokenizer: ModelTokenizer, windows: int, params: SamplingParams
) -> None:
    script = model({P + 9: 200, P + 23: 201})  # two places where the lookup is wrong
    spec = await run(FakeVerifier(script), tokenizer, Speculate(8, windows), params)
    same(spec.result, (await plain(tokenizer, script, params=params)).result)
    assert spec.fake.windows, "no window was sent"
    drafted, accepted = (
        value(spec.metrics, "drafted_tokens"),
        value(spec.metrics, "accepted_tokens"),
    )
    assert 0 < accepted <= drafted
    assert (spec.chain.drafted, spec.chain.accepted) == (drafted, accepted)
    if params is GREEDY:  # fewer trips than tokens: that is the point
        assert len(spec.fake.seen) < spec.result.completion_tokens // 2


async def test_one_window_at_a_time_until_one_is_accepted_whole(
    tokenizer: ModelTokenizer,
) -> None:
    """The first window's second draft is wrong: it went alone (nothing is
    pipelined on the prior), so the next chunk is its correction, not a
    window sent behind it and now stale."""
    script = model({P + 2: 210})
    spec = await run(FakeVerifier(script), tokenizer, Speculate(4, 2))
    same(spec.result, (await plain(tokenizer, script)).result)
    _prompt, first, correction = spec.fake.seen[:3]
    assert first.position == P and first.draft is not None
    assert correction.position == P + 2  # t, the accepted draft, then the correction
    assert correction.after is not None and correction.after.position == P + 5


async def test_a_rejection_after_a_whole_window_stales_the_next_and_rewinds(
    tokenizer: ModelTokenizer,
) -> None:
    """The first window is accepted whole, so the next two go pipelined; the
    second's second draft is wrong: the third (held back at the node until it
    arrived: both were in flight) is stale, and the next chunk rewinds after
    it in epoch 1."""
    script = model({P + 7: 210})
    fake = FakeVerifier(script, hold_window=2)
    spec = await run(fake, tokenizer, Speculate(4, 2))
    same(spec.result, (await plain(tokenizer, script)).result)
    assert fake.windows[0].position == P and fake.windows[0].shape[1] == 5  # t and 4 drafts
    second, third = sorted(fake.windows[1:3], key=lambda h: h.position or 0)
    assert second.position == P + 5 and second.after is not None
    assert third.position == (second.position or 0) + second.shape[1]
    assert third.after is not None and (third.after.position, third.after.epoch) == (
        third.position,
        0,
    )
    rewinds = [h for h in fake.seen if h.after is not None and (h.position or 0) < h.after.position]
    assert rewinds and rewinds[0].position == P + 7  # t, the accepted draft, then the correction
    assert rewinds[0].after is not None and rewinds[0].after.epoch == 1
    assert rewinds[0].after.position == (third.position or 0) + third.shape[1]
    assert value(spec.metrics, "stale") >= 1


@pytest.mark.parametrize(
    ("stop", "deviations"),
    [((), {P + 6: EOS}), (("KLM",), {}), (("MN", "Q"), {P + 3: 202})],
    ids=["stop-id", "stop-string", "two-stops"],
)
async def test_a_stop_inside_a_window_cuts_there(
    tokenizer: ModelTokenizer, stop: tuple[str, ...], deviations: dict[int, int]
) -> None:
    script = model(deviations)
    spec = await run(FakeVerifier(script), tokenizer, Speculate(8, 2), stop=stop)
    same(spec.result, (await plain(tokenizer, script, stop=stop)).result)
    assert spec.result.finish_reason == "stop"
    assert spec.fake.windows


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9, 10, 17])
async def test_max_tokens_inside_a_window(tokenizer: ModelTokenizer, max_tokens: int) -> None:
    """No window reaches past ``max_tokens``: the nodes never hold a
    position the generation may not take."""
    script = model()
    spec = await run(FakeVerifier(script), tokenizer, Speculate(8, 3), max_tokens=max_tokens)
    same(spec.result, (await plain(tokenizer, script, max_tokens=max_tokens)).result)
    assert spec.result.completion_tokens == max_tokens
    for head in spec.fake.seen:
        assert (head.position or 0) + head.shape[1] <= P + max_tokens - 1 or head.position == 0


async def test_windows_answered_with_logits_go_on_plainly(tokenizer: ModelTokenizer) -> None:
    """A last stage without §3.16 answers a window as a plain chunk (its last
    row's logits): the session is replaced by one holding the accepted
    tokens, and the generation goes on without windows."""
    script = model({P + 9: 200})
    fake = FakeVerifier(script, windows_as_logits=True)
    spec = await run(fake, tokenizer, Speculate(8, 2), WARM)
    same(spec.result, (await plain(tokenizer, script, params=WARM)).result)
    assert value(spec.metrics, "fallbacks") == 1
    first = fake.seen[0].session
    assert first in fake.deleted
    later = [h for h in fake.seen if h.session != first]
    assert later[0].position == 0 and later[0].shape[1] == P + 1  # prompt + the first token
    assert all(h.draft is None and h.after is None for h in later)


async def test_a_stage_that_cannot_verify_leaves_the_next_generations_plain(
    tokenizer: ModelTokenizer,
) -> None:
    """400 ``bad_draft`` to a well-formed window: the last stage's stage
    makes one row of logits (a stub). The generation starts over plainly,
    and the gateway's next generations send no window."""
    script = model({P + 9: 200})

    def refuse(headers: WireHeaders) -> str | None:
        return "bad_draft" if headers.draft is not None else None

    speculate = Speculate(8, 2)
    first = await run(FakeVerifier(script, refuse=refuse), tokenizer, speculate)
    same(first.result, (await plain(tokenizer, script)).result)
    assert value(first.metrics, "fallbacks") == 1 and first.fake.deleted
    second = await run(FakeVerifier(script, refuse=refuse), tokenizer, speculate)
    same(second.result, first.result)
    assert not second.fake.windows and speculate.support.plain_for == PLAIN_AFTER_REFUSAL - 1


@pytest.mark.parametrize(
    ("params", "sample_at"),
    [
        (SamplingParams(temperature=0.0, repetition_penalty=1.3), "last-stage"),
        (SamplingParams(temperature=0.8, logit_bias=((45, 2.0),)), "last-stage"),
        (GREEDY, "gateway"),
    ],
    ids=["penalty", "logit-bias", "sample-at-gateway"],
)
async def test_no_windows_where_the_gateway_draws(
    tokenizer: ModelTokenizer, params: SamplingParams, sample_at: str
) -> None:
    script = model()
    spec = await run(FakeVerifier(script), tokenizer, Speculate(), params, sample_at=sample_at)
    same(spec.result, (await plain(tokenizer, script, params=params, sample_at=sample_at)).result)
    assert not spec.fake.windows


async def test_min_tokens_windows_once_its_mask_lifts(tokenizer: ModelTokenizer) -> None:
    params = SamplingParams(temperature=0.0, min_tokens=4)
    script = model({P + 2: EOS})  # masked: the pattern goes on
    spec = await run(FakeVerifier(script), tokenizer, Speculate(), params)
    same(spec.result, (await plain(tokenizer, script, params=params)).result)
    assert spec.fake.windows and min(h.position or 0 for h in spec.fake.windows) >= P + 3


async def test_logprobs_come_per_token_from_windows(tokenizer: ModelTokenizer) -> None:
    params = SamplingParams(temperature=0.8, logprobs=2)
    script = model({P + 7: 203})
    spec = await run(FakeVerifier(script), tokenizer, Speculate(6, 2), params)
    same(spec.result, (await plain(tokenizer, script, params=params)).result)
    assert spec.fake.windows and spec.result.logprobs


async def test_the_prefix_index_holds_only_filed_blocks(tokenizer: ModelTokenizer) -> None:
    """Windows carry no block keys: blocks that end inside one are never
    filed, and the prefix index must not believe the chain holds them."""
    spec = await run(FakeVerifier(model()), tokenizer, Speculate(), max_tokens=70, prefix=True)
    assert spec.prefix is not None and spec.fake.windows
    announced = {key for h in spec.fake.seen for key in h.prefix_blocks}
    assert all(h.prefix_blocks == () for h in spec.fake.windows)
    assert len(spec.prefix) >= 1 and set(spec.prefix._keys) <= announced
    # The session's history is the accepted tokens: all but the last, never sent.
    assert spec.chain.history == PROMPT + spec.result.token_ids[:-1]
    assert len(spec.chain.block_keys) == len(spec.chain.history) // 32


async def test_a_stale_window_that_failed_fails_the_generation_at_once(
    tokenizer: ModelTokenizer,
) -> None:
    """The window after a rejected one was refused: it never ran, and the
    rewind behind it would wait at the node until its timeout; the
    generation fails at once with the refusal instead."""

    def refuse(headers: WireHeaders) -> str | None:
        # The third window: pipelined behind the second (P + 5, t and 8 drafts)
        # once the first was accepted whole.
        return "chunk_conflict" if headers.draft and headers.position == P + 14 else None

    fake = FakeVerifier(model({P + 7: 210}), refuse=refuse)
    failed = await run(fake, tokenizer, Speculate(4, 2))
    assert failed.error is not None and failed.error.code == "chunk_conflict"
    assert failed.fake.seen[-1].session in failed.fake.deleted


def test_read_window_refuses_what_no_window_is_answered() -> None:
    spec, drafts = SampleSpec(seed=1), [5, 6, 7]
    assert read_window(np.array([[5, 6, 9]], "<i4"), spec, drafts, "u", 2) == [
        Drawn(5),
        Drawn(6),
        Drawn(9),
    ]
    assert read_window(np.zeros((1, 320), "<f4"), spec, drafts, "u", None) is None  # logits
    for forged in (
        np.array([[5, 8, 9]], "<i4"),  # departs from the drafts before its end
        np.array([[5, 6, 7, 8, 9]], "<i4"),  # more than k + 1
        np.array([[-1]], "<i4"),
        np.zeros((2, 320), "<f4"),
        np.zeros((1, 0), "<i4"),
    ):
        with pytest.raises(MeshnetError) as caught:
            read_window(forged, spec, drafts, "http://hop", None)
        assert (caught.value.status, caught.value.code) == (502, "downstream_bad_response")
    rows = np.array([[5, -0.1, 5, -0.1], [4, -2.0, 6, -0.5]], "<f4")
    drawn = read_window(rows, SampleSpec(seed=1, logprobs=1), drafts, "u", 1)
    assert drawn is not None and [d.token for d in drawn] == [5, 4]


@pytest.mark.parametrize(
    "argv",
    [
        ["--speculate", "maybe"],
        ["--speculate-max-draft", "0"],
        ["--speculate-max-draft", "65"],
        ["--speculate-max-draft", "eight"],
        ["--speculate-windows", "0"],
        ["--speculate-windows", "9"],
    ],
)
def test_bad_speculate_flags_are_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        GatewayConfig.load(["--entry", "http://127.0.0.1:1", *argv], environ={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and argv[0] in err


def test_speculate_flags_defaults_environment_and_meshnet_run() -> None:
    config = GatewayConfig.load(["--entry", "http://127.0.0.1:1"], environ={})
    assert (config.speculate, config.speculate_max_draft, config.speculate_windows) == (
        "lookup",
        8,
        2,
    )
    env = {"MESHNET_SPECULATE": "off", "MESHNET_SPECULATE_WINDOWS": "8"}
    config = GatewayConfig.load(["--entry", "http://x:1", "--speculate-max-draft", "64"], env)
    assert (config.speculate, config.speculate_max_draft, config.speculate_windows) == (
        "off",
        64,
        8,
    )
    assert {"--speculate", "--speculate-max-draft", "--speculate-windows"} <= set(GATEWAY_ONLY)


def test_the_access_line_says_drafted_and_accepted() -> None:
    timing = RequestTiming(arrived=0.0, prompt_tokens=5, drafted=12, accepted=9)
    text = line(AccessRecord("POST", "/v1/completions", "127.0.0.1", 0.0, timing), 200, 1.0)
    assert " drafted=12 accepted=9 " in text
