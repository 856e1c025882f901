"""wire-2 §3.9 in the core: session keys, replays of live sessions, required
positions and the per-client quota (SessionTable, ClientSessionTable, headers)."""

from __future__ import annotations

import pytest

from meshnet_proto import (
    CapacityError,
    ClientSessionTable,
    Limits,
    ProtocolError,
    SequencingError,
    SessionTable,
    WireHeaders,
)
from meshnet_proto._headers import is_session_key, parse_session_key, parse_wire_headers

S1 = "5b1e0c2a-1111-4abc-8def-000000000001"
S2 = "5b1e0c2a-2222-4abc-8def-000000000002"
K1 = "0123456789abcdef" * 2
K2 = "fedcba9876543210" * 2
FP = b"f" * 16


def hdr(index: int = 0, *, total: int = 2, position: int | None = 0, key: str | None = None,
        session: str = S1) -> WireHeaders:  # fmt: skip
    return WireHeaders(shape=(1, 2, 4), dtype="float32", session=session, chunk_index=index,
                       chunk_total=total, position=position, session_key=key)  # fmt: skip


def start(table: SessionTable, *, key: str | None = None, session: str = S1,
          client: str | None = None, now: float = 0.0) -> None:  # fmt: skip
    decision = table.offer(hdr(key=key, session=session), FP, now, client=client)
    ticket = decision.ticket  # type: ignore[union-attr]
    table.stage_done(ticket, "out", now)
    table.response_ready(ticket, "resp", now)


def refused(call, *args, **kw):  # type: ignore[no-untyped-def]
    with pytest.raises((ProtocolError, SequencingError, CapacityError)) as err:
        call(*args, **kw)
    return err.value.status, err.value.code, err.value.header


# -- headers ---------------------------------------------------------------------------


def pairs(**extra: bytes) -> list[tuple[bytes, bytes]]:
    base = [(b"content-type", b"application/octet-stream"), (b"x-meshnet-shape", b"1,2"),
            (b"x-meshnet-dtype", b"int32"), (b"x-meshnet-session", S1.encode()),
            (b"x-meshnet-chunk-index", b"0"), (b"x-meshnet-chunk-total", b"1")]  # fmt: skip
    return base + [(name.replace("_", "-").encode(), value) for name, value in extra.items()]


def test_the_session_key_is_parsed_and_sent() -> None:
    h = parse_wire_headers(pairs(x_meshnet_session_key=K1.encode()))
    assert h.session_key == K1
    assert (b"X-Meshnet-Session-Key", K1.encode()) in h.to_pairs()
    assert parse_wire_headers(pairs()).session_key is None
    assert not any(n == b"X-Meshnet-Session-Key" for n, _ in hdr().to_pairs())


@pytest.mark.parametrize("bad", [K1.upper().encode(), K1[:-1].encode(), (K1 + "0").encode(),
                                 b"", b"g" * 32, "é".encode() * 16])  # fmt: skip
def test_a_bad_session_key_is_400_and_not_quoted(bad: bytes) -> None:
    with pytest.raises(ProtocolError) as err:
        parse_wire_headers(pairs(x_meshnet_session_key=bad))
    assert (err.value.status, err.value.code) == (400, "bad_session_key")
    assert err.value.header == "x-meshnet-session-key"
    assert not bad or bad.decode(errors="replace") not in err.value.message
    with pytest.raises(ProtocolError) as err:
        parse_session_key([(b"X-Meshnet-Session-Key", bad)])
    assert err.value.code == "bad_session_key"


def test_a_duplicated_session_key_is_400() -> None:
    two = pairs() + [(b"x-meshnet-session-key", K1.encode())] * 2
    with pytest.raises(ProtocolError) as err:
        parse_wire_headers(two)
    assert (err.value.code, err.value.header) == ("duplicate_header", "x-meshnet-session-key")
    with pytest.raises(ProtocolError) as err:
        parse_session_key([("x-meshnet-session-key", K1), (b"X-MESHNET-SESSION-KEY", K1)])
    assert err.value.code == "duplicate_header"
    assert parse_session_key([(b"x-other", b"1")]) is None
    assert parse_session_key([(b"x-meshnet-session-key", K1.encode())]) == K1


def test_hand_built_headers_check_the_key() -> None:
    assert is_session_key(K1) and not is_session_key(K1.upper()) and not is_session_key(1)
    assert not is_session_key("é" * 32)
    with pytest.raises(ValueError):
        hdr(key="nope")


# -- ownership -------------------------------------------------------------------------------


@pytest.mark.parametrize(("bound", "sent"), [(K1, None), (K1, K2), (None, K1)])
def test_a_key_mismatch_is_403_on_head_and_offer(bound: str | None, sent: str | None) -> None:
    table = SessionTable()
    start(table, key=bound)
    for call, args in ((table.check_head, (hdr(1, position=2, key=sent), 1.0)),
                       (table.offer, (hdr(1, position=2, key=sent), FP, 1.0))):  # fmt: skip
        status, code, header = refused(call, *args)
        assert (status, code, header) == (403, "session_forbidden", "x-meshnet-session-key")
    assert refused(table.check_owner, S1, sent)[:2] == (403, "session_forbidden")
    # The owner goes on as if nothing happened.
    table.check_owner(S1, bound)
    table.check_owner(S2, None)  # not held here: nothing to refuse
    assert table.position(S1) == 2
    table.check_head(hdr(1, position=2, key=bound), 1.0)


def test_the_403_message_never_shows_a_key() -> None:
    table = SessionTable()
    start(table, key=K1)
    with pytest.raises(ProtocolError) as err:
        table.offer(hdr(1, position=2, key=K2), FP, 1.0)
    assert K1 not in err.value.message and K2 not in err.value.message


def test_a_replay_cannot_restart_a_live_session() -> None:
    table = SessionTable()
    start(table, key=K1)
    for position in (0, None):
        h = hdr(0, position=position, key=K1)
        assert refused(table.check_head, h, 1.0, replay=True) == (
            409,
            "session_exists",
            "x-meshnet-session",
        )
        assert refused(table.offer, h, FP, 1.0, replay=True)[1] == "session_exists"
    # A stranger's replay is refused for the key first.
    assert refused(table.offer, hdr(0), FP, 1.0, replay=True)[:2] == (403, "session_forbidden")
    # After a DELETE the replay rebuilds it, bound to the key it carries.
    assert table.end_session(S1)
    table.check_head(hdr(0, key=K2), 2.0, replay=True)
    start(table, key=K2, now=2.0)
    table.check_owner(S1, K2)
    # A replay's later chunks are ordinary chunks of the session it built.
    assert table.offer(hdr(1, position=2, key=K2), FP, 3.0, replay=True) is not None


# -- the per-client quota --------------------------------------------------------------------


def test_max_sessions_per_client_follows_max_sessions() -> None:
    assert Limits().max_sessions_per_client == 512
    assert Limits(max_sessions=9).max_sessions_per_client == 4
    assert Limits(max_sessions=9, max_sessions_per_client=0).max_sessions_per_client == 0
    assert Limits().to_dict()["max_sessions_per_client"] == 512
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError):
            Limits(max_sessions_per_client=bad)  # type: ignore[arg-type]


def sid(n: int) -> str:
    return f"5b1e0c2a-0000-4abc-8def-{n:012x}"


def test_one_client_cannot_fill_the_table() -> None:
    table = SessionTable(Limits(max_sessions=8, session_ttl=100.0))
    for n in range(4):
        start(table, session=sid(n), client="10.0.0.1", now=float(n))
    h = hdr(session=sid(9))
    for call, args in ((table.check_head, (h, 10.0)), (table.offer, (h, FP, 10.0))):
        with pytest.raises(CapacityError) as err:
            call(*args, client="10.0.0.1")
        assert (err.value.status, err.value.code) == (429, "client_sessions_full")
        assert err.value.retry_after == 90  # the client's soonest idle expiry
    assert sid(9) not in table
    # Another client, and a driver that names none, still get sessions.
    start(table, session=sid(10), client="10.0.0.2", now=10.0)
    start(table, session=sid(11), now=10.0)
    # The client's own idle sessions past the TTL make room for it.
    start(table, session=sid(12), client="10.0.0.1", now=100.5)
    assert sid(0) not in table and sid(12) in table
    # Ending its sessions gives the room back.
    for n in (1, 2, 3, 12):
        table.end_session(sid(n))
    start(table, session=sid(13), client="10.0.0.1", now=101.0)


def test_a_busy_clients_retry_after_counts_the_ttl() -> None:
    table = SessionTable(Limits(max_sessions=2, session_ttl=50.0))
    busy = table.offer(hdr(session=sid(1)), FP, 0.0, client="a")
    assert busy is not None
    with pytest.raises(CapacityError) as err:
        table.offer(hdr(session=sid(2)), FP, 60.0, client="a")
    assert (err.value.code, err.value.retry_after) == ("client_sessions_full", 50)
    off = SessionTable(Limits(max_sessions=2, max_sessions_per_client=0))
    start(off, session=sid(1), client="a")
    start(off, session=sid(2), client="a")


# -- the gateway's client sessions -----------------------------------------------------------


def test_a_gateway_session_is_bound_to_the_clients_key_or_a_minted_one() -> None:
    table = ClientSessionTable(8, 60.0)
    lease = table.begin(None, 0.0, key_entropy=bytes(range(32)))
    assert lease.key == bytes(range(16)).hex() and lease.key_minted
    assert lease.node_key == bytes(range(16, 32)).hex()
    lease.commit(3)
    again = table.begin(lease.session, 1.0, key=lease.key)
    assert (again.key_minted, again.node_key) == (False, lease.node_key)
    again.commit(1)
    for wrong in (None, K2):
        with pytest.raises(ProtocolError) as err:
            table.begin(lease.session, 2.0, key=wrong)
        assert (err.value.status, err.value.code) == (403, "session_forbidden")
        with pytest.raises(ProtocolError):
            table.check_owner(lease.session, wrong)
    table.check_owner(lease.session, lease.key)
    table.check_owner(S2, None)
    assert table.node_key(lease.session) == lease.node_key and table.node_key(S2) is None
    # A client's own key binds its session; it is not sent back.
    own = table.begin(S1, 0.0, key=K1)
    assert (own.key, own.key_minted) == (K1, False) and own.node_key != K1
    own.commit(0)
    with pytest.raises(ValueError):
        table.begin(None, 0.0, key_entropy=b"short")
    assert is_session_key(table.begin(None, 0.0).node_key)


def test_the_gateway_has_the_per_client_quota_too() -> None:
    table = ClientSessionTable(4, 60.0)
    assert table.max_per_client == 2
    for _ in range(2):
        table.begin(None, 0.0, client="a").commit(1)
    with pytest.raises(CapacityError) as err:
        table.begin(None, 1.0, client="a")
    assert (err.value.status, err.value.code, err.value.retry_after) == (
        429,
        "client_sessions_full",
        59,
    )
    table.begin(None, 1.0, client="b").commit(1)
    table.begin(None, 1.0).commit(1)
    # Expired, aborted or ended sessions give the room back.
    assert len(table.expire(70.0)) == 4
    busy = table.begin(None, 70.0, client="a")
    other = table.begin(None, 70.0, client="a")
    with pytest.raises(CapacityError) as err:
        table.begin(None, 71.0, client="a")
    assert err.value.retry_after == 60  # busy: a whole TTL
    busy.abort()
    table.begin(None, 71.0, client="a").commit(0)
    table.end(other.session)
    other.commit(0)
    table.begin(None, 71.0, client="a").commit(0)
    # Its own sessions past their TTL make room without an explicit expire.
    assert table.begin(None, 200.0, client="a").position == 0
    off = ClientSessionTable(4, 60.0, max_per_client=0)
    for _ in range(4):
        off.begin(None, 0.0, client="a").commit(0)
    with pytest.raises(ValueError):
        ClientSessionTable(4, 60.0, max_per_client=-1)
