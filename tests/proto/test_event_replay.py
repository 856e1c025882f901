"""``replay`` on the server's events: read once from the request target's
query by the core (wire-2 §3.8), so no driver parses the query again."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshnet_proto import ActivationHead, ActivationReceived, EndpointRequest, WireHeaders

HEADERS = WireHeaders(shape=(1, 2), dtype="float32")

QUERIES = [
    ("", False),
    ("replay=1", True),
    ("a=b&replay=1", True),
    ("replay=1&deep=1", True),
    ("replay=0", False),
    ("replay=10", False),
    ("xreplay=1", False),
    ("replay=1x", False),
    ("deep=1", False),
]


@pytest.mark.parametrize(("query", "replay"), QUERIES)
def test_a_head_reads_replay_from_its_query(query: str, replay: bool) -> None:
    head = ActivationHead(headers=HEADERS, expects_continue=False, query=query)
    assert head.replay is replay


@pytest.mark.parametrize(("query", "replay"), QUERIES)
def test_a_received_activation_reads_replay_from_its_query(query: str, replay: bool) -> None:
    tensor = np.zeros((1, 2), np.float32)
    event = ActivationReceived(headers=HEADERS, tensor=tensor, body_nbytes=8, query=query)
    assert event.replay is replay


@pytest.mark.parametrize(("query", "replay"), QUERIES)
def test_an_endpoint_request_reads_replay_from_its_query(query: str, replay: bool) -> None:
    event = EndpointRequest(method="DELETE", path="/sessions/s", query=query, headers=(), body=b"")
    assert event.replay is replay


def test_replay_is_computed_not_passed() -> None:
    with pytest.raises(TypeError):
        ActivationHead(headers=HEADERS, expects_continue=False, replay=True)  # type: ignore[call-arg]
    head = ActivationHead(headers=HEADERS, expects_continue=False)
    # A copy with another query computes it again.
    assert dataclasses.replace(head, query="replay=1").replay is True
    assert head.replay is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        head.replay = True  # type: ignore[misc]


def test_a_query_that_is_not_text_is_refused_by_either_activation_event() -> None:
    with pytest.raises(TypeError, match="query must be a str"):
        ActivationHead(headers=HEADERS, expects_continue=False, query=b"replay=1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="query must be a str"):
        ActivationReceived(headers=HEADERS, tensor=np.zeros((1, 2), np.float32), body_nbytes=8,
                           query=None)  # type: ignore[arg-type]  # fmt: skip
