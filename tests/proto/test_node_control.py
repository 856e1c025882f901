"""NodeControl and its helpers: what a node answers beside its stage's output
(head checks beyond the table's, answer headers, the control endpoints)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from meshnet_proto import EndpointRequest, MeshnetError, Process, Replay, WireHeaders
from meshnet_proto.lowlevel import (
    AfterSpec,
    NodeControl,
    SampleSpec,
    StageIdentity,
    answer_headers,
    stub_identity,
)

SESSION = "5b1e0c2a-9f3d-4c1e-8a7b-0123456789ab"
KEY = "0123456789abcdef" * 2


def chunk(index: int = 0, position: int | None = 0, **fields: object) -> WireHeaders:
    return WireHeaders(
        shape=(1, 2, 4), dtype="float32", session=SESSION, chunk_index=index,
        chunk_total=1, position=position, **fields,
    )  # fmt: skip


def request(method: str, path: str, route: str, query: str = "", key: str = "") -> EndpointRequest:
    headers = ((b"x-meshnet-session-key", key.encode()),) if key else ()
    return EndpointRequest(
        method=method, path=path, query=query, headers=headers, body=b"", route=route
    )


def run(node: NodeControl, headers: WireHeaders, now: float = 0.0, *, drawn: bool = False) -> None:
    """One chunk through the table, answered with a one-token body."""
    decision = node.table.offer(headers, b"f" * 16 + bytes([now.__int__()]), now)
    assert isinstance(decision, Process)
    ticket = decision.ticket
    node.table.stage_done(ticket, None, now)
    answer = answer_headers(headers, (1, 1), "int32", "identity", ticket.position)
    node.answered(ticket, answer, np.array([[int(now)]], np.int32).tobytes(), now, drawn=drawn)


def error_of(call: object, *args: object) -> MeshnetError:
    with pytest.raises(MeshnetError) as caught:
        call(*args)  # type: ignore[operator]
    return caught.value


def test_the_identity_is_fingerprinted_and_checks_as_a_stage_identity() -> None:
    node = NodeControl({**stub_identity("echo"), "fingerprint": "stale"})
    identity = node.identity
    rest = {k: v for k, v in identity.items() if k != "fingerprint"}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    assert identity["fingerprint"] == hashlib.blake2b(canonical, digest_size=16).hexdigest()
    assert identity["model"] == "stub-echo" and identity["layers"] is None
    StageIdentity.from_json(identity)
    info = node.info()
    assert (info["role"], info["wire"], info["handoff"]) == ("node", 2, None)
    assert info["reorder_window"] == node.limits.reorder_window


def test_head_checks_a_spent_deadline_and_the_stage_before_the_table() -> None:
    stub = NodeControl(stub_identity("echo"))
    assert error_of(stub.check_head, chunk(deadline_ms=0), 0.0).status == 504
    err = error_of(stub.check_head, chunk(stage="m/0"), 0.0)
    assert (err.code, err.header) == ("stage_mismatch", "x-meshnet-stage")
    assert SESSION not in stub.table  # refused before anything changed
    layered = NodeControl({**stub_identity("x"), "model": "m", "layers": [4, 8]})
    layered.check_head(chunk(stage="m/4", deadline_ms=5), 0.0)
    assert error_of(layered.check_head, chunk(stage="m/0"), 0.0).code == "stage_mismatch"
    assert error_of(layered.check_head, chunk(position=3), 0.0).code == "session_unknown"


def test_answer_headers_drop_what_is_request_only_and_count_a_window() -> None:
    sample = SampleSpec(seed=1)
    sent = chunk(
        deadline_ms=9, stage="m/0", session_key=KEY, client="c" * 32, sample=sample, draft=(1, 2),
    )  # fmt: skip
    ids = answer_headers(sent, (1, 3), "int32", "zstd", 7)
    assert (ids.position, ids.accepted, ids.encoding, ids.shape) == (7, 2, "zstd", (1, 3))
    assert (ids.sample, ids.draft, ids.session_key, ids.client, ids.stage) == (None,) * 5
    assert answer_headers(sent, (2, 6), "float32", "identity", 0).accepted == 1  # logprobs rows
    assert answer_headers(sent, (1, 2, 8), "float32", "identity", 0).accepted is None
    assert answer_headers(chunk(draft=(1,)), (1, 2), "int32", "identity", 0).accepted is None


def test_endpoints_health_info_metrics() -> None:
    node = NodeControl(stub_identity("echo"))
    assert node.endpoint(request("GET", "/health", "/health"))[0] == 200
    status, headers, body = node.endpoint(request("GET", "/info", "/info"))
    assert status == 200 and json.loads(body)["identity"] == node.identity
    run(node, chunk())
    status, headers, body = node.endpoint(request("GET", "/metrics", "/metrics"))
    assert headers[0][1].startswith("text/plain")
    assert b"meshnet_sessions 1\n" in bytes(body) and b"meshnet_chunks_total 1\n" in bytes(body)


def test_delete_needs_the_owner_key_then_forgets_the_session() -> None:
    node = NodeControl(stub_identity("echo"))
    delete = f"/sessions/{SESSION}"
    assert error_of(node.endpoint, request("DELETE", delete, "/sessions/*")).status == 404
    run(node, chunk(session_key=KEY))
    assert error_of(node.endpoint, request("DELETE", delete, "/sessions/*")).status == 403
    assert node.endpoint(request("DELETE", delete, "/sessions/*", key=KEY)) == (204, [], b"")
    assert SESSION not in node.table


def test_kv_export_is_unsupported_for_a_held_session_and_404_otherwise() -> None:
    node = NodeControl(stub_identity("echo"))
    kv = request("GET", f"/kv/{SESSION}", "/kv/*")
    assert error_of(node.endpoint, kv).code == "not_found"
    run(node, chunk())
    assert error_of(node.endpoint, kv).code == "kv_unsupported"


def test_drawn_answers_the_owner_as_the_chunk_was_answered() -> None:
    node = NodeControl(stub_identity("echo"))
    path = f"/drawn/{SESSION}"

    def poll(query: str = "position=0", key: str = KEY) -> object:
        return node.endpoint(request("GET", path, "/drawn/*", query, key))

    assert error_of(poll, "position=01").code == "bad_request"
    assert error_of(poll).code == "not_found"  # no such session
    run(node, chunk(session_key=KEY, sample=SampleSpec(seed=1)), drawn=True)
    status, headers, body = poll()  # type: ignore[misc]
    assert status == 200 and ("X-Meshnet-Position", "0") in headers
    assert bytes(body) == np.array([[0]], np.int32).tobytes()  # the chunk's own answer
    assert error_of(poll, "position=0", "f" * 32).code == "session_forbidden"
    assert error_of(poll, "position=2").code == "not_found"  # not drawn there


def test_drawn_keeps_a_few_answers_and_a_rewind_replaces_its_line() -> None:
    node = NodeControl(stub_identity("echo"))
    for step in range(6):  # six sampled chunks of two tokens: positions 0, 2, ... 10
        run(node, chunk(position=2 * step), float(step), drawn=True)
    kept = node._drawn[SESSION]
    assert sorted(kept) == [4, 6, 8, 10]
    after = AfterSpec(position=12, epoch=1)  # back to 6 from the 12 the session holds
    decision = node.table.offer(chunk(position=6, after=after), b"r" * 17, 9.0)
    assert isinstance(decision, Process) and decision.ticket.rewind_from == 12
    node.table.stage_done(decision.ticket, None, 9.0)
    answer = answer_headers(chunk(), (1, 1), "int32", "identity", 6)
    node.answered(decision.ticket, answer, b"\0" * 4, 9.0, drawn=True)
    assert sorted(kept) == [4, 6]
    again = node.table.offer(chunk(position=6, after=after), b"r" * 17, 9.5)
    assert isinstance(again, Replay) and again.response == (answer, b"\0" * 4)
    node.table.end_session(SESSION)
    assert SESSION not in node._drawn  # its answers go with it
