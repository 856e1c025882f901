"""wire-2 §3.13: sampling at the last stage — the header's grammar and ranges
(both roles: refused from the head, nothing changed), and the draw a node
answers with (one float32 row ``[1, 8]`` as the "logits" of an identity
stage), held to the reference draw: the token, its logprobs, its replay;
and a mask (``X-Meshnet-Allow``): refused when malformed, the draw held to
the ids it sets, a mask of another width not used.
"""

from __future__ import annotations

import base64
import math
import struct

import numpy as np
import zstandard

from meshnet_model.sampling import Sampler, SamplingParams

from ._case import (
    BOTH,
    GATEWAY,
    NODE,
    Case,
    Context,
    expect_error,
    expect_tensor,
    new_session,
    replace_header,
)
from ._session_chunks import refused_from_head
from ._wire import CheckFailed, Response

SECTION = "3"
SAMPLE = "X-Meshnet-Sample"
ALLOW = "X-Meshnet-Allow"
VOCAB = 8  # the "logits" row the checker sends: float32 [1, VOCAB]
ROW = [0.5, -1.25, 2.0, 0.75, 1.5, -0.5, 1.75, 0.25]


def _sampled(
    ctx: Context,
    value: str | None,
    *,
    session: str | None = None,
    shape: str = "",
    key: str = "",
    allow: str = "",
) -> bytes:
    """A float32 "logits" chunk (``[1, VOCAB]`` unless ``shape``) asking for a draw."""
    shape = shape or f"1,{VOCAB}"
    position = 0 if ctx.role == "node" else None
    headers = replace_header(
        ctx.forward_headers(session=session, position=position), "X-Meshnet-Shape", shape
    )
    if key:
        headers.append(("X-Meshnet-Session-Key", key))
    if value is not None:
        headers.append((SAMPLE, value))
    if allow:
        headers.append((ALLOW, allow))
    count = math.prod(int(d) for d in shape.split(","))
    body = struct.pack(f"<{count}f", *(ROW * (count // VOCAB + 1))[:count])
    return ctx.forward(headers, body)


def _mask(*ids: int, width: int = VOCAB) -> str:
    """The X-Meshnet-Allow value setting ``ids`` of ``width``."""
    bits = np.zeros(width, dtype=bool)
    bits[list(ids)] = True
    mask = np.packbits(bits, bitorder="little").tobytes()
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(mask)
    return base64.urlsafe_b64encode(frame).rstrip(b"=").decode()


def _allowed(ctx: Context) -> None:
    """Greedy among the ids the mask sets: ids 1 and 5 (-1.25, -0.5) give 5,
    though 2 holds the row's highest logit; seeded, only those ids come."""
    response = ctx.send(_sampled(ctx, "seed=1,temperature=0", allow=_mask(1, 5)))
    token = int(_drawn(response, "1,1", "int32")[0])
    if token != 5:
        raise CheckFailed(f"temperature 0 under a mask of ids 1 and 5 draws 5, got {token}")
    for seed in (21, 22, 23, 24):
        response = ctx.send(_sampled(ctx, f"seed={seed},temperature=2", allow=_mask(0, 3, 7)))
        token = int(_drawn(response, "1,1", "int32")[0])
        if token not in (0, 3, 7):
            raise CheckFailed(f"a mask of ids 0, 3 and 7 drew id {token}")


def _allow_other_width(ctx: Context) -> None:
    """A mask of another width than the row is not used: the logits come back."""
    response = ctx.send(_sampled(ctx, "seed=1,temperature=0", allow=_mask(1, width=16)))
    expect_tensor(response, shape=f"1,{VOCAB}", dtype="float32")


def _refused_case(
    id: str,
    value: str | None,
    description: str,
    shape: str = "",
    *,
    allow: str = "",
    header: str = SAMPLE,
) -> Case:
    def check(ctx: Context) -> None:
        refused_from_head(
            ctx,
            lambda session: _sampled(ctx, value, session=session, shape=shape, allow=allow),
            "bad_sample",
            header.lower(),
        )

    return Case(
        f"3.sample.{id}",
        SECTION,
        f"{header} {description} is 400 bad_sample naming it, and changes nothing",
        check,
        BOTH,
    )


def _reference(seed: int, temperature: float, logprobs: int | None = None) -> Sampler:
    params = SamplingParams(temperature=temperature, logprobs=logprobs)
    return Sampler(params, seed)


def _drawn(response: Response, shape: str, dtype: str) -> np.ndarray:
    expect_tensor(response, shape=shape, dtype=dtype)
    if response.all("x-meshnet-sample"):
        raise CheckFailed("an answer never carries X-Meshnet-Sample (request-only)")
    return np.frombuffer(response.body, "<i4" if dtype == "int32" else "<f4")


def _greedy(ctx: Context) -> None:
    session = new_session()
    request = _sampled(ctx, "seed=1,temperature=0", session=session)
    first = _drawn(ctx.send(request), "1,1", "int32")
    want = int(np.argmax(ROW))
    if int(first[0]) != want:
        raise CheckFailed(f"temperature 0 draws the highest logit's id {want}, got {first[0]}")
    again = ctx.send(request)  # a retransmission: the kept answer
    if _drawn(again, "1,1", "int32").tolist() != first.tolist():
        raise CheckFailed("a retransmission of a sampled chunk answered another token")


def _seeded(ctx: Context) -> None:
    """The draw is a function of (seed, position): the chunk's position (0)
    plus its tokens (axis 1: VOCAB) is where the token is drawn."""
    drawn = []
    for seed in (11, 12, 13, 14, 15, 16):
        response = ctx.send(_sampled(ctx, f"seed={seed},temperature=1.5"))
        drawn.append(int(_drawn(response, "1,1", "int32")[0]))
    want = [_reference(seed, 1.5)(np.array(ROW), VOCAB) for seed in (11, 12, 13, 14, 15, 16)]
    if drawn != want:
        raise CheckFailed(f"seeds 11..16 at position {VOCAB} draw {want}, got {drawn}")


def _logprobs(ctx: Context) -> None:
    response = ctx.send(_sampled(ctx, "seed=3,temperature=0,logprobs=2"))
    row = _drawn(response, "1,6", "float32").astype(np.float64)
    sampler = _reference(3, 0.0, 2)
    token = sampler(np.array(ROW), VOCAB)
    chosen = sampler.last
    assert chosen is not None
    want = [token, chosen.logprob, *(v for pair in chosen.top for v in pair)]
    if not np.allclose(row, want, rtol=1e-5, atol=1e-5):
        raise CheckFailed(f"logprobs=2 answers {want} (id, logprob, 2 pairs), got {row.tolist()}")


KEY, STRANGER = "0123456789abcdef" * 2, "fedcba9876543210" * 2


def _poll(ctx: Context, session: str, query: str = "position=0", key: str = KEY) -> Response:
    return ctx.send(
        ctx.request("GET", f"/drawn/{session}?{query}", [("X-Meshnet-Session-Key", key)])
    )


def _drawn_answer(ctx: Context) -> None:
    session = new_session()
    chunk = ctx.send(_sampled(ctx, "seed=1,temperature=0", session=session, key=KEY))
    first = _drawn(chunk, "1,1", "int32")
    polled = _drawn(_poll(ctx, session), "1,1", "int32")
    if polled.tolist() != first.tolist():
        raise CheckFailed(f"the poll answered {polled.tolist()}, the chunk {first.tolist()}")


def _drawn_stranger(ctx: Context) -> None:
    session = new_session()
    _drawn(
        ctx.send(_sampled(ctx, "seed=1,temperature=0", session=session, key=KEY)), "1,1", "int32"
    )
    expect_error(_poll(ctx, session, key=STRANGER), 403, "session_forbidden")
    _drawn(_poll(ctx, session), "1,1", "int32")  # the owner's poll still answered


def _drawn_refused(ctx: Context) -> None:
    expect_error(_poll(ctx, new_session(), "position=01"), 400, "bad_request")
    expect_error(_poll(ctx, new_session()), 404, "not_found")


def _drawn_gateway(ctx: Context) -> None:
    expect_error(_poll(ctx, new_session()), 404, "not_found")


CASES: list[Case] = [
    _refused_case("no-seed", "temperature=0.5", "without seed"),
    _refused_case("unknown", "seed=1,beams=4", "naming an unknown parameter"),
    _refused_case("twice", "seed=1,top_k=2,top_k=3", "giving a parameter twice"),
    _refused_case("nan", "seed=1,temperature=nan", "with a temperature of nan"),
    _refused_case("range", "seed=1,top_p=0", "with top_p 0 (outside (0, 1])"),
    _refused_case("logprobs-21", "seed=1,logprobs=21", "asking for 21 logprobs (at most 20)"),
    _refused_case("overflow", "seed=1,min_p=1e999", "with a decimal that overflows"),
    _refused_case("batch", "seed=1", "on a chunk of batch 2", shape=f"2,{VOCAB}"),
    _refused_case(
        "allow-base64", "seed=1", "that is not unpadded base64url", allow="abc=", header=ALLOW
    ),
    _refused_case(
        "allow-frame", "seed=1", "that is not a zstd frame", allow="bm90IGEgZnJhbWU", header=ALLOW
    ),
    _refused_case("allow-alone", None, "without X-Meshnet-Sample", allow=_mask(1), header=ALLOW),
    Case(
        "3.sample.allow",
        SECTION,
        "with X-Meshnet-Allow a node draws among the ids the mask sets: temperature 0 the "
        "highest allowed logit, seeded draws only allowed ids",
        _allowed,
        NODE,
    ),
    Case(
        "3.sample.allow-width",
        SECTION,
        "a mask that is not one bit per id of the row is not used: the chunk is answered "
        "with its logits, float32 [1, 8]",
        _allow_other_width,
        NODE,
    ),
    Case(
        "3.sample.greedy",
        SECTION,
        "a node draws with temperature 0 the highest logit's id "
        "from a float32 [1, 8] row an identity stage answers, as int32 [1, 1] without "
        "X-Meshnet-Sample, and a retransmission answers the same token",
        _greedy,
        NODE,
    ),
    Case(
        "3.sample.seeded",
        SECTION,
        "a seeded draw is Philox(key=seed, counter=position) "
        "over the row: six seeds draw the reference's six tokens",
        _seeded,
        NODE,
    ),
    Case(
        "3.sample.logprobs",
        SECTION,
        "logprobs=2 answers float32 [1, 6]: the id, its "
        "logprob, two (id, logprob) pairs of the raw log-softmax",
        _logprobs,
        NODE,
    ),
    Case(
        "3.drawn.answer",
        SECTION,
        "GET /drawn/{id}?position=P answers the owner the token the sampled chunk at P drew, "
        "as the chunk was answered (§3.14)",
        _drawn_answer,
        NODE,
    ),
    Case(
        "3.drawn.stranger",
        SECTION,
        "GET /drawn/{id} with another session key is 403 session_forbidden; the owner's is "
        "still answered",
        _drawn_stranger,
        NODE,
    ),
    Case(
        "3.drawn.refused",
        SECTION,
        "GET /drawn/{id} with a non-canonical position is 400 bad_request; of a session the "
        "node does not hold, 404 not_found",
        _drawn_refused,
        NODE,
    ),
    Case(
        "3.drawn.gateway",
        SECTION,
        "a gateway draws nothing: GET /drawn/{id} is 404 not_found",
        _drawn_gateway,
        GATEWAY,
    ),
]
