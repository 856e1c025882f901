"""X-Meshnet-Client and X-Meshnet-Cache-Salt (wire-2 §3.15), and salted
prefix block keys (§3.10), through the core's public API."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto import ProtocolError, WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, prefix_block_keys

BASE = [
    (b"Content-Type", b"application/octet-stream"),
    (b"X-Meshnet-Wire", b"2"),
    (b"X-Meshnet-Shape", b"1,3"),
    (b"X-Meshnet-Dtype", b"int32"),
    (b"X-Meshnet-Session", b"3f2c8a9e-1b4d-4c6e-9a7f-0d1e2f3a4b5c"),
    (b"X-Meshnet-Chunk-Index", b"0"),
    (b"X-Meshnet-Chunk-Total", b"1"),
]
CLIENT = "0123456789abcdef" * 2
SALT = "fedcba9876543210" * 2


def test_both_headers_parse_and_round_trip() -> None:
    pairs = [
        *BASE,
        (b"X-Meshnet-Client", CLIENT.encode()),
        (b"x-meshnet-cache-salt", SALT.encode()),
    ]
    headers = parse_wire_headers(pairs)
    assert (headers.client, headers.cache_salt) == (CLIENT, SALT)
    again = parse_wire_headers(headers.to_pairs())
    assert again == headers
    plain = parse_wire_headers(BASE)
    assert plain.client is None and plain.cache_salt is None
    assert not any(b"client" in name.lower() for name, _ in plain.to_pairs())
    only_salt = headers.replace(client=None)
    assert parse_wire_headers(only_salt.to_pairs()).cache_salt == SALT
    only_client = headers.replace(cache_salt=None)
    assert parse_wire_headers(only_client.to_pairs()).client == CLIENT


@pytest.mark.parametrize(
    ("header", "value", "code"),
    [
        (b"X-Meshnet-Client", b"ABCDEF0123456789" * 2, "bad_session"),
        (b"X-Meshnet-Client", b"0123", "bad_session"),
        (b"X-Meshnet-Client", b"", "bad_session"),
        (b"X-Meshnet-Cache-Salt", b"0" * 33, "bad_prefix"),
        (b"X-Meshnet-Cache-Salt", b"g" * 32, "bad_prefix"),
    ],
)
def test_a_malformed_value_is_400_naming_its_header(header: bytes, value: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers([*BASE, (header, value)])
    assert (caught.value.status, caught.value.code) == (400, code)
    assert caught.value.header == header.decode().lower()


def test_given_twice_is_a_duplicate() -> None:
    pairs = [*BASE, (b"X-Meshnet-Client", CLIENT.encode()), (b"X-Meshnet-Client", CLIENT.encode())]
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs)
    assert caught.value.code == "duplicate_header"


@pytest.mark.parametrize("field", ["client", "cache_salt"])
@pytest.mark.parametrize("value", ["ABC", "0" * 31, 7, b"0" * 32, "é" * 32])
def test_hand_built_headers_check_both_fields(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        WireHeaders(shape=(1, 3), dtype="int32", **{field: value})


def test_salted_keys_are_unrelated_to_unsalted_and_other_salts() -> None:
    ids = list(range(2 * PREFIX_BLOCK_TOKENS + 5))
    plain = prefix_block_keys(ids)
    salted = prefix_block_keys(ids, salt=SALT)
    other = prefix_block_keys(ids, salt=CLIENT)
    assert len(plain) == len(salted) == len(other) == 2
    assert not set(plain) & set(salted) and not set(salted) & set(other)
    # block 0 is BLAKE2b keyed by the salt; the next chains as always
    block0 = np.asarray(ids[:32], "<i4").tobytes()
    assert salted[0] == hashlib.blake2b(block0, digest_size=16, key=bytes.fromhex(SALT)).hexdigest()
    assert prefix_block_keys(ids[32:64], salted[0]) == salted[1:]
    # a salt does nothing after block 0: the chain already carries it
    assert prefix_block_keys(ids[32:64], salted[0], salt=CLIENT) == salted[1:]


@given(
    st.lists(st.integers(0, 2**31 - 1), min_size=32, max_size=96),
    st.binary(min_size=16, max_size=16),
)
def test_a_salted_chain_extends_piece_by_piece(ids: list[int], salt: bytes) -> None:
    whole = prefix_block_keys(ids, salt=salt.hex())
    first = prefix_block_keys(ids[:32], salt=salt.hex())
    assert whole[:1] == first
    assert prefix_block_keys(ids[32:], first[0]) == whole[1:]
