"""The error hierarchy and the limits object: the shapes every driver relies on."""

from __future__ import annotations

import json

import pytest

from meshnet_proto import (
    CapacityError,
    DownstreamError,
    Limits,
    MeshnetError,
    ProtocolError,
    SequencingError,
)
from meshnet_proto._errors import error_body


@pytest.mark.parametrize(
    ("cls", "status"),
    [(ProtocolError, 400), (SequencingError, 409), (CapacityError, 503), (DownstreamError, 502)],
)
def test_each_error_family_has_its_default_status(cls: type[MeshnetError], status: int) -> None:
    err = cls("went wrong", code="some_code")
    assert err.status == status
    assert isinstance(err, MeshnetError)
    assert err.header is None and err.hop is None and err.retry_after is None


def test_error_body_is_the_spec_json_shape_with_a_lowercased_header() -> None:
    err = SequencingError(
        "session s: chunk 3 waited 10 s for chunk 2",
        code="chunk_wait_timeout",
        header="X-Meshnet-Chunk-Index",
    )
    document = json.loads(error_body(err))
    assert document == {
        "error": {
            "status": 409,
            "code": "chunk_wait_timeout",
            "message": "session s: chunk 3 waited 10 s for chunk 2",
            "header": "x-meshnet-chunk-index",
            "hop": None,
        }
    }


def test_explicit_status_hop_and_retry_after_are_kept() -> None:
    err = DownstreamError(
        "no answer", code="downstream_timeout", status=504, hop="http://n2:8002", retry_after=3
    )
    assert (err.status, err.hop, err.retry_after) == (504, "http://n2:8002", 3)
    assert "downstream_timeout" in repr(err) and "504" in repr(err)
    assert str(err) == "no answer"


def test_limits_defaults_are_the_spec_defaults() -> None:
    limits = Limits()
    assert limits.max_header_bytes == 16 * 1024
    assert limits.max_tensor_bytes == 512 * 1024 * 1024
    assert (limits.max_rank, limits.max_sessions, limits.reorder_window) == (8, 1024, 16)
    assert (limits.session_ttl, limits.reorder_timeout) == (600.0, 10.0)


@pytest.mark.parametrize(
    "changes",
    [
        {"max_tensor_bytes": 0},
        {"max_sessions": -1},
        {"reorder_window": True},
        {"max_header_bytes": 1.5},
        {"max_rank": 9},
        {"session_ttl": 0},
        {"reorder_timeout": -1.0},
        {"session_ttl": "10"},
    ],
)
def test_limits_reject_nonsense(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="Limits"):
        Limits(**changes)  # type: ignore[arg-type]


def test_limits_to_dict_names_every_limit() -> None:
    document = Limits(reorder_window=4).to_dict()
    assert document["reorder_window"] == 4
    assert set(document) == set(Limits.__dataclass_fields__)
