"""wire-2 §3.16 in the core: ``X-Meshnet-Draft`` and ``X-Meshnet-After`` —
their grammars, what the head alone decides about them (400 ``bad_draft``,
``bad_after``, in §2.7's order after the sample header), their canonical
form and round trip, and the hand-built headers — and the answer's
``X-Meshnet-Accepted`` (read on answers only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto import (
    ClientConnection,
    DownstreamError,
    ErrorCode,
    ProtocolError,
    ServerConnection,
    WireHeaders,
)
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto._windows import parse_after_value, parse_draft_value
from meshnet_proto.lowlevel import MAX_DRAFT, AfterSpec, SampleSpec

S = "5b1e0c2a-1111-4abc-8def-000000000001"
ID = 2**31 - 1  # the largest token id a draft may name


def pairs(
    *,
    draft: bytes | None = None,
    after: bytes | None = None,
    sample: bytes | None = b"seed=1",
    shape: bytes = b"1,4",
    dtype: bytes = b"int32",
    index: bytes = b"0",
    total: bytes = b"1",
    position: bytes | None = b"8",
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> list[tuple[bytes, bytes]]:
    out = [
        (b"content-type", b"application/octet-stream"),
        (b"x-meshnet-shape", shape),
        (b"x-meshnet-dtype", dtype),
        (b"x-meshnet-session", S.encode()),
        (b"x-meshnet-chunk-index", index),
        (b"x-meshnet-chunk-total", total),
    ]
    for name, value in (
        (b"x-meshnet-position", position),
        (b"x-meshnet-sample", sample),
        (b"X-Meshnet-Draft", draft),
        (b"X-Meshnet-After", after),
    ):
        if value is not None:
            out.append((name, value))
    return out + list(extra)


def refused(code: str, **fields: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as err:
        parse_wire_headers(pairs(**fields))
    assert (err.value.status, err.value.code) == (400, code)
    return err.value


# -- the values, in their canonical form ----------------------------------------------------------


def test_absent_is_none_and_sends_nothing() -> None:
    headers = parse_wire_headers(pairs())
    assert headers.draft is None and headers.after is None
    names = {name for name, _ in headers.to_pairs()}
    assert b"X-Meshnet-Draft" not in names and b"X-Meshnet-After" not in names


def test_a_window_and_its_after_parse_and_write_back_canonically() -> None:
    headers = parse_wire_headers(pairs(draft=b"12,7,99", after=b"position=8,epoch=3", shape=b"1,4"))
    assert headers.draft == (12, 7, 99)
    assert headers.after == AfterSpec(position=8, epoch=3)
    sent = dict(headers.to_pairs())
    assert sent[b"X-Meshnet-Draft"] == b"12,7,99"
    assert sent[b"X-Meshnet-After"] == b"position=8,epoch=3"
    assert parse_wire_headers(headers.to_pairs()) == headers


def test_hidden_states_are_a_window_too() -> None:
    headers = parse_wire_headers(pairs(draft=b"5,6", shape=b"1,3,16", dtype=b"bfloat16"))
    assert headers.draft == (5, 6)


def test_the_longest_draft_is_703_bytes() -> None:
    value = ",".join([str(ID)] * MAX_DRAFT).encode()
    assert MAX_DRAFT == 64 and len(value) == 703
    shape = f"1,{MAX_DRAFT + 1}".encode()
    assert parse_wire_headers(pairs(draft=value, shape=shape)).draft == (ID,) * MAX_DRAFT
    one_more = value + b",1"
    refused("bad_draft", draft=one_more, shape=f"1,{MAX_DRAFT + 2}".encode())


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b",",
        b"1,",
        b",1",
        b"1,,2",
        b"1, 2",
        b" 1",
        b"01",
        b"+1",
        b"-1",
        b"1.0",
        b"0x1",
        str(2**31).encode(),
        b"99999999999",
        "\u0661".encode(),  # an Arabic-Indic digit one
        b"1;2",
    ],
)
def test_malformed_drafts_are_400_bad_draft(value: bytes) -> None:
    error = refused("bad_draft", draft=value, shape=b"1,2")
    assert error.header == "x-meshnet-draft"


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"position=1",
        b"epoch=1",
        b"epoch=1,position=8",
        b"position=8,epoch=1,position=8",
        b"position=8,epoch=1,",
        b"position=8, epoch=1",
        b"position=08,epoch=1",
        b"position=8,epoch=01",
        b"position=8,epoch=-1",
        b"Position=8,epoch=1",
        b"position=8;epoch=1",
        b"position=,epoch=1",
        b"position=8,epoch=" + b"1" * 20,
        b"position=8,epoch=1,seed=2",
    ],
)
def test_malformed_afters_are_400_bad_after(value: bytes) -> None:
    error = refused("bad_after", after=value)
    assert error.header == "x-meshnet-after"


def test_the_largest_values_after_takes() -> None:
    big = b"9" * 19
    after = parse_wire_headers(
        pairs(after=b"position=" + big + b",epoch=" + big, position=big)
    ).after
    assert after == AfterSpec(int(big), int(big))


def test_each_given_twice_is_a_duplicate_header() -> None:
    for name, value in ((b"x-meshnet-draft", b"1"), (b"x-meshnet-after", b"position=8,epoch=0")):
        with pytest.raises(ProtocolError) as err:
            parse_wire_headers(pairs(shape=b"1,2", extra=((name, value), (name.upper(), value))))
        assert (err.value.code, err.value.header) == ("duplicate_header", name.decode())


# -- what the head decides about the chunk ------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"sample": None}, "X-Meshnet-Sample is required"),
        ({"shape": b"1,4"}, "[1, 3]"),  # k + 2 tokens
        ({"shape": b"1,2"}, "[1, 3]"),  # k tokens
        ({"shape": b"3"}, "[1, 3]"),  # rank 1: no batch
        ({"shape": b"1,3", "dtype": b"float32"}, "float32"),  # logits are no ids
        ({"shape": b"1,3,8", "dtype": b"int32"}, "int32"),  # ids are no hidden states
        ({"shape": b"1,3,8,2"}, "[1, 3]"),
    ],
)
def test_a_draft_on_what_is_not_a_window_is_400(fields: dict[str, Any], why: str) -> None:
    fields.setdefault("shape", b"1,3")
    error = refused("bad_draft", draft=b"4,5", **fields)
    assert why in error.message and error.header == "x-meshnet-draft"


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"index": b"1", "total": b"2"}, "chunk 0"),
        ({"position": None}, "X-Meshnet-Position"),
        ({"position": b"9"}, "past the position 8"),
    ],
)
def test_an_after_out_of_place_is_400(fields: dict[str, Any], why: str) -> None:
    error = refused("bad_after", after=b"position=8,epoch=0", **fields)
    assert why in error.message and error.header == "x-meshnet-after"


def test_an_after_at_or_below_its_position_is_taken() -> None:
    for position in (b"0", b"3", b"8"):
        after = parse_wire_headers(pairs(after=b"position=8,epoch=2", position=position)).after
        assert after == AfterSpec(8, 2)


def test_the_order_of_checks() -> None:
    """§2.7: the sample header's checks, then Draft's (grammar, then what it
    says), then After's, then the tenancy headers'."""
    bad_client = ((b"x-meshnet-client", b"NOT-HEX"),)
    bad = {"draft": b"x", "after": b"x", "extra": bad_client}
    refused("bad_sample", sample=b"nope", **bad)
    refused("bad_sample", draft=b"4,5", shape=b"2,3")  # a sampled chunk is batch 1 first
    refused("bad_draft", **bad)
    refused("bad_draft", draft=b"1", sample=None, after=b"x", extra=bad_client)
    refused("bad_after", draft=b"1,2,3", after=b"x", extra=bad_client)
    refused("bad_after", after=b"position=1,epoch=0", extra=bad_client)
    refused("bad_session", after=b"position=8,epoch=0", extra=bad_client)
    # Before the tensor's size (413).
    huge = str(2**40).encode()
    refused("bad_draft", draft=b"x", shape=b"1," + huge)


def test_a_gateway_checks_the_grammar_and_ignores_the_rest() -> None:
    """wire-2 §2.2: at the gateway both are grammar checked, otherwise ignored."""
    gateway = [
        (b"content-type", b"application/octet-stream"),
        (b"x-meshnet-shape", b"1,7,8"),
        (b"x-meshnet-dtype", b"float32"),
    ]
    window = [(b"x-meshnet-draft", b"1,2"), (b"x-meshnet-after", b"position=3,epoch=1")]
    headers = parse_wire_headers(gateway + window, require_sequencing=False)
    assert headers.draft == (1, 2) and headers.after == AfterSpec(3, 1)
    for name, value, code in (
        (b"x-meshnet-draft", b"1,,2", "bad_draft"),
        (b"x-meshnet-after", b"epoch=1", "bad_after"),
    ):
        with pytest.raises(ProtocolError) as err:
            parse_wire_headers([*gateway, (name, value)], require_sequencing=False)
        assert err.value.code == code


def test_a_kv_exports_answer_carries_after() -> None:
    """wire-2 §3.11/§3.16: the export's 200 names the session's epoch; the
    importer parses it as any message (position = F, chunk 0)."""
    answer = WireHeaders(
        shape=(1, 2, 1, 2, 5, 4),
        dtype="float32",
        session=S,
        chunk_index=0,
        chunk_total=1,
        position=5,
        kv_checksum="0" * 16,
        kv_fingerprint="0" * 32,
        after=AfterSpec(position=5, epoch=2),
    )
    parsed = parse_wire_headers(answer.to_pairs())
    assert parsed.after == AfterSpec(5, 2) and parsed == answer


def test_a_server_answers_a_bad_window_400_before_the_body() -> None:
    server = ServerConnection()
    head = b"".join(name + b": " + value + b"\r\n" for name, value in pairs(draft=b"1,x"))
    server.receive_data(b"POST /forward HTTP/1.1\r\nhost: n\r\ncontent-length: 16\r\n" + head)
    server.receive_data(b"\r\n")
    event = server.next_event()
    assert type(event).__name__ == "ProtocolErrorReceived"
    error = event.error  # type: ignore[attr-defined]
    assert (error.status, error.code, error.header) == (400, "bad_draft", "x-meshnet-draft")


# -- properties -----------------------------------------------------------------------------------

drafts = st.lists(st.integers(0, ID), min_size=1, max_size=MAX_DRAFT).map(tuple)
afters = st.builds(AfterSpec, st.integers(0, 10**19 - 1), st.integers(0, 10**19 - 1))


@given(drafts)
def test_every_draft_round_trips(draft: tuple[int, ...]) -> None:
    value = ",".join(map(str, draft)).encode()
    assert parse_draft_value(value) == draft
    headers = WireHeaders(
        shape=(1, len(draft) + 1),
        dtype="int32",
        session=S,
        chunk_index=0,
        chunk_total=1,
        position=0,
        sample=SampleSpec(seed=1),
        draft=draft,
    )
    assert dict(headers.to_pairs())[b"X-Meshnet-Draft"] == value
    assert parse_wire_headers(headers.to_pairs()) == headers


@given(afters)
def test_every_after_round_trips(after: AfterSpec) -> None:
    assert parse_after_value(after.to_value()) == after
    headers = WireHeaders(
        shape=(1, 1),
        dtype="int32",
        session=S,
        chunk_index=0,
        chunk_total=1,
        position=after.position,
        after=after,
    )
    assert parse_wire_headers(headers.to_pairs()) == headers


@given(st.binary(max_size=800))
def test_any_bytes_as_a_draft_parse_or_are_400(value: bytes) -> None:
    try:
        draft = parse_draft_value(value)
    except ProtocolError as err:
        assert (err.status, err.code) == (400, ErrorCode.BAD_DRAFT)
        return
    assert 1 <= len(draft) <= MAX_DRAFT and all(0 <= i <= ID for i in draft)
    assert ",".join(map(str, draft)).encode() == value  # only the canonical spelling parses


@given(st.one_of(st.binary(max_size=80), st.from_regex(rb"position=[0-9]{1,20},epoch=.{0,21}")))
def test_any_bytes_as_an_after_parse_or_are_400(value: bytes) -> None:
    try:
        after = parse_after_value(value)
    except ProtocolError as err:
        assert (err.status, err.code) == (400, ErrorCode.BAD_AFTER)
        return
    assert after.to_value() == value


@given(st.binary(max_size=120), st.binary(max_size=60))
def test_any_bytes_in_both_headers_parse_or_are_400(draft: bytes, after: bytes) -> None:
    try:
        parse_wire_headers(pairs(draft=draft, after=after, shape=b"1,2"))
    except ProtocolError as err:
        assert err.status == 400
        assert err.code in (ErrorCode.BAD_DRAFT, ErrorCode.BAD_AFTER)


# -- hand-built headers ---------------------------------------------------------------------------


def test_hand_built_drafts_are_stored_as_a_tuple_of_ints() -> None:
    base = WireHeaders(shape=(1, 3), dtype="int32")
    assert base.replace(draft=[4, 5]).draft == (4, 5)
    assert WireHeaders(shape=(1, 3), dtype="int32", draft=(4, 5)).draft == (4, 5)
    kept = base.replace(draft=(4, 5))
    assert kept.replace(draft=(4, 5)) is kept  # no change, no copy


@pytest.mark.parametrize(
    "draft",
    [(), "12", b"12", 12, (True,), (1.0,), (-1,), (2**31,), tuple(range(MAX_DRAFT + 1)), [None]],
)
def test_hand_built_drafts_check_themselves(draft: Any) -> None:
    with pytest.raises(ValueError, match="draft"):
        WireHeaders(shape=(1, 3), dtype="int32", draft=draft)


@pytest.mark.parametrize("fields", [(-1, 0), (0, -1), (10**19, 0), (True, 0), (0, 1.0), ("1", 0)])
def test_hand_built_afters_check_themselves(fields: tuple[Any, Any]) -> None:
    with pytest.raises(ValueError):
        AfterSpec(*fields)


def test_hand_built_headers_take_only_an_after_spec() -> None:
    with pytest.raises(ValueError, match="after"):
        WireHeaders(shape=(1, 3), dtype="int32", after=(8, 0))  # type: ignore[arg-type]
    headers = WireHeaders(shape=(1, 3), dtype="int32", after=AfterSpec(8, 0))
    assert headers.replace(after=None).after is None


# -- X-Meshnet-Accepted: the answer's count (answer-only) -----------------------------------------

ANSWER = WireHeaders(
    shape=(1, 3), dtype="int32", session=S, chunk_index=0, chunk_total=1, position=8
)


def answer_pairs(*values: bytes) -> list[tuple[bytes, bytes]]:
    return ANSWER.to_pairs() + [(b"X-Meshnet-Accepted", value) for value in values]


def test_an_answer_carries_the_count_and_writes_it_canonically() -> None:
    answer = ANSWER.replace(accepted=2)
    assert dict(answer.to_pairs())[b"X-Meshnet-Accepted"] == b"2"
    assert parse_wire_headers(answer.to_pairs(), answer=True) == answer
    assert parse_wire_headers(ANSWER.to_pairs(), answer=True).accepted is None
    assert b"X-Meshnet-Accepted" not in dict(ANSWER.to_pairs())


@pytest.mark.parametrize("value", [b"", b"00", b"01", b"65", b"99", b"100", b"-1", b"+1", b" 1"])
def test_a_malformed_count_on_an_answer_is_400_bad_draft(value: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_wire_headers(answer_pairs(value), answer=True)
    assert (err.value.status, err.value.code) == (400, "bad_draft")
    assert err.value.header == "x-meshnet-accepted"


def test_an_answers_count_given_twice_is_a_duplicate_header() -> None:
    with pytest.raises(ProtocolError) as err:
        parse_wire_headers(answer_pairs(b"1", b"1"), answer=True)
    assert (err.value.code, err.value.header) == ("duplicate_header", "x-meshnet-accepted")


@pytest.mark.parametrize("values", [(b"3",), (b"junk",), (b"1", b"2")])
def test_a_request_s_count_is_ignored_as_an_unknown_header(values: tuple[bytes, ...]) -> None:
    """Answer-only: on a request neither its value, its form nor a repeat matters."""
    extra = tuple((b"x-meshnet-accepted", value) for value in values)
    headers = parse_wire_headers(pairs(shape=b"1,2", extra=extra))
    assert headers == parse_wire_headers(pairs(shape=b"1,2")) and headers.accepted is None
    gateway = parse_wire_headers(answer_pairs(*values), require_sequencing=False)
    assert gateway.accepted is None


def test_a_client_answers_a_bad_count_502_naming_it() -> None:
    """A bad answer header is the downstream's fault, as every other is."""
    client = ClientConnection(hop="http://last:1")
    client.send_activation(ANSWER.replace(shape=(1, 2), sample=SampleSpec(seed=1)), b"\0" * 8)
    head = b"".join(n + b": " + v + b"\r\n" for n, v in answer_pairs(b"65"))
    client.receive_data(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 12\r\n\r\n")
    with pytest.raises(DownstreamError) as err:
        client.next_event()
    assert (err.value.status, err.value.code) == (502, "downstream_bad_response")
    assert err.value.header == "x-meshnet-accepted"


def test_a_client_reads_the_count_of_an_answer() -> None:
    client = ClientConnection()
    client.send_activation(ANSWER.replace(sample=SampleSpec(seed=1), draft=(4, 5)), b"\0" * 12)
    head = b"".join(n + b": " + v + b"\r\n" for n, v in answer_pairs(b"1"))
    body = b"\4\0\0\0\7\0\0\0\2\0\0\0"
    client.receive_data(b"HTTP/1.1 200 OK\r\n" + head + b"content-length: 12\r\n\r\n" + body)
    event = client.next_event()
    assert event.headers.accepted == 1  # type: ignore[union-attr]


@given(st.integers(0, MAX_DRAFT))
def test_every_count_round_trips(count: int) -> None:
    answer = ANSWER.replace(accepted=count)
    assert dict(answer.to_pairs())[b"X-Meshnet-Accepted"] == str(count).encode()
    assert parse_wire_headers(answer.to_pairs(), answer=True) == answer
    assert parse_wire_headers(answer.to_pairs()) == ANSWER  # a request's: ignored


@given(st.one_of(st.binary(max_size=6), st.from_regex(rb"[0-9]{1,3}", fullmatch=True)))
def test_any_bytes_as_a_count_parse_or_are_400(value: bytes) -> None:
    try:
        count = parse_wire_headers(answer_pairs(value), answer=True).accepted
    except ProtocolError as err:
        assert (err.status, err.code) == (400, ErrorCode.BAD_DRAFT)
        return
    assert count is not None and 0 <= count <= MAX_DRAFT
    assert str(count).encode() == value  # only the canonical spelling parses


@pytest.mark.parametrize("count", [-1, MAX_DRAFT + 1, True, 1.0, "1", np.int64(1)])
def test_hand_built_counts_check_themselves(count: Any) -> None:
    with pytest.raises(ValueError, match="accepted"):
        WireHeaders(shape=(1, 3), dtype="int32", accepted=count)
    with pytest.raises(ValueError, match="accepted"):
        ANSWER.replace(accepted=count)
    assert ANSWER.replace(accepted=0).replace(accepted=None) == ANSWER
