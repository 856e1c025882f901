"""A replica set's decisions without a network (meshnet_runtime.replicas.placement).

Records only: no pools, no sockets, no event loop; time is a fake clock
passed in. What docs/failover.md promises of choice, health, retirement
and pinning, checked one rule at a time."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshnet_proto import WireHeaders
from meshnet_runtime.endpoints import parse_endpoint
from meshnet_runtime.replicas import placement as placement_module
from meshnet_runtime.replicas.placement import (
    MAX_BACKOFF,
    Placement,
    ReplicaState,
    Route,
    address_url,
    needs_replica_set,
)

SESSION = "00000000-0000-4000-8000-000000000001"


@dataclass
class FakeClock:
    now: float = 1000.0

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def hop(*urls: str, interval: float = 1.0) -> tuple[Placement[ReplicaState], list[ReplicaState]]:
    placement: Placement[ReplicaState] = Placement(interval)
    replicas = [placement.add(ReplicaState(url=u, source=u)) for u in urls]
    return placement, replicas


def stick(placement: Placement[ReplicaState], replica: ReplicaState, n: int) -> None:
    for i in range(n):
        placement.sticky[f"{replica.url}-{i}"] = replica


def test_backoff_doubles_from_the_interval_up_to_its_cap() -> None:
    clock = FakeClock()
    placement, (a,) = hop("http://10.0.0.1:1", interval=1.0)
    waits = []
    for _ in range(8):
        placement.mark_down(a, clock.now)
        waits.append(a.next_probe - clock.now)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    assert not a.up and a.failures == 8
    # Not probed before its backoff ends, probed from then on.
    assert placement.due(clock.advance(MAX_BACKOFF - 0.5)) == []
    assert placement.due(clock.advance(0.5)) == [a]
    placement.back_up(a)
    assert a.up and a.failures == 0
    placement.mark_down(a, clock.now)  # down again: the backoff starts over
    assert a.next_probe - clock.now == 1.0


def test_up_replicas_are_probed_every_round() -> None:
    clock = FakeClock()
    placement, (a, b) = hop("http://10.0.0.1:1", "http://10.0.0.2:1", interval=2.0)
    placement.mark_down(b, clock.now)
    assert placement.due(clock.now) == [a]
    assert placement.due(clock.advance(2.0)) == [a, b]


def test_ranking_fewest_in_flight_then_fewest_sessions() -> None:
    placement, (a, b, c) = hop("http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1")
    a.inflight, b.inflight, c.inflight = 2, 1, 1
    stick(placement, b, 3)
    stick(placement, c, 1)
    assert placement.ranked() == [c, b, a]
    assert placement.ranked(exclude=[c]) == [b, a]
    placement.mark_down(c, FakeClock().now)  # a down one is not ranked while any is up
    assert placement.ranked() == [b, a]
    # A new session goes to the first ranked one, and its later chunks stay there.
    route = placement.route(SESSION, first=True)
    assert route == Route(b) and placement.holder(SESSION) == b.url
    b.inflight = 9
    assert placement.route(SESSION, first=False) == Route(b)
    assert placement.session_counts() == {b.url: 4, c.url: 1}


def test_a_mismatched_replica_is_never_chosen() -> None:
    clock = FakeClock()
    placement, (a, b) = hop("http://10.0.0.1:1", "http://10.0.0.2:1")
    placement.pin(a, "stage-A")
    placement.pin(b, "stage-B")
    assert b.mismatch and not a.mismatch and placement.pinned == "stage-A"
    b.inflight, a.inflight = 0, 5  # the idler one is still another stage
    assert placement.ranked() == [a]
    assert [placement.route(f"s{i}", first=True) for i in range(5)] == [Route(a)] * 5
    # Not even as a last resort: with the pinned stage's replica down, only it is left.
    placement.mark_down(a, clock.now)
    assert placement.ranked() == [a] and placement.any_order() == [a]
    assert placement.ranked(exclude=[a]) == []
    # A session stuck to it moves, and it failed no forward of it.
    placement.sticky[SESSION] = b
    assert placement.route(SESSION, first=False) == Route(b, recover=True, alive=False)
    assert placement.moved(SESSION, None) is None


def test_retired_replicas_get_no_new_sessions_and_go_once_unheld() -> None:
    source = "http://stage.test:1"  # a name: its addresses are the replicas
    placement: Placement[ReplicaState] = Placement(1.0)
    a = placement.add(ReplicaState(url="http://10.0.0.1:1", source=source))
    b = placement.add(ReplicaState(url="http://10.0.0.2:1", source=source))
    placement.sticky[SESSION] = a
    joined = placement.resolved(source, {"http://10.0.0.2:1", "http://10.0.0.3:1"})
    assert joined == ["http://10.0.0.3:1"] and a.retired and not b.retired
    assert placement.version == 1
    assert placement.ranked() == [b]
    assert placement.route("new", first=True) == Route(b)
    # The session it holds goes on there.
    assert placement.route(SESSION, first=False) == Route(a)
    assert placement.drop_stale() == []  # held: kept
    del placement.sticky[SESSION]
    a.inflight = 1
    assert placement.drop_stale() == []  # still answering a request: kept
    a.inflight = 0
    assert placement.drop_stale() == [a] and placement.replicas == [b]
    # The last replica is never dropped.
    placement.resolved(source, set())
    assert b.retired and placement.drop_stale() == [] and placement.replicas == [b]
    # Back in the answer: it takes sessions again.
    placement.resolved(source, {b.url})
    assert not b.retired and placement.ranked() == [b]


def test_with_none_healthy_the_down_ones_are_tried_fewest_failures_first() -> None:
    clock = FakeClock()
    placement, (a, b, c) = hop("http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1")
    for _ in range(3):
        placement.mark_down(a, clock.now)
    placement.mark_down(b, clock.now)
    placement.mark_down(c, clock.now)
    c.retired = True
    assert placement.ranked() == [b, a, c]  # retired last, then by failures
    assert placement.ranked(fallback=False) == []
    assert placement.ranked(exclude=[b]) == [a, c]
    # A new session still gets a replica rather than failing for sure.
    assert placement.route("new", first=True) == Route(b)


def test_a_replica_only_its_probes_call_down_is_left_only_for_a_healthy_one() -> None:
    clock = FakeClock()
    placement, (a, b) = hop("http://10.0.0.1:1", "http://10.0.0.2:1")
    placement.sticky[SESSION] = a
    placement.mark_down(a, clock.now)
    # Another is healthy: move there; ``a`` failed no forward, it stays a last resort.
    assert placement.route(SESSION, first=False) == Route(a, recover=True, alive=True)
    # None is: the chunk goes where the session's state is.
    placement.mark_down(b, clock.now)
    assert placement.route(SESSION, first=False) == Route(a)
    # Moved meanwhile to a replica that is up: nothing to rebuild.
    placement.back_up(b)
    placement.sticky[SESSION] = b
    assert placement.moved(SESSION, a) is b and placement.moved(SESSION, b) is None


def test_no_replica_at_all_and_a_session_stuck_nowhere() -> None:
    placement: Placement[ReplicaState] = Placement(1.0)
    assert placement.route(SESSION, first=True) is None
    assert placement.holder(SESSION) is None
    placement.add(ReplicaState(url="http://10.0.0.1:1", source="http://10.0.0.1:1"))
    # A later chunk of a session this hop never routed: recovered (discovery).
    assert placement.route(SESSION, first=False) == Route(None, recover=True)


def test_the_first_fingerprint_seen_is_pinned() -> None:
    changes: list[int] = []
    placement, (a, b, c) = hop("http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1")
    placement.on_change = lambda: changes.append(placement.version)
    placement.pin(a, None)  # a node too old to say: read, nothing pinned
    assert a.identity_read and placement.pinned is None and not a.mismatch
    placement.pin(b, "stage-B")
    placement.pin(c, "stage-C")
    placement.pin(a, "stage-C")
    assert placement.pinned == "stage-B"
    assert (a.mismatch, b.mismatch, c.mismatch) == (True, False, True)
    assert changes == [1, 2]
    placement.pin(c, "stage-B")  # restarted with the pinned stage: back in service
    assert not c.mismatch and c.fingerprint == "stage-B" and changes == [1, 2, 3]
    placement.pin(c, "stage-B")  # no change, no news
    assert changes == [1, 2, 3]


def test_probe_outcomes() -> None:
    clock = FakeClock()
    placement, (a,) = hop("http://10.0.0.1:1")
    placement.probe_failed(a, clock.now, unanswered=True)
    assert a.up and a.probe_misses == 1  # one slow answer is not a hang
    placement.probe_failed(a, clock.now, unanswered=True)
    assert not a.up and placement.version == 1
    placement.probe_failed(a, clock.now, unanswered=True)  # still down: backs off further
    assert a.failures == 2 and placement.version == 1
    # Answered: its identity is read before it is used again, then it is up.
    assert placement.probe_answered(a, "one") and not a.identity_read
    placement.pin(a, "stage")
    placement.back_up(a)
    assert a.up and a.probe_misses == 0 and placement.version == 2
    assert not placement.probe_answered(a, "one")  # the same process: nothing to read
    assert placement.probe_answered(a, "two")  # another process on its port: read again
    placement.pin(a, "stage")
    placement.probe_failed(a, clock.now, unanswered=False)  # refused: down at once
    assert not a.up


def test_names_addresses_and_first_chunks() -> None:
    assert not needs_replica_set([])
    assert not needs_replica_set([parse_endpoint("http://127.0.0.1:1")])
    assert not needs_replica_set([parse_endpoint("http://[::1]:1")])
    assert needs_replica_set([parse_endpoint("http://stage.test:1")])
    assert needs_replica_set([parse_endpoint("http://127.0.0.1:1")] * 2)
    named = parse_endpoint("http://stage.test:8000")
    assert address_url(named, "10.0.0.5") == "http://10.0.0.5:8000"
    assert address_url(named, "fd00::5") == "http://[fd00::5]:8000"

    def chunk(index: int, position: int) -> WireHeaders:
        return WireHeaders(shape=(1, 2, 4), dtype="float32", session=SESSION,
                           chunk_index=index, chunk_total=4, position=position)  # fmt: skip

    assert chunk(0, 0).starts_session
    assert not chunk(1, 2).starts_session and not chunk(0, 2).starts_session


@pytest.mark.parametrize("interval", [0.1, 2.0])
def test_the_cap_holds_for_any_interval(interval: float) -> None:
    placement, (a,) = hop("http://10.0.0.1:1", interval=interval)
    for _ in range(40):
        placement.mark_down(a, 0.0)
        assert 0 < a.next_probe <= MAX_BACKOFF


def test_the_placement_module_waits_on_nothing() -> None:
    """Its imports: no event loop, no sockets, nothing of the set's I/O parts."""
    tree = ast.parse(Path(placement_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert imported <= {
        "__future__", "ipaddress", "logging", "collections", "collections.abc", "dataclasses",
        "typing", "meshnet_proto", "..endpoints", "..bounded",  # (a dict: collections only)
    }  # fmt: skip


def test_a_session_after_a_cached_prefix_goes_to_the_replica_that_filed_it() -> None:
    """wire-2 §3.10: placement by prefix, falling back to load."""
    placement, (a, b) = hop("http://a:1", "http://b:1")
    stick(placement, a, 3)  # a is busier: by load alone, b would get a new session
    key, other = "1" * 32, "2" * 32
    placement.filed(a, [key])
    route = placement.route("new-1", True, key)
    assert route is not None and route.replica is a and placement.prefix_placed == 1
    # An unknown prefix, or none: by load.
    for prefix in (other, None):
        route = placement.route(f"new-{prefix}", True, prefix)
        assert route is not None and route.replica is b
    # The holder down: by load among the healthy, as failover would.
    a.up = False
    route = placement.route("new-2", True, key)
    assert route is not None and route.replica is b and placement.prefix_placed == 1


def test_the_prefix_holders_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement_module, "MAX_PREFIX_KEYS", 2)
    placement, (a, b) = hop("http://a:1", "http://b:1")
    placement.filed(a, ["1" * 32, "2" * 32])
    placement.filed(b, ["3" * 32, "1" * 32])  # refiled: the newest holder, moved to the end
    assert list(placement.prefixes) == ["3" * 32, "1" * 32] and placement.prefixes["1" * 32] is b
