"""wire-2 §3.16 in the sequencer: windows in flight and rewinds, routed by
``X-Meshnet-After`` (rules 1-4), driven the way a node drives the table."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from meshnet_proto import (
    Join,
    Limits,
    MeshnetError,
    Process,
    ProtocolError,
    Replay,
    SequencingError,
    SessionTable,
    Wait,
    WireHeaders,
)
from meshnet_proto.lowlevel import KEPT_WINDOWS, AfterSpec, SampleSpec, Ticket

S1 = "5b1e0c2a-1111-4abc-8def-000000000001"
S2 = "5b1e0c2a-2222-4abc-8def-000000000002"
KEY = "0123456789abcdef0123456789abcdef"
PROMPT = 8  # the prefill's tokens: every session below starts at 8, epoch 0


def fp(tag: object) -> bytes:
    return str(tag).encode().ljust(16, b".")[:16]


def chunk(
    position: int | None,
    after: tuple[int, int] | None = None,
    *,
    tokens: int = 3,
    index: int = 0,
    total: int = 1,
    session: str = S1,
) -> WireHeaders:
    """A window of ``tokens - 1`` drafts at ``position``, following
    ``after = (F, E)`` (a plain chunk without it)."""
    return WireHeaders(
        shape=(1, tokens),
        dtype="int32",
        session=session,
        chunk_index=index,
        chunk_total=total,
        position=position,
        session_key=KEY,
        sample=SampleSpec(seed=7),
        draft=tuple(range(tokens - 1)) if after is not None and tokens > 1 else None,
        after=None if after is None else AfterSpec(*after),
    )


class Node:
    """A synchronous driver with a hand-moved clock, as in test_sequencer."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.table = SessionTable(limits)
        self.now = 0.0

    def offer(self, h: WireHeaders, tag: object, waiter: Any = None) -> Any:
        self.table.check_head(h, self.now)  # what offer decides, the head decides first
        return self.table.offer(h, fp(tag), self.now, waiter=waiter)

    def process(self, h: WireHeaders, tag: object, waiter: Any = None) -> Ticket:
        decision = self.offer(h, tag, waiter)
        assert isinstance(decision, Process), decision
        return decision.ticket

    def wait(self, h: WireHeaders, tag: object) -> Wait:
        decision = self.offer(h, tag)
        assert isinstance(decision, Wait), decision
        return decision

    def done(self, ticket: Ticket) -> None:
        self.table.stage_done(ticket, f"out-{ticket.serial}", self.now)

    def answered(self, ticket: Ticket) -> None:
        self.table.response_ready(ticket, f"resp-{ticket.serial}", self.now)

    def finish(self, ticket: Ticket) -> None:
        self.done(ticket)
        self.answered(ticket)

    def refused(self, h: WireHeaders, tag: object, code: str, *, head: bool = True) -> None:
        """``offer`` refuses the chunk with ``code`` — and ``check_head`` does
        too when the headers alone decide it (``head``)."""
        if head:
            with pytest.raises(MeshnetError) as err:
                self.table.check_head(h, self.now)
            assert err.value.code == code
        else:
            self.table.check_head(h, self.now)
        with pytest.raises(MeshnetError) as err:
            self.table.offer(h, fp(tag), self.now)
        assert err.value.code == code

    def state(self, session: str = S1) -> tuple[int | None, int | None]:
        return self.table.position(session), self.table.epoch(session)


def started(limits: Limits | None = None) -> Node:
    """A session that took its prompt (8 tokens, no After): position 8, epoch 0."""
    node = Node(limits)
    node.finish(node.process(chunk(0, tokens=PROMPT), "prompt"))
    assert node.state() == (PROMPT, 0)
    return node


def windows(node: Node) -> tuple[Ticket, Ticket]:
    """Two windows of 3 tokens in line 0, each answered: position 14."""
    first = node.process(chunk(8, (8, 0)), "w1")
    node.finish(first)
    second = node.process(chunk(11, (11, 0)), "w2")
    node.finish(second)
    assert node.state() == (14, 0)
    return first, second


# -- windows in flight ------------------------------------------------------------------------


def test_windows_arriving_out_of_order_run_in_order() -> None:
    node = started()
    later = node.wait(chunk(11, (11, 0)), "w2")  # its predecessor has not come yet
    first = node.process(chunk(8, (8, 0)), "w1")
    # While the first is in the stage the later still waits (a run is open).
    again = node.offer(chunk(11, (11, 0)), "w2", later.waiter)
    assert isinstance(again, Wait)
    node.done(first)
    second = node.process(chunk(11, (11, 0)), "w2", again.waiter)
    assert (second.position, second.epoch, second.rewind_from) == (11, 0, None)
    node.answered(first)
    node.finish(second)
    assert node.state() == (14, 0)


def test_a_window_waits_as_any_waiter_does() -> None:
    """Counted in the session's window of waiters; its wait ends as any wait."""
    node = started(Limits(reorder_window=2, reorder_timeout=5.0))
    waits = [node.wait(chunk(11 + i, (11 + i, 0)), f"w{i}") for i in range(2)]
    node.refused(chunk(20, (20, 0)), "w9", "chunk_out_of_window")
    node.now = 6.0
    with pytest.raises(SequencingError) as err:
        node.table.offer(chunk(11, (11, 0)), fp("w0"), node.now, waiter=waits[0].waiter)
    assert err.value.code == "chunk_wait_timeout"
    error = node.table.give_up(waits[1].waiter, node.now)
    assert error.code == "chunk_wait_timeout"
    assert node.table.between_runs(S1, node.now)


def test_a_stale_window_is_refused_at_once_and_never_waits() -> None:
    node = started()
    windows(node)
    node.finish(node.process(chunk(9, (14, 1), tokens=2), "rewind"))  # epoch 1 now
    for stale in (chunk(14, (14, 0)), chunk(30, (30, 0)), chunk(9, (14, 0))):
        node.refused(stale, "stale", "window_stale")
    with pytest.raises(SequencingError) as err:
        node.table.check_head(chunk(11, (11, 0)), node.now)
    assert (err.value.status, err.value.header) == (409, "x-meshnet-after")
    assert node.table.between_runs(S1, node.now)  # nothing waits
    assert node.state() == (11, 1)


# -- rewinds ------------------------------------------------------------------------------------


def test_a_rewind_drops_back_and_opens_the_next_epoch() -> None:
    node = started()
    windows(node)
    rewind = node.process(chunk(9, (14, 1), tokens=2), "rewind")
    assert (rewind.position, rewind.rewind_from, rewind.epoch) == (9, 14, 1)
    assert node.state() == (14, 0)  # nothing moves before the stage ran
    node.finish(rewind)
    assert node.state() == (11, 1)
    # The next window follows it in line 1.
    step = node.process(chunk(11, (11, 1)), "w3")
    assert (step.position, step.rewind_from, step.epoch) == (11, None, 1)
    node.finish(step)
    assert node.state() == (14, 1)


def test_a_failed_rewind_changes_nothing_and_may_run_again() -> None:
    node = started()
    windows(node)
    rewind = node.process(chunk(9, (14, 1), tokens=2), "rewind")
    node.table.stage_failed(rewind, node.now)
    assert node.state() == (14, 0)
    node.finish(node.process(chunk(9, (14, 1), tokens=2), "rewind"))
    assert node.state() == (11, 1)


def test_a_retransmitted_rewind_is_replayed() -> None:
    node = started()
    windows(node)
    h = chunk(9, (14, 1), tokens=2)
    rewind = node.process(h, "rewind")
    # In the stage (the session still in epoch 0): it joins the original.
    assert node.offer(h, "rewind") == Join(rewind)
    node.done(rewind)
    assert node.offer(h, "rewind") == Join(rewind)  # forwarding
    node.answered(rewind)
    assert node.offer(h, "rewind") == Replay(f"resp-{rewind.serial}")
    # Another tensor, or another total, is another chunk.
    node.refused(h, "other", "chunk_conflict", head=False)
    node.refused(chunk(9, (14, 1), tokens=2, total=2), "rewind", "chunk_conflict")
    # Another rewind in the line it opened is not the one that ran.
    node.refused(chunk(10, (14, 1), tokens=1), "rewind", "chunk_conflict")
    node.refused(chunk(9, (13, 1), tokens=2), "rewind", "chunk_conflict")
    assert node.state() == (11, 1)


def test_a_rewind_no_longer_kept_is_a_conflict() -> None:
    """Kept while a sender may still have it in flight (KEPT_WINDOWS runs
    later), then gone: a conflict, never a second run."""
    node = started()
    windows(node)
    h = chunk(9, (14, 1), tokens=2)
    rewind = node.process(h, "rewind")
    node.finish(rewind)
    position = 11
    for i in range(KEPT_WINDOWS):  # windows in line 1 after it
        node.finish(node.process(chunk(position, (position, 1)), f"w{i}"))
        position += 3
    assert node.offer(h, "rewind") == Replay(f"resp-{rewind.serial}")
    node.finish(node.process(chunk(position, (position, 1)), "one more"))
    node.refused(h, "rewind", "chunk_conflict")


def test_a_window_sent_again_after_later_windows_ran_is_replayed() -> None:
    """Windows in flight: the first's answer is lost, the sender sends it
    again after the second (and a third) ran; it is replayed, not refused."""
    node = started()
    first, second = windows(node)
    third = node.process(chunk(14, (14, 0)), "w3")
    node.finish(third)
    assert node.offer(chunk(8, (8, 0)), "w1") == Replay(f"resp-{first.serial}")
    assert node.offer(chunk(11, (11, 0)), "w2") == Replay(f"resp-{second.serial}")
    node.refused(chunk(8, (8, 0)), "another tensor", "chunk_conflict", head=False)


def test_an_earlier_windows_answer_is_kept_when_it_comes_after_later_runs() -> None:
    """Its run closed when its stage was done; two runs later its answer
    arrives (the forward took long): it is still kept for a retransmission,
    and the session is busy (not idle, not exportable) while it is in flight."""
    node = started()
    first = node.process(chunk(8, (8, 0)), "w1")
    node.done(first)
    second = node.process(chunk(11, (11, 0)), "w2")
    node.finish(second)
    node.finish(node.process(chunk(14, (14, 0)), "w3"))
    assert not node.table.between_runs(S1, node.now)  # the first is still forwarding
    node.answered(first)
    assert node.table.between_runs(S1, node.now)
    assert node.offer(chunk(8, (8, 0)), "w1") == Replay(f"resp-{first.serial}")


def test_ending_a_session_forgets_its_earlier_windows() -> None:
    node = started()
    first = node.process(chunk(8, (8, 0)), "w1")
    node.done(first)
    node.finish(node.process(chunk(11, (11, 0)), "w2"))
    node.finish(node.process(chunk(14, (14, 0)), "w3"))
    node.table.response_ready(first, "an answer", node.now, nbytes=100)
    assert node.table.stored_bytes == 100  # kept, two runs later
    assert node.table.end_session(S1)
    assert node.table.stored_bytes == 0


def test_a_rewind_opening_a_run_of_several_chunks_is_found_while_it_runs() -> None:
    node = started()
    windows(node)
    h = chunk(9, (14, 1), tokens=2, total=2)
    rewind = node.process(h, "rewind")
    node.finish(rewind)
    assert node.state() == (11, 1)
    assert node.offer(h, "rewind") == Replay(f"resp-{rewind.serial}")  # its run still open
    node.finish(node.process(chunk(11, index=1, total=2), "tail"))
    assert node.state() == (14, 1)


def test_a_rewind_waits_for_an_open_run_then_runs() -> None:
    node = started()
    first = node.process(chunk(8, (8, 0)), "w1")
    node.finish(first)
    second = node.process(chunk(11, (11, 0)), "w2")  # in the stage
    waiting = node.wait(chunk(9, (14, 1), tokens=2), "rewind")
    node.done(second)
    rewind = node.process(chunk(9, (14, 1), tokens=2), "rewind", waiting.waiter)
    assert (rewind.position, rewind.rewind_from, rewind.epoch) == (9, 14, 1)
    node.answered(second)
    node.finish(rewind)
    assert node.state() == (11, 1)


def test_a_rewind_waits_for_the_stale_windows_it_follows() -> None:
    """Sent After the position the last window leaves: it runs after every
    stale window, whatever order they arrive in (S < F)."""
    node = started()
    node.finish(node.process(chunk(8, (8, 0)), "w1"))
    rewind = node.wait(chunk(9, (14, 1), tokens=2), "rewind")
    node.finish(node.process(chunk(11, (11, 0)), "w2"))  # the stale window still runs
    ticket = node.process(chunk(9, (14, 1), tokens=2), "rewind", rewind.waiter)
    node.finish(ticket)
    assert node.state() == (11, 1)


def test_successors_in_a_line_not_open_here_yet_wait_for_its_rewind() -> None:
    node = started()
    windows(node)
    successor = node.wait(chunk(11, (11, 1)), "w3")  # E = e + 1, p = F
    further = node.wait(chunk(11, (11, 2)), "w4")  # E > e + 1
    node.finish(node.process(chunk(9, (14, 1), tokens=2), "rewind"))
    step = node.process(chunk(11, (11, 1)), "w3", successor.waiter)
    assert (step.position, step.epoch) == (11, 1)
    node.finish(step)
    again = node.offer(chunk(11, (11, 2)), "w4", further.waiter)
    assert isinstance(again, Wait)  # line 2's rewind has not run either


# -- retransmissions and conflicts of plain successors --------------------------------------------


def test_a_retransmitted_successor_is_replayed() -> None:
    node = started()
    h = chunk(8, (8, 0))
    first = node.process(h, "w1")
    assert node.offer(h, "w1") == Join(first)
    node.finish(first)
    assert node.state() == (11, 0)
    assert node.offer(h, "w1") == Replay(f"resp-{first.serial}")
    node.refused(h, "changed", "chunk_conflict", head=False)


def test_a_successor_behind_the_session_that_is_not_a_retransmission_is_409() -> None:
    node = started()
    windows(node)  # S = 14 > F
    # w1's record is kept (an earlier window): another chunk there conflicts.
    node.refused(chunk(8, (8, 0)), "not w1", "chunk_conflict", head=False)
    node.refused(chunk(10, (10, 0), tokens=2), "x", "position_mismatch")
    node.refused(chunk(9, (12, 1), tokens=2), "x", "position_mismatch")  # a rewind from F < S
    assert node.state() == (14, 0)


def test_a_session_adopted_without_records_routes_by_its_state() -> None:
    node = Node()
    node.table.adopt(S2, 20, node.now, key=KEY, epoch=3)
    assert node.state(S2) == (20, 3)
    assert node.table.epoch(S1) is None
    node.refused(chunk(20, (20, 2), session=S2), "old", "window_stale")
    node.refused(chunk(19, (19, 3), tokens=1, session=S2), "x", "position_mismatch")
    step = node.process(chunk(20, (20, 3), session=S2), "w")
    assert (step.position, step.epoch) == (20, 3)
    node.finish(step)
    assert node.state(S2) == (23, 3)
    rewind = node.process(chunk(21, (23, 4), tokens=1, session=S2), "rewind")
    node.finish(rewind)
    assert node.state(S2) == (22, 4)


# -- chunks without After, sessions this node does not hold, headers built by hand ---------------


def test_a_chunk_without_after_follows_the_plain_rules_whatever_the_epoch() -> None:
    node = started()
    windows(node)
    node.finish(node.process(chunk(9, (14, 1), tokens=2), "rewind"))
    plain = node.process(chunk(11, tokens=1), "decode")
    assert (plain.position, plain.epoch, plain.rewind_from) == (11, 1, None)
    node.finish(plain)
    assert node.state() == (12, 1)
    node.refused(chunk(9, tokens=1), "x", "position_mismatch")


def test_an_unknown_session_starts_only_in_line_0_at_its_position() -> None:
    node = Node()
    for h in (chunk(0, (3, 0)), chunk(0, (0, 1)), chunk(3, (3, 0))):
        node.refused(h, "x", "session_unknown")
    assert S1 not in node.table
    first = node.process(chunk(0, (0, 0)), "first")
    assert (first.position, first.epoch, first.rewind_from) == (0, 0, None)


def test_an_after_out_of_place_in_headers_built_by_hand_is_400() -> None:
    """The parser refuses these first; the table holds hand-built headers
    to the same rule."""
    node = started()
    for session in (S1, S2):  # a session held, and one this node does not know
        for h in (
            chunk(8, (8, 0), index=1, total=2, session=session),
            chunk(9, (8, 0), session=session),
        ):
            node.refused(h, "x", "bad_after")
            with pytest.raises(ProtocolError):
                node.table.check_head(h, node.now)


# -- check_head agrees with offer ------------------------------------------------------------------

# (setup, the session's chunks before the one checked)
SETUPS = {
    "line 0, between runs": lambda node: windows(node),
    "line 0, run open": lambda node: (
        node.finish(node.process(chunk(8, (8, 0)), "w1")),
        node.process(chunk(11, (11, 0)), "w2"),
    ),
    "line 1, rewind answered": lambda node: (
        windows(node),
        node.finish(node.process(chunk(9, (14, 1), tokens=2), "r")),
    ),
    "line 1, rewind in the stage": lambda node: (
        windows(node),
        node.process(chunk(9, (14, 1), tokens=2), "r"),
    ),
}
# Chunks at p with After (F, E), each with the tag of the chunk it may repeat.
CANDIDATES = [
    (p, (f, e), tokens)
    for p, f, e, tokens in itertools.product((8, 9, 11, 14), (8, 11, 14, 17), (0, 1, 2), (2, 3))
    if p <= f
]


# The chunks the setups ran, by (p, After): their tag and tokens.
RAN = {(8, (8, 0)): ("w1", 3), (11, (11, 0)): ("w2", 3), (9, (14, 1)): ("r", 2)}
DECISIONS = ("Process", "Wait", "Replay", "Join", "Reforward")


@pytest.mark.parametrize("setup", list(SETUPS))
def test_check_head_raises_what_offer_raises(setup: str) -> None:
    """For every chunk with After against every state: the head refuses
    exactly what offer refuses, with the same code (offered with the tensor
    of the chunk it repeats, so only a shape of its own can differ)."""
    decided = set()
    for p, after, tokens in CANDIDATES:
        node = started()
        SETUPS[setup](node)
        h = chunk(p, after, tokens=tokens)
        try:
            node.table.check_head(h, node.now)
            head = None
        except MeshnetError as err:
            head = err.code
        tag, ran_tokens = RAN.get((p, after), ("new", tokens))
        try:
            decision = node.table.offer(h, fp(tag), node.now)
            offered = type(decision).__name__
        except MeshnetError as err:
            offered = err.code
        assert head is None or head == offered, (p, after, tokens, head, offered)
        # Only the tensor tells a retransmission of another shape (its
        # fingerprint) from the chunk that ran.
        tensor = ("chunk_conflict",) if tokens != ran_tokens else ()
        assert head is not None or offered in DECISIONS + tensor, (p, after, tokens, offered)
        decided.add(offered)
    assert "Wait" in decided and len(decided) >= 3  # the grid reaches several rules
