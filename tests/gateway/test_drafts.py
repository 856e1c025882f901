"""Prompt-lookup drafts and the policy that sizes verify windows (issue 38)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_gateway.openai import drafts
from meshnet_gateway.openai.drafts import DraftPolicy, PromptLookup


def reference(
    history: Sequence[int], k: int, *, max_ngram: int, min_ngram: int, max_draft: int
) -> list[int]:
    """The proposal by brute force: rescan the whole history."""
    k = min(k, max_draft)
    if k <= 0:
        return []
    size = len(history)
    for n in range(min(max_ngram, size), min_ngram - 1, -1):
        suffix = list(history[size - n :])
        for end in range(size - 1, n - 1, -1):
            if list(history[end - n : end]) == suffix:
                return list(history[end : min(end + k, size)])
    return []


# A script of operations: ("extend", tokens) or ("rewind", fraction of the history kept).
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("extend"), st.lists(st.integers(0, 3), max_size=12)),
        st.tuples(st.just("rewind"), st.floats(0.0, 1.0)),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=OPS,
    min_ngram=st.integers(1, 3),
    extra=st.integers(0, 2),
    max_draft=st.integers(1, 6),
    k=st.integers(0, 8),
)
def test_matches_the_brute_force_reference_after_extends_and_rewinds(
    ops: list[tuple[str, Any]], min_ngram: int, extra: int, max_draft: int, k: int
) -> None:
    max_ngram = min_ngram + extra
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=max_draft)
    model: list[int] = []
    for op, arg in ops:
        if op == "extend":
            lookup.extend(arg)
            model.extend(arg)
        else:
            length = int(arg * len(model))
            lookup.rewind(length)
            del model[length:]
        assert len(lookup) == len(model)
        for want in (k, 1, max_draft):
            expected = reference(
                model, want, max_ngram=max_ngram, min_ngram=min_ngram, max_draft=max_draft
            )
            assert lookup.propose(want) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), min_size=1, max_size=40), st.data())
def test_rewind_then_extend_equals_a_fresh_lookup(tokens: list[int], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(tokens)))
    tail = data.draw(st.lists(st.integers(0, 2), max_size=10))
    rewound = PromptLookup()
    rewound.extend(tokens)
    rewound.rewind(cut)
    rewound.extend(tail)
    fresh = PromptLookup()
    fresh.extend(tokens[:cut] + tail)
    for k in range(9):
        assert rewound.propose(k) == fresh.propose(k)
    # Nothing forgotten is still indexed: the index is the fresh one's.
    assert rewound._latest == fresh._latest
    assert [list(p) for p in rewound._prev] == [list(p) for p in fresh._prev]


def test_a_repeated_list_is_drafted() -> None:
    lookup = PromptLookup()
    items = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    lookup.extend([*items, 99, *items[:3]])  # the list, a separator, the list restarted
    assert lookup.propose(4) == [13, 14, 15, 16]
    assert lookup.propose(20) == [13, 14, 15, 16, 17, 18, 19, 99]  # max_draft=8
    lookup.extend([13, 14])
    assert lookup.propose(3) == [15, 16, 17]


def test_a_code_edit_drafts_the_copied_block_then_stops_at_the_edit() -> None:
    block = [1, 2, 3, 4, 5, 6, 7, 8]  # the given code
    lookup = PromptLookup()
    lookup.extend([50, *block, 51])  # prompt: "edit this:" block "->"
    lookup.extend(block[:2])  # the model starts copying
    assert lookup.propose(8) == [*block[2:], 51, 1]  # up to the end of the history
    lookup.extend([3, 4, 90])  # then changes a line
    assert lookup.propose(8) == []  # 90 never occurred before
    lookup.extend([6])  # and goes on copying after the edited line
    assert lookup.propose(3) == [7, 8, 51]


def test_the_longest_match_and_its_latest_occurrence_win() -> None:
    lookup = PromptLookup()
    lookup.extend([1, 2, 7, 5, 2, 8, 1, 2, 9, 1, 2])
    # "1 2" occurred twice before: the latest (followed by 9) wins over the
    # first (followed by 7); "5 2"/"2" matches are shorter.
    assert lookup.propose(2) == [9, 1]
    lookup.extend([9, 0])
    assert lookup.propose(2) == []


def test_the_continuation_stops_at_the_end_of_the_history() -> None:
    lookup = PromptLookup()
    lookup.extend([4, 4, 4, 4])
    # "4 4 4" ended last at 3: only the one token after it exists.
    assert lookup.propose(8) == [4]


def test_no_repetition_proposes_nothing() -> None:
    lookup = PromptLookup()
    assert lookup.propose(4) == []
    lookup.extend(range(100))
    assert lookup.propose(4) == []
    assert lookup.propose(0) == []


def test_min_ngram_above_one_ignores_single_token_matches() -> None:
    lookup = PromptLookup(min_ngram=2)
    lookup.extend([5])
    assert lookup.propose(3) == []
    lookup.extend([6, 5])  # "5" repeats, but no 2-gram does
    assert lookup.propose(3) == []
    lookup.extend([6])
    assert lookup.propose(3) == [5, 6]


def test_rewinding_a_rejected_window_forgets_it() -> None:
    lookup = PromptLookup()
    lookup.extend([1, 2, 3])
    lookup.extend([7, 8, 1, 2])  # a window whose tail is rejected
    assert lookup.propose(2) == [3, 7]
    lookup.rewind(4)
    assert lookup.propose(8) == []  # "7" is new again, "1 2" forgotten
    lookup.extend([1, 2])
    assert lookup.propose(8) == [3, 7, 1, 2]
    lookup.rewind(0)
    assert len(lookup) == 0
    assert lookup.propose(8) == []


def test_bad_arguments_are_refused() -> None:
    refused: list[dict[str, int]] = [
        {"min_ngram": 0},
        {"min_ngram": 3, "max_ngram": 2},
        {"max_draft": 0},
        {"max_tokens": 0},
    ]
    for kwargs in refused:
        with pytest.raises(ValueError):
            PromptLookup(**kwargs)
    lookup = PromptLookup(max_tokens=4)
    lookup.extend([1, 2, 3])
    with pytest.raises(ValueError, match="exceed max_tokens"):
        lookup.extend([4, 5])
    assert len(lookup) == 3  # refused whole, nothing appended
    lookup.extend([4])
    with pytest.raises(ValueError):
        lookup.rewind(5)
    with pytest.raises(ValueError):
        lookup.rewind(-1)
    assert len(lookup) == 4


# Bounded work, counted without a clock: the Python lines the module runs for
# one call (a tracer that counts only lines of drafts.py). Slices and dict
# look-ups are C calls and count once, so a count that does not grow with the
# history means no loop over it.


def lines_run(call: Callable[[], object]) -> int:
    count = 0

    def local(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        count += event == "line"
        return local

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename == drafts.__file__ else None

    previous = sys.gettrace()  # coverage's, when it runs: put back after
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(previous)
    return count


def periodic(length: int) -> PromptLookup:
    """A history of ``length`` tokens, a 50-token block over and over, plus
    distinct tokens that never repeat on its first half (a large vocabulary)."""
    lookup = PromptLookup(max_tokens=1 << 20)
    lookup.extend(1000 + i for i in range(length // 2))
    lookup.extend(i % 50 for i in range(length - length // 2))
    return lookup


@pytest.mark.parametrize("k", [1, 8])
def test_a_proposal_costs_the_same_whatever_the_history(k: int) -> None:
    short, long = periodic(200), periodic(200_000)
    assert short.propose(k) == long.propose(k) != []
    assert 0 < lines_run(lambda: short.propose(k)) == lines_run(lambda: long.propose(k))
    # No match at all: every n tried, still no scan.
    short.extend([10**7])
    long.extend([10**7])
    assert short.propose(k) == long.propose(k) == []
    assert lines_run(lambda: short.propose(k)) == lines_run(lambda: long.propose(k))


def test_extending_and_rewinding_cost_per_token_not_per_history() -> None:
    short, long = periodic(200), periodic(200_000)
    window = [7, 8, 9, 7]
    extend_short = lines_run(lambda: short.extend(window))
    assert 0 < extend_short == lines_run(lambda: long.extend(window))
    rewind_short = lines_run(lambda: short.rewind(len(short) - 3))
    assert rewind_short == lines_run(lambda: long.rewind(len(long) - 3))
    assert short.propose(8) == long.propose(8)
    # And linear in the tokens forgotten: three cost more than one, at most thrice.
    one = lines_run(lambda: long.rewind(len(long) - 1))
    assert 0 < one < rewind_short <= 3 * one


def test_the_index_is_bounded_by_the_history() -> None:
    lookup = periodic(10_000)
    assert all(len(prev) == len(lookup) + 1 for prev in lookup._prev)
    # At most one entry per n-gram position; the periodic half shares them.
    assert len(lookup._latest) <= 3 * len(lookup)
    assert len(lookup._latest) < 3 * 5_000 + 3 * 50 + 10


# DraftPolicy


def test_the_policy_starts_drafting_within_bounds() -> None:
    policy = DraftPolicy()
    assert policy.drafting
    assert 1 <= policy.k <= policy.max_draft
    assert policy.rate == 1.0


def test_all_accepted_converges_up_to_max_draft_and_stays() -> None:
    policy = DraftPolicy(max_draft=8, initial_draft=1)
    ks = []
    for _ in range(20):
        ks.append(policy.k)
        policy.observe(policy.k, policy.k)
    assert ks[:4] == [1, 2, 4, 8]  # doubled by each window accepted whole
    assert ks[4:] == [8] * 16
    assert policy.drafting and policy.rate == pytest.approx(1.0)


def test_all_rejected_converges_down_and_off() -> None:
    policy = DraftPolicy(initial_draft=6)
    seen = []
    while policy.drafting:
        seen.append(policy.k)
        policy.observe(policy.k, 0)
        assert len(seen) < 10
    assert seen[0] == 6 and seen[1:] == [1] * (len(seen) - 1)
    assert policy.rate < policy.threshold
    assert policy.k == 0  # plain decoding


def test_a_partial_rejection_shrinks_to_just_past_the_accepted_prefix() -> None:
    policy = DraftPolicy(initial_draft=8, threshold=0.0)
    policy.observe(8, 5)
    assert policy.k == 6
    policy.observe(6, 5)
    assert policy.k == 5  # at most one less than before
    policy.observe(5, 0)
    assert policy.k == 1
    policy.observe(1, 0)
    assert policy.k == 1 and policy.drafting  # threshold 0: never off


def test_off_it_reprobes_and_resumes_when_a_probe_is_accepted() -> None:
    policy = DraftPolicy(probe_every=4, probe_draft=2)
    while policy.drafting:
        policy.observe(policy.k, 0)
    for _ in range(3):
        assert policy.k == 0
        policy.observe(0, 0)
    policy.observe(0, 0)
    assert policy.k == 2  # the probe is due
    policy.observe(0, 0)  # the drafter had nothing: still due
    assert policy.k == 2
    policy.observe(2, 1)  # a failed probe: off, and the count restarts, twice as long
    assert not policy.drafting and policy.k == 0
    for _ in range(7):
        policy.observe(0, 0)
    assert policy.k == 0
    policy.observe(0, 0)
    assert policy.k == 2
    policy.observe(2, 2)  # accepted: the text is draftable again
    assert policy.drafting and policy.k == 4 and policy.rate == 1.0


def test_a_plain_step_while_drafting_changes_nothing() -> None:
    policy = DraftPolicy()
    before = (policy.k, policy.rate, policy.drafting)
    policy.observe(0, 0)
    assert (policy.k, policy.rate, policy.drafting) == before


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 10),
    st.data(),
    st.lists(st.tuples(st.integers(0, 12), st.floats(0.0, 1.0)), max_size=60),
)
def test_the_policy_never_leaves_its_bounds(
    max_draft: int, data: st.DataObject, windows: list[tuple[int, float]]
) -> None:
    policy = DraftPolicy(
        max_draft=max_draft,
        initial_draft=data.draw(st.integers(1, max_draft)),
        probe_draft=data.draw(st.integers(1, max_draft)),
        probe_every=data.draw(st.integers(0, 5)),
        threshold=data.draw(st.floats(0.0, 1.0)),
        smoothing=data.draw(st.floats(0.01, 1.0)),
    )
    for drafted, share in windows:
        drafted = min(drafted, policy.k)  # the drafter may find fewer
        policy.observe(drafted, int(share * drafted))
        assert 0 <= policy.k <= max_draft
        assert policy.k >= 1 if policy.drafting else policy.k in (0, policy.probe_draft)
        assert 0.0 <= policy.rate <= 1.0 + 1e-9
        if policy.drafting:
            assert policy.rate >= policy.threshold - 1e-9


def test_bad_policy_arguments_are_refused() -> None:
    refused: list[dict[str, float]] = [
        {"max_draft": 0},
        {"initial_draft": 0},
        {"initial_draft": 9},
        {"probe_draft": 0},
        {"probe_draft": 9},
        {"threshold": -0.1},
        {"threshold": 1.5},
        {"smoothing": 0.0},
        {"smoothing": 1.5},
        {"probe_every": -1},
    ]
    for kwargs in refused:
        with pytest.raises(ValueError):
            DraftPolicy(**kwargs)  # type: ignore[arg-type]
    policy = DraftPolicy()
    for drafted, accepted in ((1, 2), (-1, 0), (2, -1)):
        with pytest.raises(ValueError):
            policy.observe(drafted, accepted)


def test_windows_are_pipelined_only_while_acceptance_is_high() -> None:
    """One window at a time until one is accepted whole, and while the rate is
    under the pipelining threshold: a window drafted on top of another is
    thrown away when that one is not accepted whole."""
    policy = DraftPolicy(initial_draft=4)
    assert policy.rate == 1.0 and policy.depth(3) == 1  # not on the optimistic prior
    policy.observe(4, 4)
    assert policy.depth(3) == 3  # a window accepted whole: evidence
    policy.observe(policy.k, 1)
    policy.observe(policy.k, 0)
    assert policy.rate < 0.8 and policy.drafting
    assert policy.depth(3) == 1
    for _ in range(8):
        policy.observe(policy.k, policy.k)
    assert policy.rate >= 0.8 and policy.depth(3) == 3 and policy.depth(1) == 1
    off = DraftPolicy(initial_draft=1)
    for _ in range(6):
        off.observe(1, 0)
    assert not off.drafting and off.depth(4) == 1  # probes go one at a time


def test_failed_probes_come_ever_more_rarely_until_one_is_accepted() -> None:
    policy = DraftPolicy(initial_draft=1, probe_every=2)
    while policy.drafting:
        policy.observe(policy.k, 0)
    waits = []
    for _ in range(6):  # six probes, all rejected: the plain steps before each
        steps = 0
        while policy.k == 0:
            policy.observe(0, 0)
            steps += 1
        waits.append(steps)
        policy.observe(policy.k, 0)
    assert waits == [2, 4, 8, 16, 16, 16]  # doubled, up to 8 x probe_every
    while policy.k == 0:
        policy.observe(0, 0)
    policy.observe(policy.k, policy.k)  # accepted: drafting again
    assert policy.drafting
    while policy.drafting:
        policy.observe(policy.k, 0)
    steps = 0
    while policy.k == 0:
        policy.observe(0, 0)
        steps += 1
    assert steps == 2  # off afresh: the first probe comes after probe_every again
