"""wire-2 §3.13 in the core: ``X-Meshnet-Sample``'s grammar, ranges and
round trip, through the public parse path and the hand-built headers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto import ErrorCode, ProtocolError, WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import MAX_SAMPLE_LOGPROBS, SampleSpec

S = "5b1e0c2a-1111-4abc-8def-000000000001"


def pairs(sample: bytes | None, shape: bytes = b"1,1,8") -> list[tuple[bytes, bytes]]:
    out = [
        (b"content-type", b"application/octet-stream"),
        (b"x-meshnet-shape", shape),
        (b"x-meshnet-dtype", b"float32"),
        (b"x-meshnet-session", S.encode()),
        (b"x-meshnet-chunk-index", b"0"),
        (b"x-meshnet-chunk-total", b"1"),
    ]
    if sample is not None:
        out.append((b"X-Meshnet-Sample", sample))
    return out


def test_absent_is_none_and_sends_nothing() -> None:
    headers = parse_wire_headers(pairs(None))
    assert headers.sample is None
    assert all(name != b"X-Meshnet-Sample" for name, _ in headers.to_pairs())


def test_every_parameter_parses() -> None:
    value = b"seed=42,temperature=0.7,top_p=0.9,top_k=40,min_p=0.05,logprobs=5"
    spec = parse_wire_headers(pairs(value)).sample
    assert spec == SampleSpec(seed=42, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, logprobs=5)
    assert spec is not None and not spec.greedy
    assert spec.to_value() == value


def test_defaults_and_the_greedy_case() -> None:
    spec = parse_wire_headers(pairs(b"seed=0")).sample
    assert spec == SampleSpec(seed=0)
    assert (spec.temperature, spec.top_p, spec.top_k, spec.min_p, spec.logprobs) == (
        1.0,
        1.0,
        0,
        0.0,
        None,
    )
    greedy = parse_wire_headers(pairs(b"temperature=0,seed=1,logprobs=0")).sample
    assert greedy is not None and greedy.greedy and greedy.logprobs == 0
    assert greedy.to_value() == b"seed=1,temperature=0.0,logprobs=0"
    # Rank 1 and rank 2 chunks may be sampled too (one sequence either way).
    assert parse_wire_headers(pairs(b"seed=3", shape=b"4")).sample == SampleSpec(seed=3)


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"temperature=0.5",  # no seed
        b"seed=1,seed=2",
        b"seed=1,beam=4",
        b"seed=01",
        b"seed=-1",
        b"seed=1e3",
        b"seed=10000000000000000000",  # 20 digits
        b"seed=1,temperature=nan",
        b"seed=1,temperature=inf",
        b"seed=1,temperature=1e999",
        b"seed=1,temperature=100.5",
        b"seed=1,temperature=-0.5",
        b"seed=1,top_p=0",
        b"seed=1,top_p=1.01",
        b"seed=1,top_k=2147483648",
        b"seed=1,top_k=1.5",
        b"seed=1,min_p=1.5",
        b"seed=1,logprobs=21",
        b"seed=1,,top_k=3",
        b"seed=1, top_k=3",
        b"SEED=1",
        b"seed=1,temperature=0.5.5",
        b"seed=1,top_p=" + b"9" * 40,
        b"seed=1," + b"top_k=1," * 40,  # too long before it is split
    ],
)
def test_malformed_values_are_400_bad_sample(value: bytes) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(value))
    error = caught.value
    assert (error.status, error.code, error.header) == (400, "bad_sample", "x-meshnet-sample")
    assert ErrorCode.BAD_SAMPLE.value == "bad_sample"


def test_a_batch_of_several_sequences_is_refused() -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(b"seed=1", shape=b"2,1,8"))
    assert caught.value.code == "bad_sample" and "batch 1" in str(caught.value)


def test_given_twice_is_a_duplicate_header() -> None:
    twice = [*pairs(b"seed=1"), (b"x-meshnet-sample", b"seed=2")]
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(twice)
    assert caught.value.code == "duplicate_header"


specs = st.builds(
    SampleSpec,
    seed=st.integers(0, 10**19 - 1),
    temperature=st.floats(0.0, 100.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(0, 2**31 - 1),
    min_p=st.floats(0.0, 1.0),
    logprobs=st.none() | st.integers(0, MAX_SAMPLE_LOGPROBS),
)


@given(specs)
def test_what_a_sender_writes_parses_back_to_the_same_spec(spec: SampleSpec) -> None:
    headers = WireHeaders(shape=(1, 1, 8), dtype="float32", sample=spec)
    parsed = parse_wire_headers(headers.to_pairs(), require_sequencing=False)
    assert parsed.sample == spec
    assert parsed.to_pairs() == headers.to_pairs()


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_are_400(value: bytes) -> None:
    try:
        spec = parse_wire_headers(pairs(value)).sample
    except ProtocolError as error:
        assert (error.status, error.code) in ((400, "bad_sample"), (400, "malformed_request"))
        return
    assert spec is not None and math.isfinite(spec.temperature)


@pytest.mark.parametrize(
    "fields",
    [
        dict(seed=-1),
        dict(seed=True),
        dict(seed=1.0),
        dict(seed=0, temperature=math.nan),
        dict(seed=0, temperature="1"),
        dict(seed=0, top_p=0.0),
        dict(seed=0, top_k=-1),
        dict(seed=0, min_p=2),
        dict(seed=0, logprobs=MAX_SAMPLE_LOGPROBS + 1),
    ],
)
def test_hand_built_specs_check_themselves(fields: dict) -> None:
    with pytest.raises(ValueError):
        SampleSpec(**fields)


def test_hand_built_headers_take_only_a_spec() -> None:
    with pytest.raises(ValueError, match="sample must be a SampleSpec"):
        WireHeaders(shape=(1, 8), dtype="float32", sample="seed=1")  # type: ignore[arg-type]
    plain = WireHeaders(shape=(1, 8), dtype="float32")
    sampled = plain.replace(sample=SampleSpec(seed=5, top_k=2))
    assert sampled.sample == SampleSpec(seed=5, top_k=2)
    assert dict(sampled.to_pairs())[b"X-Meshnet-Sample"] == b"seed=5,top_k=2"
    assert sampled.replace(sample=None) == plain
