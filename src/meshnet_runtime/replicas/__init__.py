"""One hop served by several nodes: a replica set with failover and replay.

``ReplicaSet`` stands where a ``DownstreamPool`` stood (a node's ``--next``,
the gateway's ``--entry``) and speaks the same API (``forward``,
``request``, ``url``, ``link``, ``aclose``). Behind it, one pool per
replica. What it adds (docs/failover.md):

* **Stickiness.** A session's chunks go to one replica, the one holding its
  state; a new session (chunk 0 at position 0) goes to the healthy replica
  with the fewest requests in flight.
* **Health.** Each replica is probed (``GET /health``) every
  ``health_interval``; a probe unanswered within ``probe_timeout``, a lost
  connection or a ``503 shutting_down`` of a forward marks it down at once,
  and the forwards waiting on it are cancelled (a hung process is found by
  its probes, not by the request's deadline). A down replica is probed
  again with exponential backoff and comes back into rotation when it
  answers.
* **Failover with replay.** When the replica holding a session is down or
  says ``session_unknown`` (a restarted process), the session moves to
  another replica, which first gets the session's history at this hop
  (``history.HistoryStore``: every chunk this hop sent and saw answered)
  as ``POST /forward?replay=1``: it runs its stage and keeps the output for
  its own hop, but forwards nothing, so no stage below computes anything
  again. Then the chunk itself goes, as usual.
* **Discovery.** A hop that was itself just rebuilt by a replay does not
  know which replica below holds the session: it asks them in turn (a
  replica that does not hold it answers ``session_unknown`` from the
  header alone, before any compute) and replays only when none does.
* **DNS.** A URL whose host is a name is re-resolved every
  ``dns_interval``; each address is a replica (a Kubernetes headless
  service or a round robin is a replica set).

Deletes (``DELETE /sessions/{id}``) go to every replica, so no replica that
ever held the session keeps its state.

The parts, each importing only those listed before it:

* ``placement``: the pure decisions (records, ranking, stickiness, backoff,
  pinning, membership), with the time passed in;
* ``replica``: a replica's record with its pools;
* ``monitor``: the health task (probes, DNS, identities);
* ``failover``: one forward, and moving a session (discovery, replay);
* ``fanout``, ``views``: every replica at once (DELETE, deep health), and
  what ``/info`` and ``/metrics`` show;
* ``replica_set``: ``ReplicaSet``, the driver composing them.
"""

from .failover import REPLAY_PATH
from .monitor import Resolver
from .placement import MAX_BACKOFF, needs_replica_set
from .replica import Replica
from .replica_set import ReplicaSet

__all__ = ["MAX_BACKOFF", "REPLAY_PATH", "Replica", "ReplicaSet", "Resolver", "needs_replica_set"]
