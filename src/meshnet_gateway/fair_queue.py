"""A wait queue fair across clients: round-robin between them, FIFO within one.

Issue 37: one strict FIFO let a single client (a burst of requests, or one
prompt over the whole prefill budget) hold every other client behind it.
Here each client has its own lane, and the lanes take turns: the client
served last goes to the back of the rotation, a client that starts waiting
joins at the back. Within one lane the order is arrival. So with N clients
waiting, each is served at least once in every N grants, whatever the
others have queued.

The client is ``RequestContext.client`` (the tenant of the request's API
key, else the peer's address); ``None`` is one lane like any other.
Synchronous and single-threaded (the event loop's), like its user
``meshnet_gateway.admission``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

__all__ = ["FairQueue"]

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items per client; ``head``/``pop`` take the next client's oldest."""

    def __init__(self) -> None:
        # Insertion order is the rotation: the first lane is served next.
        self._lanes: OrderedDict[str | None, deque[T]] = OrderedDict()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    @property
    def clients(self) -> int:
        """Clients with at least one item waiting."""
        return len(self._lanes)

    def waiting(self, client: str | None) -> int:
        """Items ``client`` has in the queue."""
        lane = self._lanes.get(client)
        return 0 if lane is None else len(lane)

    def push(self, client: str | None, item: T) -> None:
        lane = self._lanes.get(client)
        if lane is None:
            lane = self._lanes[client] = deque()  # a new client joins at the back
        lane.append(item)
        self._count += 1

    def head(self) -> T:
        """The item ``pop`` would take (IndexError when empty)."""
        if not self._lanes:
            raise IndexError("the queue is empty")
        return next(iter(self._lanes.values()))[0]

    def pop(self) -> T:
        """The next client's oldest item; that client goes to the back."""
        if not self._lanes:
            raise IndexError("the queue is empty")
        client, lane = next(iter(self._lanes.items()))
        item = lane.popleft()
        if lane:
            self._lanes.move_to_end(client)
        else:
            del self._lanes[client]
        self._count -= 1
        return item

    def remove(self, client: str | None, item: T) -> bool:
        """Take ``item`` out (it gave up); False if it is not queued."""
        lane = self._lanes.get(client)
        if lane is None:
            return False
        try:
            lane.remove(item)
        except ValueError:
            return False
        if not lane:
            del self._lanes[client]
        self._count -= 1
        return True
