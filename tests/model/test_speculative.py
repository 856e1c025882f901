"""Issue 38: verifying a drafted window (meshnet_model.speculative).

* greedy and point-mass verification give token for token what plain
  decoding gives (a toy model whose logits depend on the context, windows
  cut and drafts corrupted by hypothesis; ties, -inf, penalties, logit_bias,
  min_tokens and stop ids included);
* the emitted token's distribution is the target's (chi-square over 20,000
  seeded one-token windows, for a fixed draft, the literal point-mass rule
  and a general draft distribution);
* a seed reproduces a window, the sub-streams share no Philox block, and
  the all-accepted, all-rejected and refused windows.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_model.sampling import Sampler, SamplingParams, draw_generator
from meshnet_model.speculative import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    substream,
    verify_greedy,
    verify_sampled,
)

VOCAB = 5
EOS = 0
PROMPT = (1, 2, 3)


def toy_row(context: list[int]) -> np.ndarray:
    """A toy model's logits after ``context``: small integers (ties are
    common), some -inf, never id 2 (no stop id: min_tokens always has a choice)."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()))
    row = rng.integers(-2, 3, size=VOCAB).astype(np.float64)
    row[(rng.random(VOCAB) < 0.15) & (np.arange(VOCAB) != 2)] = -np.inf
    return row


def plain_decode(sampler: Sampler, count: int) -> list[int]:
    context, out = list(PROMPT), list[int]()
    while len(out) < count and not (out and out[-1] in sampler.stop_ids):
        out.append(sampler(toy_row(context), position=len(context)))
        context.append(out[-1])
    return out


def speculative_decode(
    sampler: Sampler | None, expected: list[int], count: int, data: st.DataObject
) -> list[int]:
    """Up to ``count`` tokens in windows of 0-4 drafts, each draft the true
    next token or (by hypothesis) another, verified against the toy model."""
    stops = frozenset() if sampler is None else sampler.stop_ids
    context, out = list(PROMPT), list[int]()
    while len(out) < count and not (out and out[-1] in stops):
        k = data.draw(st.integers(0, 4))
        guesses = data.draw(st.lists(st.none() | st.integers(0, VOCAB - 1), min_size=k, max_size=k))
        truth = expected[len(out) :] + [EOS] * k
        drafts = [truth[i] if g is None else g for i, g in enumerate(guesses)]
        rows = np.stack([toy_row(context + drafts[:i]) for i in range(k + 1)])
        if sampler is None:
            tokens = verify_greedy(rows, drafts)
        else:
            tokens = verify_sampled(rows, drafts, sampler, start_position=len(context))
        n = len(tokens)
        assert tokens[: n - 1] == drafts[: n - 1] and n >= 1
        out += tokens
        context += tokens
    return out[:count]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_greedy_verification_is_plain_greedy_decoding(data: st.DataObject) -> None:
    expected = plain_decode(Sampler(SamplingParams(temperature=0.0), 0), 12)
    assert speculative_decode(None, expected, 12, data) == expected


PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.6]),
    top_p=st.sampled_from([1.0, 0.8]),
    top_k=st.sampled_from([0, 3]),
    min_p=st.sampled_from([0.0, 0.2]),
    repetition_penalty=st.sampled_from([1.0, 1.4]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    logit_bias=st.sampled_from([(), ((1, 1.5), (4, -2.0))]),
    min_tokens=st.integers(0, 4),
    stop_token_ids=st.sampled_from([frozenset(), frozenset({4})]),
)


@settings(max_examples=80, deadline=None)
@given(params=PARAMS, seed=st.integers(0, 2**63 - 1), data=st.data())
def test_point_mass_verification_is_plain_seeded_decoding(
    params: SamplingParams, seed: int, data: st.DataObject
) -> None:
    """Any temperature, with the history-dependent parameters applied row by
    row: the same tokens as the plain sampler, the same sampler state after."""
    plain, spec = Sampler(params, seed), Sampler(params, seed)
    plain.begin(PROMPT, eos_ids=[EOS])
    spec.begin(PROMPT, eos_ids=[EOS])
    expected = plain_decode(plain, 10)
    assert speculative_decode(spec, expected, 10, data) == expected


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.integers(-2, 2).map(float), min_size=VOCAB, max_size=VOCAB),
        min_size=1,
        max_size=5,
    ),
    data=st.data(),
)
def test_greedy_rows_with_ties_and_any_draft_distribution(
    rows: list[list[float]], data: st.DataObject
) -> None:
    """Row by row against the plain greedy sampler (argmax, ties to the
    lowest id); a draft model's q changes nothing at temperature 0."""
    logits = np.asarray(rows)
    k = len(rows) - 1
    drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k))
    plain, expected = Sampler(SamplingParams(temperature=0.0), 0), []
    for i, row in enumerate(logits):
        expected.append(plain(row))
        if i == k or expected[-1] != drafts[i]:
            break
    assert verify_greedy(logits, drafts) == expected
    q = np.random.default_rng(k).random((k, VOCAB)) + 0.01
    greedy = Sampler(SamplingParams(temperature=0.0), 9)
    assert verify_sampled(logits, drafts, greedy, 0, draft_probs=q) == expected


# ---------------------------------------------------------------- distribution

TARGET = np.array([2.0, 1.5, 1.0, 0.3, -0.5, -1.0])
DRAWS = 20_000
# The chi-square distribution's upper 0.001 quantiles, by degrees of freedom.
CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def reference(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution, written out independently of sampling.py."""
    probs = np.exp((TARGET - TARGET.max()) / temperature)
    order = np.argsort(-probs, kind="stable")
    if top_k:
        probs[order[top_k:]] = 0.0
    probs /= probs.sum()
    cumulative = np.cumsum(probs[order])
    cut = int(np.searchsorted(cumulative, top_p)) + 1
    probs[order[cut:]] = 0.0
    return probs / probs.sum()


def chi_square(tokens: list[int], expected: np.ndarray) -> tuple[float, int]:
    counts = np.bincount(tokens, minlength=expected.size)
    support = expected > 0
    assert counts[~support].sum() == 0  # nothing outside what the target keeps
    want = expected[support] * len(tokens)
    return float(((counts[support] - want) ** 2 / want).sum()), int(support.sum()) - 1


def first_tokens(params: SamplingParams, drafts: np.ndarray, q: np.ndarray | None) -> list[int]:
    """The first token of a one-token window for seeds 0, 1, ... (one per draft)."""
    logits = np.stack([TARGET, TARGET])
    return [
        verify_sampled(logits, [int(d)], Sampler(params, seed), 40, q)[0]
        for seed, d in enumerate(drafts)
    ]


def assert_target(tokens: list[int], expected: np.ndarray) -> None:
    statistic, freedom = chi_square(tokens, expected)
    assert statistic < CRITICAL_0001[freedom], (statistic, freedom)


def test_a_fixed_draft_keeps_the_target_distribution() -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95)  # keeps 4 of the 6
    tokens = first_tokens(params, np.full(DRAWS, 1), None)
    assert_target(tokens, reference(0.8, 0, 0.95))


def test_the_literal_point_mass_rule_keeps_the_target_distribution() -> None:
    """A one-hot q takes the accept-u/residual streams: accepted with
    probability p(d), else drawn from p without d."""
    params = SamplingParams(temperature=1.3, top_k=5)
    tokens = first_tokens(params, np.full(DRAWS // 2, 2), np.eye(VOCAB + 1)[[2]])
    assert_target(tokens, reference(1.3, 5, 1.0))


def test_a_draft_distribution_keeps_the_target_distribution() -> None:
    """q differs from p and puts mass where p has none (the ids top_p cut)."""
    q = np.array([0.05, 0.1, 0.2, 0.3, 0.25, 0.1])
    drafts = np.random.default_rng(7).choice(q.size, size=DRAWS, p=q)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    tokens = first_tokens(params, drafts, q[None, :])
    expected = reference(0.8, 0, 0.95)
    assert_target(tokens, expected)
    # Accepted with probability sum(min(p, q)): within 4.5 standard deviations.
    accepted = float(np.mean(np.asarray(tokens) == drafts))
    rate = float(np.minimum(expected, q).sum())
    assert abs(accepted - rate) < 4.5 * np.sqrt(rate * (1 - rate) / DRAWS)


# ---------------------------------------------------------------- streams, edges

Q = np.array([[0.1, 0.4, 0.2, 0.1, 0.1, 0.1]] * 3)
WINDOW = np.stack([TARGET, TARGET[::-1], TARGET, TARGET])
SAMPLED = SamplingParams(temperature=1.5)


@pytest.mark.parametrize("q", [None, Q])
def test_a_seed_reproduces_a_window_and_a_replay_decides_the_same(q: np.ndarray | None) -> None:
    results = {}
    for seed in range(40):
        first = verify_sampled(WINDOW, [1, 4, 0], Sampler(SAMPLED, seed), 7, q)
        replay = Sampler(SAMPLED, seed)
        assert verify_sampled(WINDOW, [1, 4, 0], replay, 7, q) == first
        assert replay.generated == len(first)  # the sampler counted what it emitted
        results[seed] = tuple(first)
    assert len(set(results.values())) > 5  # the seed matters


def test_sub_streams_share_no_philox_block() -> None:
    assert substream(11, 5, 0).random() == draw_generator(11, 5).random()
    blocks = {
        (position, tag): set(substream(11, position, tag).bit_generator.random_raw(16).tolist())
        for position in range(5, 9)
        for tag in (0, ACCEPT_STREAM, RESIDUAL_STREAM)
    }
    # Plain draws of neighbouring positions overlap (counter, counter + 1)...
    assert blocks[5, 0] & blocks[6, 0]
    # ...but no sub-stream meets another tag's, at any of these positions.
    for (_, tag_a), values_a in blocks.items():
        for (_, tag_b), values_b in blocks.items():
            assert tag_a == tag_b or not values_a & values_b


def sure_rows(ids: list[int]) -> np.ndarray:
    """Rows that put all the target's mass on one id each."""
    rows = np.full((len(ids), VOCAB + 1), -np.inf)
    rows[np.arange(len(ids)), ids] = 0.0
    return rows


@pytest.mark.parametrize("q", [None, Q])
def test_all_accepted_then_the_bonus_token(q: np.ndarray | None) -> None:
    for seed in range(20):
        sampler = Sampler(SAMPLED, seed)
        assert verify_sampled(sure_rows([3, 1, 5, 2]), [3, 1, 5], sampler, 0, q) == [3, 1, 5, 2]
    assert verify_greedy(sure_rows([3, 1, 5, 2]), [3, 1, 5]) == [3, 1, 5, 2]


@pytest.mark.parametrize("q", [None, Q])
def test_all_rejected_when_the_target_never_picks_the_draft(q: np.ndarray | None) -> None:
    rows = np.stack([TARGET] * 4)
    rows[0, 1] = -np.inf  # p(d1) = 0
    firsts = set()
    for seed in range(200):
        tokens = verify_sampled(rows, [1, 1, 1], Sampler(SAMPLED, seed), 0, q)
        assert len(tokens) == 1 and tokens[0] != 1
        firsts.add(tokens[0])
    # Point mass: p without the draft; this q: max(0, p - q) > 0 only at 0, 2, 3.
    assert firsts == ({0, 2, 3, 4, 5} if q is None else {0, 2, 3})
    # top_k cuts the draft too: always rejected.
    cut = SamplingParams(temperature=1.0, top_k=2)
    assert verify_sampled(WINDOW, [2, 2, 2], Sampler(cut, 3), 0)[0] in (0, 1)
    assert verify_greedy(WINDOW, [2, 2, 2]) == [0]


def test_a_stop_id_ends_the_window_and_min_tokens_masks_it() -> None:
    rows = sure_rows([3, 0, 2, 2])
    sampler = Sampler(SamplingParams(temperature=0.0), 0)
    sampler.begin(PROMPT, eos_ids=[0])
    assert verify_sampled(rows, [3, 0, 2], sampler, 3) == [3, 0]
    rows[1, 4] = -1.0  # something to pick while eos is masked
    held = Sampler(SamplingParams(temperature=0.0, min_tokens=3), 0)
    held.begin(PROMPT, eos_ids=[0])
    assert verify_sampled(rows, [3, 0, 2], held, 3) == [3, 4]


@pytest.mark.parametrize(
    ("logits", "drafts", "q", "position", "match"),
    [
        (np.zeros((2, 4)), [1, 2], None, 0, "must be"),
        (np.zeros(4), [], None, 0, "must be"),
        (np.zeros((2, 4)), [4], None, 0, "outside"),
        (np.zeros((2, 4)), [-1], None, 0, "outside"),
        (np.array([[0.0, 1.0], [np.nan, -np.inf]]), [1], None, 0, "no finite"),
        (np.zeros((2, 4)), [1], None, -1, "start_position"),
        (np.zeros((2, 4)), [1], np.ones((2, 4)), 0, "draft_probs must be"),
        (np.zeros((2, 4)), [1], np.array([[1.0, np.nan, 0, 0]]), 0, "finite"),
        (np.zeros((2, 4)), [1], np.array([[1.0, -1.0, 1, 0]]), 0, "finite"),
        (np.zeros((2, 4)), [1], np.zeros((1, 4)), 0, "no mass"),
        (np.zeros((2, 4)), [1], np.array([[1.0, 0, 0, 0]]), 0, "probability 0"),
    ],
)
def test_bad_windows_are_refused_before_anything_is_decided(
    logits: np.ndarray, drafts: list[int], q: np.ndarray | None, position: int, match: str
) -> None:
    sampler = Sampler(SAMPLED, 1)
    with pytest.raises(ValueError, match=match):
        verify_sampled(logits, drafts, sampler, position, q)
    assert sampler.generated == 0
