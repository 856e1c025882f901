"""outgoing_changes (meshnet_node.outgoing): only what differs, as replacing all."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from meshnet_node.outgoing import outgoing_changes
from meshnet_proto import WireHeaders

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
KEY = "0123456789abcdef0123456789abcdef"
BLOCK = "ab" * 16

_REQUEST_ONLY: dict[str, Any] = {"session_key": None, "prefix": None, "prefix_blocks": ()}


@st.composite
def requests(draw: st.DrawFn) -> WireHeaders:
    optional = {
        "position": draw(st.none() | st.integers(0, 5000)),
        "deadline_ms": draw(st.none() | st.integers(0, 9)),
        "stage": draw(st.none() | st.just("m/0")),
        "session_key": draw(st.none() | st.just(KEY)),
        "prefix": draw(st.none() | st.just(BLOCK)),
        "prefix_blocks": draw(st.sampled_from([(), (BLOCK,)])),
    }
    return WireHeaders(
        shape=draw(st.sampled_from([(1, 1, 8), (1, 4, 8), (2, 8)])),
        dtype=draw(st.sampled_from(["bfloat16", "float32"])),
        encoding=draw(st.sampled_from(["identity", "zstd"])),
        session=SESSION,
        chunk_index=0,
        chunk_total=1,
        **optional,
    )


@settings(max_examples=300, deadline=None)
@given(
    requests(),
    st.sampled_from([(1, 1, 8), (1, 4, 16), (2, 8)]),
    st.sampled_from(["bfloat16", "float32", "float16"]),
    st.sampled_from(["identity", "zstd"]),
    st.integers(0, 5000),
    st.booleans(),
)
def test_the_same_headers_as_replacing_every_field(
    headers: WireHeaders,
    shape: tuple[int, ...],
    dtype: str,
    encoding: str,
    position: int,
    answer: bool,
) -> None:
    """What leaves the node is what replacing all the outgoing fields made;
    with nothing to change, the request's own headers (no copy)."""
    every: dict[str, Any] = {
        "shape": shape, "dtype": dtype, "encoding": encoding, "position": position,
        "deadline_ms": None, "stage": None, **(_REQUEST_ONLY if answer else {}),
    }  # fmt: skip
    changes = outgoing_changes(headers, shape, dtype, encoding, position, answer=answer)
    assert headers.replace(**changes) == headers.replace(**every)
    assert set(changes) <= set(every)
    if not changes:
        assert headers.replace(**changes) is headers


def test_a_decode_steps_answer_changes_nothing() -> None:
    request = WireHeaders(shape=(1, 1, 8), dtype="bfloat16", session=SESSION,
                          chunk_index=0, chunk_total=1, position=7)  # fmt: skip
    assert outgoing_changes(request, (1, 1, 8), "bfloat16", "identity", 7, answer=True) == {}
    went_down = outgoing_changes(request, (1, 1, 8), "bfloat16", "identity", 8, answer=False)
    assert went_down == {"position": 8}
