"""Drafts for speculative decoding (issue 38): what to draft, and how much.

``PromptLookup`` proposes the next tokens with no model at all: when the last
few tokens of a sequence (prompt and output so far) occurred earlier in it,
the tokens that followed that earlier occurrence are a good guess for what
follows now (a copied block, a list repeated, a quoted passage). It is
vLLM's ``ngram`` speculator and llama.cpp's lookup decoding.

``DraftPolicy`` decides how many tokens to draft for the next verify window
from the acceptance measured so far, and turns drafting off where it does
not pay.

Both are pure and deterministic: no I/O, no clock; the caller feeds tokens
and reports windows.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DraftPolicy",
    "PromptLookup",
]

# The longest sequence a PromptLookup holds by default: a large model's
# context (128 Ki tokens). The gateway passes its model's own context, which a
# generation cannot outgrow.
DEFAULT_MAX_TOKENS = 131072


class PromptLookup:
    """Prompt-lookup drafts over one sequence, fed incrementally.

    ``extend`` appends tokens (the prompt, then each accepted token);
    ``propose(k)`` finds the longest suffix n-gram of the history (n from
    ``max_ngram`` down to ``min_ngram``) that occurred earlier and returns up
    to ``k`` tokens that followed its most recent earlier occurrence, stopping
    at the end of the history; ``rewind(length)`` forgets the tokens past
    ``length`` (a rejected window).

    The index maps each n-gram to its latest *end* (the position just past its
    last token), and for every n and every end position ``prev`` links that
    end to the n-gram's previous end (-1: none). So:

    * ``extend`` is O(max_ngram) dict operations per token (each on a key of
      at most ``max_ngram`` tokens): no rescan.
    * ``propose`` reads the suffix's previous end straight from ``prev`` (the
      suffix itself is the n-gram's latest occurrence), then slices: O(k +
      max_ngram), whatever the history's length.
    * ``rewind`` undoes the forgotten tokens last first, setting each n-gram's
      latest end back to its ``prev`` link: O(max_ngram) per forgotten token,
      exact (nothing forgotten can be proposed from, nothing kept is lost).

    Memory is bounded by ``max_tokens``: the history and the ``prev`` links
    are machine-integer arrays (8 bytes a token each, times 1 + the number of
    n), and the dict holds at most one entry per distinct n-gram, i.e. at most
    (max_ngram - min_ngram + 1) per token, each a tuple key and an int. Measured
    with the defaults (CPython 3.11, tracemalloc): about 530 bytes a token
    when almost no n-gram repeats (random ids of a 32k vocabulary), about 35
    when the text repeats (the case drafting is for), so a few MiB for a few
    thousand tokens and at most ~70 MiB at ``DEFAULT_MAX_TOKENS``. ``extend`` past
    ``max_tokens`` is refused (``ValueError``): the caller sizes it to the
    model's context, which the sequence cannot outgrow.
    """

    def __init__(
        self,
        *,
        max_ngram: int = 3,
        min_ngram: int = 1,
        max_draft: int = 8,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, got {max_draft}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_draft = max_draft
        self.max_tokens = max_tokens
        self._history = array("q")
        self._latest: dict[tuple[int, ...], int] = {}
        # _prev[n - min_ngram][end]: the previous end of the n-gram that ends
        # at ``end`` (-1: none, or end < n). Entry 0 stands for the empty
        # history, so that an end position indexes it directly.
        self._prev = [array("q", [-1]) for _ in range(min_ngram, max_ngram + 1)]

    def __len__(self) -> int:
        return len(self._history)

    def extend(self, ids: Iterable[int]) -> None:
        """Append tokens to the history (the prompt, then accepted tokens)."""
        tokens = list(ids)
        if len(self._history) + len(tokens) > self.max_tokens:
            raise ValueError(
                f"{len(self._history)} + {len(tokens)} tokens exceed max_tokens={self.max_tokens}"
            )
        history = self._history
        for token in tokens:
            history.append(token)
            end = len(history)
            for n, prev in enumerate(self._prev, start=self.min_ngram):
                if end < n:
                    prev.append(-1)
                    continue
                key = tuple(history[end - n : end])
                prev.append(self._latest.get(key, -1))
                self._latest[key] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``min(k, max_draft)`` drafted tokens; empty when the history
        has no suffix n-gram that occurred before."""
        k = min(k, self.max_draft)
        end = len(self._history)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            earlier = self._prev[n - self.min_ngram][end]
            if earlier >= 0:
                # The longest match wins, even when its continuation is shorter
                # than a shorter n-gram's would be: it is the stronger evidence.
                return self._history[earlier : min(earlier + k, end)].tolist()
        return []

    def rewind(self, length: int) -> None:
        """Forget the tokens past ``length`` (those of a rejected window)."""
        history = self._history
        if not 0 <= length <= len(history):
            raise ValueError(f"cannot rewind to {length}: the history holds {len(history)}")
        for end in range(len(history), length, -1):
            for n, prev in enumerate(self._prev, start=self.min_ngram):
                if end < n:
                    continue
                key = tuple(history[end - n : end])
                # Undone last first, so the n-gram's latest end is this one.
                earlier = prev[end]
                if earlier < 0:
                    del self._latest[key]
                else:
                    self._latest[key] = earlier
        del history[length:]
        for prev in self._prev:
            del prev[length + 1 :]


# DraftPolicy's cost model and defaults.
#
# A plain decode step costs T + c: T is everything a step pays whatever its
# size (the trip through the chain: hops, per-message overhead, each stage
# reading its weights once), c the compute of one more row. A verify window of
# k drafted tokens is one chunk of k + 1 rows (the last token and the k
# drafts): it costs T + (k + 1)c and yields j + 1 tokens when j drafts are
# accepted (the accepted prefix, then the target's own next token). Over many
# windows speculation beats plain decoding when
#     sum(T + (k_i + 1)c) < (T + c) * sum(1 + j_i)
#     <=>  sum(j_i) / sum(k_i) > c / (T + c),
# whatever the k_i: the break-even acceptance rate (accepted / drafted) is the
# share of a plain step spent on a row's compute. Over a real link T dominates
# and it is small (a 25 ms trip and 2 ms a row: 0.07); on one machine with a
# compute-bound step it nears 1. Hence the rate as the ratio of two smoothed
# sums, not a mean of per-window ratios, and a threshold that is an estimate of
# c / (T + c): 0.5 by default (T == c) is conservative for a chain over a
# network (it gives up some windows that would still have paid) and safe on
# one machine, and free prose, where prompt lookup is rarely right, falls
# below it within a few windows. The caller that measures T and c can pass its
# own threshold.
#
# The ~0.8 law the issue cites (shard's paper) is for *pipelined* windows:
# with several windows in flight, a rejection also throws away every window
# sent after it, so the wasted work grows with the depth of the pipeline. One
# window at a time wastes only the rejected tail of its own chunk, which is
# the break-even above.
DEFAULT_THRESHOLD = 0.5
# Windows beyond the first are sent only while the smoothed acceptance is at
# least this: each one is drafted as if every window before it were accepted
# whole, so at a lower rate most of them go stale and their compute is thrown
# away (shard's ~0.8 law). Measured on the real model, two windows in flight
# on free prose (acceptance near 0) sent 17 stale windows in 96 tokens.
DEFAULT_PIPELINE_THRESHOLD = 0.8
# Weight of the newest window in the smoothed sums: memory of ~4 windows, so a
# copied block that ends is noticed within a few windows.
DEFAULT_SMOOTHING = 0.25
# Where to start, before any window is measured: half of the default maximum.
DEFAULT_INITIAL_DRAFT = 4
# Re-probing while off: one window of one drafted token after 8 plain steps.
# A failed probe costs one extra row in 9 steps (at most 11 % of the compute
# when c is the whole step, nothing measurable over a link); a fully accepted
# probe turns drafting back on. Every 32 steps was measured too slow: a
# chat answer's copied part (a list the model repeats) began while drafting
# was off, and a third of it went by plainly before a probe came.
DEFAULT_PROBE_EVERY = 8
DEFAULT_PROBE_DRAFT = 1
# Failed probes in a row double the wait for the next, up to this many times
# DEFAULT_PROBE_EVERY: a long prose answer pays a probe every 64 steps, and a
# copied part starting later is still met within 64 tokens.
PROBE_BACKOFF = 8


class DraftPolicy:
    """How many tokens to draft for the next window (``k``; 0: a plain step).

    The caller asks ``k``, drafts up to that many tokens, verifies them and
    reports ``observe(drafted, accepted)`` (``observe(0, 0)`` for a plain step,
    including one where the drafter had nothing to propose). While drafting,
    a fully accepted window doubles ``k`` (up to ``max_draft``) and a
    rejection shrinks it to one past the accepted prefix (at least one); when
    the smoothed acceptance rate falls below ``threshold`` drafting stops. Off,
    after ``probe_every`` plain steps ``k`` becomes ``probe_draft`` until a
    window is drafted; if that probe is fully accepted, drafting resumes from a
    fresh estimate, and each failed probe doubles the wait for the next (up to
    ``PROBE_BACKOFF`` times ``probe_every``). See the cost model above for the
    defaults.
    """

    def __init__(
        self,
        *,
        max_draft: int = 8,
        initial_draft: int = DEFAULT_INITIAL_DRAFT,
        threshold: float = DEFAULT_THRESHOLD,
        smoothing: float = DEFAULT_SMOOTHING,
        probe_every: int = DEFAULT_PROBE_EVERY,
        probe_draft: int = DEFAULT_PROBE_DRAFT,
    ) -> None:
        if max_draft < 1:
            raise ValueError(f"max_draft must be at least 1, got {max_draft}")
        if not 1 <= initial_draft <= max_draft:
            raise ValueError(f"initial_draft must be in [1, {max_draft}], got {initial_draft}")
        if not 1 <= probe_draft <= max_draft:
            raise ValueError(f"probe_draft must be in [1, {max_draft}], got {probe_draft}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if probe_every < 0:
            raise ValueError(f"probe_every must be at least 0, got {probe_every}")
        self.max_draft = max_draft
        self.threshold = threshold
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.probe_draft = probe_draft
        self.drafting = True
        self._k = self._initial = initial_draft
        self._plain_steps = 0  # while off: plain steps since drafting stopped or the last probe
        self._probe_wait = probe_every  # plain steps before the next probe
        self._whole_seen = False  # a window accepted whole: evidence, not the prior
        self._reset_estimate()

    def _reset_estimate(self) -> None:
        # A prior of one window of ``initial_draft`` tokens accepted whole:
        # optimistic, yet a few rejected windows outweigh it (from the
        # defaults, drafting stops after the fifth window in a row rejected).
        # Not lighter: a chat answer's first words are rarely in its prompt
        # ("The list is: …" before the list it copies), and one rejected
        # window must not turn drafting off for the rest of a short answer.
        self._accepted = self._drafted = float(self._initial)

    @property
    def rate(self) -> float:
        """The smoothed acceptance rate: accepted / drafted tokens."""
        return self._accepted / self._drafted

    def depth(self, most: int) -> int:
        """How many windows to keep in flight, at most ``most``: several only
        once a window of this generation was accepted whole and while drafting
        pays well enough to pipeline (``DEFAULT_PIPELINE_THRESHOLD``). Not on
        the prior alone: a window sent behind a rejected one is computed for
        nothing and costs a rewind, and free prose rejects its first windows
        (measured: pipelining from the first window made prose 3-6 % slower
        than plain decoding on loopback)."""
        if self.drafting and self._whole_seen and self.rate >= DEFAULT_PIPELINE_THRESHOLD:
            return most
        return min(most, 1)

    @property
    def k(self) -> int:
        """How many tokens to draft for the next window; 0: a plain step."""
        if self.drafting:
            return self._k
        return self.probe_draft if self._plain_steps >= self._probe_wait else 0

    def observe(self, drafted: int, accepted: int) -> None:
        """Report a window: ``drafted`` tokens sent, the first ``accepted`` kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        if drafted == 0:  # a plain step: nothing learned about the drafts
            if not self.drafting:
                self._plain_steps += 1
            return
        keep = 1.0 - self.smoothing
        self._accepted = keep * self._accepted + self.smoothing * accepted
        self._drafted = keep * self._drafted + self.smoothing * drafted
        if accepted == drafted:
            self._whole_seen = True
        if not self.drafting:  # a probe
            self._plain_steps = 0
            if accepted == drafted:
                self.drafting = True
                self._k = min(self.max_draft, 2 * drafted)
                self._reset_estimate()
                return
            # Free prose: probes keep failing, each one row of compute for
            # nothing; so they come ever more rarely (8, 16, 32, 64 steps).
            self._probe_wait = min(2 * self._probe_wait, PROBE_BACKOFF * self.probe_every)
            return
        if accepted == drafted:
            # The rate cannot fall here: it moves toward 1 (a mediant). Doubled,
            # not grown by one: a copied block is met at once (1 → 8 in three
            # windows, not seven), and a rejection halves it back at worst.
            self._k = min(self.max_draft, 2 * self._k)
            return
        self._k = max(1, min(self._k - 1, accepted + 1))
        if self.rate < self.threshold:
            self.drafting = False
            self._plain_steps = 0
            self._probe_wait = self.probe_every
