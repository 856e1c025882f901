"""ClientSessionTable: the gateway's client sessions (wire-2 §3, "The gateway")."""

from __future__ import annotations

import uuid

import pytest

from meshnet_proto import CapacityError, ClientSessionTable, SequencingError
from meshnet_proto._client_sessions import Lease

C1 = "5b1e0c2a-1111-4abc-8def-000000000001"
C2 = "5b1e0c2a-2222-4abc-8def-000000000002"
C3 = "5b1e0c2a-3333-4abc-8def-000000000003"
# The clients' session key (wire-2 §3.9: a session continues only with its key).
K = "ab" * 16


def test_minted_sessions_are_canonical_uuid4() -> None:
    table = ClientSessionTable(4, 60.0)
    lease = table.begin(None, 0.0, entropy=bytes(range(16)))
    assert isinstance(lease, Lease)
    assert lease.session == str(uuid.UUID(bytes=bytes(range(16)), version=4))
    assert lease.session == lease.session.lower() and len(lease.session) == 36
    assert uuid.UUID(lease.session).version == 4
    assert (lease.position, lease.minted) == (0, True)
    other = table.begin(None, 0.0)  # from uuid.uuid4()
    assert uuid.UUID(other.session).version == 4 and other.session != lease.session
    assert len(table) == 2 and lease.session in table
    with pytest.raises(ValueError):
        table.begin(None, 0.0, entropy=b"short")


def test_commit_advances_the_position_and_frees_the_session() -> None:
    table = ClientSessionTable(4, 60.0)
    lease = table.begin(C1, 0.0, key=K)
    assert (lease.session, lease.position, lease.minted) == (C1, 0, False)
    with pytest.raises(SequencingError) as err:
        table.begin(C1, 1.0, key=K)
    assert (err.value.status, err.value.code, err.value.header) == (
        409,
        "session_busy",
        "x-meshnet-session",
    )
    lease.commit(300, now=2.0)
    assert table.position(C1) == 300
    nxt = table.begin(C1, 3.0, key=K)
    assert nxt.position == 300
    nxt.commit(0)  # a request that sent nothing
    assert table.position(C1) == 300
    assert "committed" in repr(nxt)


def test_a_lease_ends_once() -> None:
    table = ClientSessionTable(4, 60.0)
    lease = table.begin(C1, 0.0, key=K)
    lease.commit(1)
    with pytest.raises(RuntimeError):
        lease.commit(1)
    with pytest.raises(RuntimeError):
        lease.abort()
    with pytest.raises(ValueError):
        table.begin(C1, 0.0, key=K).commit(-1)


@pytest.mark.parametrize("tokens", [-1, 1.5, True, "3"])
def test_commit_wants_a_token_count(tokens: object) -> None:
    lease = ClientSessionTable(4, 60.0).begin(C1, 0.0, key=K)
    with pytest.raises(ValueError):
        lease.commit(tokens)  # type: ignore[arg-type]


def test_abort_forgets_the_session() -> None:
    table = ClientSessionTable(4, 60.0)
    table.begin(C1, 0.0, key=K).commit(10)
    lease = table.begin(C1, 1.0, key=K)
    lease.abort()
    assert C1 not in table and table.position(C1) is None
    # The client's next request with the same id starts again at 0.
    assert table.begin(C1, 2.0, key=K).position == 0


def test_end_while_a_request_runs_is_not_undone_by_its_commit() -> None:
    table = ClientSessionTable(4, 60.0)
    lease = table.begin(C1, 0.0, key=K)
    assert table.end(C1) is True
    assert table.end(C1) is False
    lease.commit(5)
    assert C1 not in table
    again = table.begin(C1, 1.0, key=K)
    stale = again
    table.end(C1)
    fresh = table.begin(C1, 2.0, key=K)
    stale.abort()  # must not forget the new session
    assert C1 in table
    fresh.commit(1)
    assert table.position(C1) == 1


def test_full_table_answers_503_until_a_session_expires() -> None:
    table = ClientSessionTable(2, 100.0)
    table.begin(C1, 0.0, key=K).commit(1)
    busy = table.begin(C2, 30.0, key=K)
    with pytest.raises(CapacityError) as err:
        table.begin(C3, 50.0, key=K)
    # C1 expires at 100 (50 s from now); a busy session counts as just used.
    assert (err.value.status, err.value.code, err.value.retry_after) == (503, "sessions_full", 50)
    with pytest.raises(CapacityError) as err:
        table.begin(None, 99.9999)
    assert err.value.retry_after == 1
    # C1 idle past the TTL: beginning a new session expires it.
    c3 = table.begin(C3, 100.5, key=K)
    assert C1 not in table and C2 in table
    # Sessions in use never expire; once committed, they do.
    assert table.expire(1000.0) == []
    busy.commit(1, now=1000.0)
    c3.commit(1)  # idle since it began at 100.5
    assert table.expire(1000.0) == [C3]
    assert table.expire(1100.5) == [C2]
    assert len(table) == 0


def test_expire_returns_what_it_forgot() -> None:
    table = ClientSessionTable(4, 10.0)
    table.begin(C1, 0.0, key=K).commit(1)
    table.begin(C2, 5.0, key=K).commit(1)
    assert table.expire(10.0) == []
    assert table.expire(10.5) == [C1]
    assert table.expire(15.5) == [C2]


@pytest.mark.parametrize(
    ("max_sessions", "ttl"),
    [(0, 1.0), (True, 1.0), (1.5, 1.0), (1, 0), (1, -1.0), (1, True), (1, "1")],
)
def test_constructor_validates(max_sessions: object, ttl: object) -> None:
    with pytest.raises(ValueError):
        ClientSessionTable(max_sessions, ttl)  # type: ignore[arg-type]
