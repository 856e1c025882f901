"""wire-2 §3.10 in the core: the block keys' hash chain, the two headers'
grammar and counts, and a session that starts after a cached prefix."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshnet_proto import ProtocolError, SequencingError, SessionTable, WireHeaders
from meshnet_proto._headers import parse_wire_headers
from meshnet_proto.lowlevel import PREFIX_BLOCK_TOKENS, blocks_ending_in, prefix_block_keys

S = "5b1e0c2a-1111-4abc-8def-000000000001"
K = "0123456789abcdef0123456789abcdef"


def pairs(shape: str = "1,40", position: str | None = "32", index: str = "0",
          **extra: bytes) -> list[tuple[bytes, bytes]]:  # fmt: skip
    out = [
        (b"content-type", b"application/octet-stream"),
        (b"x-meshnet-shape", shape.encode()),
        (b"x-meshnet-dtype", b"int32"),
        (b"x-meshnet-session", S.encode()),
        (b"x-meshnet-chunk-index", index.encode()),
        (b"x-meshnet-chunk-total", b"2"),
    ]
    if position is not None:
        out.append((b"x-meshnet-position", position.encode()))
    out += [
        (f"x-meshnet-{name.replace('_', '-')}".encode(), value) for name, value in extra.items()
    ]
    return out


def test_the_key_chain_is_blake2b_over_the_previous_key_and_the_ids() -> None:
    ids = np.arange(70, dtype=np.int32)
    first = hashlib.blake2b(ids[:32].astype("<i4").tobytes(), digest_size=16).digest()
    second = hashlib.blake2b(first + ids[32:64].astype("<i4").tobytes(), digest_size=16)
    assert prefix_block_keys(ids) == [first.hex(), second.hexdigest()]  # the partial block: none
    assert prefix_block_keys(ids[32:64], previous=first.hex()) == [second.hexdigest()]
    assert prefix_block_keys([]) == [] and PREFIX_BLOCK_TOKENS == 32


@given(st.lists(st.integers(0, 2**31 - 1), max_size=200), st.integers(0, 200))
def test_keys_chain_across_any_split(ids: list[int], cut: int) -> None:
    """A sender's keys do not depend on how its tokens were chunked."""
    whole = prefix_block_keys(ids)
    cut = min(cut, len(ids)) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    head = prefix_block_keys(ids[:cut])
    tail = prefix_block_keys(ids[cut:], head[-1] if head else None)
    assert head + tail == whole
    assert blocks_ending_in(0, len(ids)) == len(whole)


def test_both_headers_parse_and_go_out_again() -> None:
    keys = prefix_block_keys(range(64))
    h = parse_wire_headers(pairs(prefix=keys[0].encode(), prefix_blocks=keys[1].encode()))
    assert (h.prefix, h.prefix_blocks, h.starts_session) == (keys[0], (keys[1],), True)
    out = dict(h.to_pairs())
    assert out[b"X-Meshnet-Prefix"] == keys[0].encode()
    assert out[b"X-Meshnet-Prefix-Blocks"] == keys[1].encode()
    plain = parse_wire_headers(pairs())
    assert (plain.prefix, plain.prefix_blocks) == (None, ())
    assert b"X-Meshnet-Prefix" not in dict(plain.to_pairs())
    # Blocks alone (a chunk of a session that files as it goes): rank 1 too.
    two = ",".join(prefix_block_keys(range(64))).encode()
    assert parse_wire_headers(pairs("64", None, prefix_blocks=two)).prefix_blocks == tuple(
        prefix_block_keys(range(64)))  # fmt: skip


@pytest.mark.parametrize(
    ("case", "header"),
    [
        (dict(shape="2,40", prefix=K.encode()), "x-meshnet-prefix"),
        (dict(shape="2,40", prefix_blocks=K.encode()), "x-meshnet-prefix-blocks"),
        (dict(prefix=b"XYZ"), "x-meshnet-prefix"),
        (dict(prefix=K.encode(), index="1"), "x-meshnet-prefix"),
        (dict(prefix=K.encode(), position="33"), "x-meshnet-prefix"),
        (dict(prefix=K.encode(), position=None), "x-meshnet-prefix"),
        (dict(prefix_blocks=b""), "x-meshnet-prefix-blocks"),
        (dict(prefix_blocks=(K + "," + K).encode()), "x-meshnet-prefix-blocks"),  # 1 ends here
        (dict(prefix_blocks=(K + ",").encode()), "x-meshnet-prefix-blocks"),
    ],
)
def test_malformed_prefix_headers_are_400_bad_prefix(case: dict, header: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_wire_headers(pairs(**case))
    assert (caught.value.status, caught.value.code, caught.value.header) == (400, "bad_prefix",
                                                                              header)  # fmt: skip


def test_hand_built_headers_check_their_keys() -> None:
    WireHeaders(shape=(1, 4), dtype="int32", prefix=K, prefix_blocks=(K,))
    for bad in (dict(prefix="nope"), dict(prefix_blocks=[K]), dict(prefix_blocks=("x",)),
                dict(prefix=7)):  # fmt: skip
        with pytest.raises(ValueError):
            WireHeaders(shape=(1, 4), dtype="int32", **bad)


def test_a_new_session_starts_after_the_prefix_it_names() -> None:
    table = SessionTable()
    start = WireHeaders(shape=(1, 8), dtype="int32", session=S, chunk_index=0, chunk_total=1,
                        position=64, prefix=K)  # fmt: skip
    table.check_head(start, 0.0)
    decision = table.offer(start, b"f" * 16, 0.0)
    assert decision.ticket.position == 64 and table.position(S) == 64
    table.stage_done(decision.ticket, None, 0.0)
    assert table.position(S) == 72
    # Without the prefix, chunk 0 at a position is still the unknown session's 409.
    other = start.replace(session="5b1e0c2a-2222-4abc-8def-000000000002", prefix=None)
    with pytest.raises(SequencingError) as caught:
        table.offer(other, b"g" * 16, 0.0)
    assert caught.value.code == "session_unknown"


def test_each_header_alone() -> None:
    only_prefix = parse_wire_headers(pairs("1,16", prefix=K.encode()))  # no block ends: 32..47
    assert (only_prefix.prefix, only_prefix.prefix_blocks) == (K, ())
    assert [n for n, _ in only_prefix.to_pairs() if n.startswith(b"X-Meshnet-Prefix")] == [
        b"X-Meshnet-Prefix"
    ]
    only_blocks = WireHeaders(shape=(1, 32), dtype="int32", prefix_blocks=(K,))
    assert [n for n, _ in only_blocks.to_pairs() if n.startswith(b"X-Meshnet-Prefix")] == [
        b"X-Meshnet-Prefix-Blocks"
    ]
