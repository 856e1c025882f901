"""InFlight (meshnet_node.forgetting): chunks in flight per session, and the
sessions forgotten while one was on its way down."""

from __future__ import annotations

from meshnet_node.forgetting import InFlight


def test_a_forgotten_session_is_handed_back_when_its_last_chunk_ends() -> None:
    flight = InFlight(None, known=lambda session: False)
    flight.started("a", "key-a")
    flight.started("a", "key-a")
    flight.started("b", None)
    assert flight.count == 3
    flight.forgotten("a")
    assert flight.ended("a") is None  # one of its chunks is still down
    assert flight.count == 2
    assert flight.ended("a") == ("a", "key-a")  # the last: pass its DELETE down
    assert flight.ended("b") is None  # never forgotten: nothing to pass down
    assert flight.count == 0


def test_a_session_forgotten_with_nothing_in_flight_is_no_orphan() -> None:
    flight = InFlight(None, known=lambda session: False)
    flight.forgotten("a")
    flight.started("a", None)
    assert flight.ended("a") is None
    # Counted afresh after its end: a later forget with a chunk down is one.
    flight.started("a", "k2")
    flight.forgotten("a")
    assert flight.ended("a") == ("a", "k2")
    assert flight.count == 0
