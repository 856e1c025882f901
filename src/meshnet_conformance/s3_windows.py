"""wire-2 §3.16: verify windows and rewinds — both headers' grammar (refused
from the head, nothing changed), a window decided from the rows an identity
stage answers (float32 ``[1, k + 1, 8]`` as its "logits") and its answer's
``X-Meshnet-Accepted`` count, and the rewind's routing: a rewind drops
positions, a stale window is refused at once, a retransmission is replayed,
windows sent out of order run in order.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshnet_model.sampling import Sampler, SamplingParams
from meshnet_model.speculative import verify_sampled

from ._case import NODE, Case, Context, expect_error, expect_tensor, new_session
from ._session_chunks import refused_from_head
from ._wire import CheckFailed, Response

SECTION = "3"
DRAFT, AFTER, SAMPLE = "X-Meshnet-Draft", "X-Meshnet-After", "X-Meshnet-Sample"
VOCAB = 8
# Row i's highest logit is at ROW_BEST[i]: a greedy window accepts the drafts
# that name them.
ROW_BEST = (2, 6, 4, 1, 7)
# A rewind's waiters: long enough for a loaded node, short for the checker.
WAIT_DEADLINE_MS = 400


def _rows(count: int) -> list[float]:
    values: list[float] = []
    for i in range(count):
        row = [0.25 * ((3 * i + j) % 5) for j in range(VOCAB)]
        row[ROW_BEST[i % len(ROW_BEST)]] = 3.0
        values += row
    return values


def _window(
    ctx: Context,
    drafts: Sequence[int] | str,
    *,
    session: str | None = None,
    position: int | None = None,
    after: str | None = None,
    sample: str = "seed=1,temperature=0",
    tokens: int | None = None,
    index: int = 0,
    total: int = 1,
    deadline_ms: int | None = None,
) -> bytes:
    """A float32 "logits" window ``[1, tokens, VOCAB]`` (``tokens``: one more
    than the drafts unless given) with ``X-Meshnet-Draft`` and, if given,
    ``X-Meshnet-After``."""
    draft = drafts if isinstance(drafts, str) else ",".join(str(d) for d in drafts)
    count = tokens if tokens is not None else len(draft.split(",")) + 1
    if ctx.role == "node" and position is None:
        position = 0
    headers = ctx.forward_headers(
        count, session=session, position=position, index=index, total=total
    )
    headers = [(n, f"1,{count},{VOCAB}" if n == "X-Meshnet-Shape" else v) for n, v in headers]
    if sample:
        headers.append((SAMPLE, sample))
    headers.append((DRAFT, draft))
    if after is not None:
        headers.append((AFTER, after))
    if deadline_ms is not None:
        headers.append(("X-Meshnet-Deadline-Ms", str(deadline_ms)))
    rows = _rows(count)
    return ctx.forward(headers, struct.pack(f"<{len(rows)}f", *rows))


def _tokens(response: Response, drafts: Sequence[int]) -> list[int]:
    """The tokens of the answer to a window of ``drafts``, checked against
    its ``X-Meshnet-Accepted`` as a sender must (§3.16)."""
    shape = response.header("x-meshnet-shape") or ""
    expect_tensor(response, shape=shape, dtype="int32")
    for name in ("x-meshnet-draft", "x-meshnet-after", "x-meshnet-sample"):
        if response.all(name):
            raise CheckFailed(f"an answer to a window never carries {name} (request-only)")
    got = [int(t) for t in np.frombuffer(response.body, "<i4").tolist()]
    if shape != f"1,{len(got)}" or not got:
        raise CheckFailed(f"a window is answered int32 [1, n], got shape {shape!r}")
    accepted = len(got) - 1
    counts = response.all("x-meshnet-accepted")
    if counts != [str(accepted)]:
        raise CheckFailed(
            f"a window answered {got} carries X-Meshnet-Accepted: {accepted} (n - 1), "
            f"got {counts or 'none'}"
        )
    rejected = accepted < len(drafts) and got[-1] == drafts[accepted]
    if got[:accepted] != list(drafts[:accepted]) or rejected:
        raise CheckFailed(f"a window of drafts {list(drafts)} answered {got}: no verification")
    return got


def _verified(ctx: Context, drafts: Sequence[int], **window: Any) -> list[int]:
    """The tokens a window of ``drafts`` (``_window``'s other fields) is answered."""
    return _tokens(ctx.send(_window(ctx, drafts, **window)), drafts)


def _refused(id: str, header: str, code: str, description: str, **window: Any) -> Case:
    """A window spoilt as ``window`` says (``drafts`` among them, default
    ``[2]``) is refused from the head."""
    drafts = window.pop("drafts", [2])

    def check(ctx: Context) -> None:
        refused_from_head(
            ctx,
            lambda session: _window(ctx, drafts, session=session, **window),
            code,
            header.lower(),
        )

    return Case(
        f"3.window.{id}",
        SECTION,
        f"{description} is 400 {code} naming {header}, and changes nothing",
        check,
        NODE,
    )


def _greedy(ctx: Context) -> None:
    """Drafts 2, 6 match rows 0 and 1; 5 does not match row 2 (4): the window
    answers the two accepted drafts then the row's own token."""
    got = _verified(ctx, [2, 6, 5])
    if got != [2, 6, 4]:
        raise CheckFailed(
            f"drafts 2,6,5 over rows whose best are 2,6,4 answer [2, 6, 4], got {got}"
        )
    whole = _verified(ctx, [2, 6, 4])
    if whole != [2, 6, 4, 1]:
        raise CheckFailed(
            f"every draft accepted answers them and the bonus [2, 6, 4, 1], got {whole}"
        )


def _seeded(ctx: Context) -> None:
    """At temperature 1.5 each row draws as §3.13 draws at its position: the
    reference's verification over the same rows."""
    for seed in (3, 4, 5, 6):
        drafts = [2, 6, 4]
        got = _verified(ctx, drafts, sample=f"seed={seed},temperature=1.5")
        rows = np.array(_rows(4), dtype=np.float32).reshape(4, VOCAB)
        sampler = Sampler(SamplingParams(temperature=1.5), seed)
        want = verify_sampled(rows, drafts, sampler, start_position=1)
        if got != want:
            raise CheckFailed(f"seed {seed}: the reference decides {want}, the node {got}")


def _plain(ctx: Context, session: str, position: int, tokens: int = 2) -> bytes:
    """A float chunk of the session (no window), for its positions."""
    headers = ctx.forward_headers(tokens, session=session, position=position)
    return ctx.forward(headers, struct.pack(f"<{4 * tokens}f", *range(4 * tokens)))


def _expect_at(response: Response, position: int) -> None:
    expect_tensor(response, shape="1,2,4")
    if response.header("x-meshnet-position") != str(position):
        raise CheckFailed(
            f"expected X-Meshnet-Position {position}, got {response.header('x-meshnet-position')}"
        )


def _rewind(ctx: Context) -> None:
    """A session at 2, a window of 4 at 2 (held: 6); a rewind to 3 after 6
    (epoch 1) runs at 3, so the session is then at 3 + 4 = 7."""
    session = new_session()
    _expect_at(ctx.send(_plain(ctx, session, 0)), 0)
    _verified(ctx, [2, 6, 5], session=session, position=2, after="position=2,epoch=0")
    request = _window(ctx, [6, 4, 1], session=session, position=3, after="position=6,epoch=1")
    first = _tokens(ctx.send(request), [6, 4, 1])
    if _tokens(ctx.send(request), [6, 4, 1]) != first:
        raise CheckFailed("a retransmission of a rewind answered other tokens (§3.5: replayed)")
    expect_error(ctx.send(_plain(ctx, session, 6)), 409, "position_mismatch")
    _expect_at(ctx.send(_plain(ctx, session, 7)), 7)


def _stale(ctx: Context) -> None:
    """After a rewind to epoch 1, a window of epoch 0 is 409 window_stale at
    once (no wait: its deadline is long), and the session goes on."""
    session = new_session()
    _expect_at(ctx.send(_plain(ctx, session, 0)), 0)
    _verified(ctx, [2, 6, 5], session=session, position=2, after="position=2,epoch=0")
    _verified(ctx, [6], session=session, position=3, after="position=6,epoch=1")
    stale = _window(ctx, [2], session=session, position=5, after="position=5,epoch=0")
    expect_error(ctx.send(stale), 409, "window_stale")
    _verified(ctx, [2], session=session, position=5, after="position=5,epoch=1")


def _in_order(ctx: Context) -> None:
    """The second window (after 5) sent first waits for the first (2 → 5),
    then both are answered, each at its own position."""
    session = new_session()
    _expect_at(ctx.send(_plain(ctx, session, 0)), 0)
    second = _window(ctx, [2], session=session, position=5, after="position=5,epoch=0")
    first = _window(ctx, [2, 6], session=session, position=2, after="position=2,epoch=0")
    with ctx.connect() as early, ctx.connect() as late:
        early.send(second)
        answered_first = late.exchange(first)
        answered_second = early.read_response()
    for response, position, drafts in ((answered_first, "2", [2, 6]), (answered_second, "5", [2])):
        _tokens(response, drafts)
        if response.header("x-meshnet-position") != position:
            raise CheckFailed(
                f"a window at {position} answered at {response.header('x-meshnet-position')}"
            )


def _not_yet(ctx: Context) -> None:
    """A rewind after positions the session never reaches waits, and ends
    with the deadline (409 chunk_wait_timeout or 504): it never runs early."""
    session = new_session()
    _expect_at(ctx.send(_plain(ctx, session, 0)), 0)
    early = _window(
        ctx,
        [2],
        session=session,
        position=1,
        after="position=9,epoch=1",
        deadline_ms=WAIT_DEADLINE_MS,
    )
    response = ctx.send(early)
    if response.status not in (409, 504):
        raise CheckFailed(f"a rewind after a position never reached answered {response.summary()}")
    _expect_at(ctx.send(_plain(ctx, session, 2)), 2)  # nothing was dropped


CASES: list[Case] = [
    _refused("draft-grammar", DRAFT, "bad_draft", "an empty drafted id", drafts="2,,6"),
    _refused("draft-zero", DRAFT, "bad_draft", "a drafted id 06", drafts="2,06"),
    _refused("draft-many", DRAFT, "bad_draft", "65 drafted ids", drafts=[1] * 65),
    _refused("draft-big", DRAFT, "bad_draft", "a drafted id 2^31", drafts="2147483648"),
    _refused("draft-tokens", DRAFT, "bad_draft", "a window of 3 tokens, 1 draft", tokens=3),
    _refused("draft-unsampled", DRAFT, "bad_draft", "a draft without a sample", sample=""),
    _refused("after-grammar", AFTER, "bad_after", "an After without epoch", after="position=0"),
    _refused(
        "after-order", AFTER, "bad_after", "an After's fields swapped", after="epoch=0,position=0"
    ),
    _refused(
        "after-ahead",
        AFTER,
        "bad_after",
        "a chunk at 3 after position 2 (p > F)",
        position=3,
        after="position=2,epoch=0",
    ),
    _refused(
        "after-index",
        AFTER,
        "bad_after",
        "an After on chunk 1 of a run",
        index=1,
        total=2,
        position=0,
        after="position=0,epoch=0",
    ),
    Case(
        "3.window.greedy",
        SECTION,
        "a window over an identity stage's rows is answered int32 [1, n]: the accepted "
        "drafts, then the first row's own token that differs, or the bonus after all; "
        "X-Meshnet-Accepted says n - 1",
        _greedy,
        NODE,
    ),
    Case(
        "3.window.seeded",
        SECTION,
        "a seeded window decides each row as §3.13 draws at its position",
        _seeded,
        NODE,
    ),
    Case(
        "3.window.rewind",
        SECTION,
        "a rewind (p < F, the next epoch) runs at p once the session holds F; its "
        "retransmission is replayed; the session is then at p + tokens",
        _rewind,
        NODE,
    ),
    Case(
        "3.window.stale",
        SECTION,
        "a window of an epoch rewound away from is 409 window_stale at once",
        _stale,
        NODE,
    ),
    Case(
        "3.window.order",
        SECTION,
        "windows of one line sent out of order run in order",
        _in_order,
        NODE,
    ),
    Case(
        "3.window.early",
        SECTION,
        "a rewind after a position the session never reaches waits, ends with its "
        "deadline, and drops nothing",
        _not_yet,
        NODE,
    ),
]
