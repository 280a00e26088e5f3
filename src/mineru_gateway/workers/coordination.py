"""How a gateway process's dispatcher agrees with its sibling processes (`serve --processes N`).

The dispatcher calls only `Coordination`. A gateway of one process has `ALONE`: nothing to hold,
post or ring, and no file lock taken on the event loop. `Shared` is the processes' shared memory
(group_load.py) and doorbells (siblings.py), as docs/architecture.md ("Several processes on one
port") and docs/flow-control.md describe:

- a decision, from reading the views to taking the lease, holds the workers' table, so that two
  processes never take the same last slot;
- each process posts its most urgent waiting request (its queue's head); a process about to use
  room that more urgent heads elsewhere should take leaves it and rings their processes;
- room one process's request leaves shows in the table, not as an event in the others: a process
  whose requests wait looks again every `poll_s`, and one whose queue has emptied rings those
  with requests waiting.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from mineru_gateway.flow import FairQueue, RoomPolicy, Ticket
from mineru_gateway.routing import WorkerView
from mineru_gateway.workers.group_load import GroupLoad, QueueHeads, model_key

SIBLING_POLL_S = 0.02
# A sibling's posted queue head older than this is ignored (its process posts at every look,
# every SIBLING_POLL_S while it has requests waiting): room never waits for a dead process.
HEAD_FRESH_S = 5 * SIBLING_POLL_S


class Coordination(Protocol):
    """What the dispatcher asks of its sibling processes."""

    @property
    def poll_s(self) -> float | None:
        """How often to look for room again while requests wait; None: only on events."""

    def deciding(self) -> contextlib.AbstractContextManager[None]:
        """Held from reading the views to taking the lease (blocks may nest)."""

    def post_head(self, queue: FairQueue) -> None:
        """`queue`'s most urgent waiting request, for the siblings to give way to."""

    def gives_way(
        self, ticket: Ticket, roomy: list[WorkerView], queue: FairQueue, room: RoomPolicy
    ) -> bool:
        """Whether the room in `roomy` belongs to more urgent requests waiting elsewhere."""

    def hand_over(self) -> None:
        """Nothing waits here: the siblings with requests waiting look at once."""


_NOTHING = contextlib.nullcontext()


class Alone:
    """A gateway of one process: no siblings to agree with."""

    poll_s: float | None = None

    def deciding(self) -> contextlib.AbstractContextManager[None]:
        return _NOTHING

    def post_head(self, queue: FairQueue) -> None:
        pass

    def gives_way(
        self, ticket: Ticket, roomy: list[WorkerView], queue: FairQueue, room: RoomPolicy
    ) -> bool:
        return False

    def hand_over(self) -> None:
        pass


ALONE = Alone()


class Shared:
    """Sibling processes sharing the workers' table `table` (the registry's own, whose lock is
    the decision's), the queue heads `heads`, and doorbells (`ring(index)` tells process
    `index` to look at once)."""

    def __init__(
        self,
        table: GroupLoad,
        heads: QueueHeads,
        ring: Callable[[int], None],
        poll_s: float = SIBLING_POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` must be one for every process of the host (time.monotonic() is): heads
        are posted and judged by it."""
        self._clock = clock
        self._table = table
        self._heads = heads
        self._ring = ring
        self.poll_s: float | None = poll_s
        # process index -> the head given way to (when it was queued), since when, last when
        self._given: dict[int, tuple[float, float, float]] = {}

    def deciding(self) -> contextlib.AbstractContextManager[None]:
        return self._table.locked()

    def post_head(self, queue: FairQueue) -> None:
        with self.deciding():  # a head is never read half-written (nested: no second flock)
            ticket = queue.next()
            if ticket is None:
                self._heads.clear()
                return
            tenant = ticket.tenant
            self._heads.post(
                self._clock(),
                ticket.priority,
                tenant.name,
                tenant.weight,
                queue.share(tenant),
                ticket.model,
                ticket.enqueued_at,
            )

    def hand_over(self) -> None:
        for index in self._heads.waiting(self._clock() - HEAD_FRESH_S):
            self._ring(index)

    def gives_way(
        self, ticket: Ticket, roomy: list[WorkerView], queue: FairQueue, room: RoomPolicy
    ) -> bool:
        """A more urgent band, a tenant with a smaller share of the gateway's requests, or the
        same and waiting longer, for a model these workers serve, one request for each such
        head. A head that has not taken the room left for it within HEAD_FRESH_S is passed
        over: its process sees the workers otherwise for now (health, a reading)."""
        now = self._clock()
        since = now - HEAD_FRESH_S
        if not self._heads.posted_since(since):
            return False  # nothing waits elsewhere (the usual case): no share to read
        share = queue.share(ticket.tenant)
        ahead = self._heads.ahead(ticket.priority, share, ticket.enqueued_at, since)
        if not ahead:
            return False
        models = {model_key(model) for view in roomy for model in view.models}
        waiting = [
            index
            for index, key, queued_at in ahead
            if (key == 0.0 or key in models) and self._still_given(index, queued_at, now)
        ]
        if not waiting or room.free(roomy) > len(waiting):
            return False
        for index in waiting:
            self._ring(index)
        return True

    def _still_given(self, index: int, queued_at: float, now: float) -> bool:
        """Whether room may still be left for process `index`'s head (queued at `queued_at`):
        since when it has been left, each time within HEAD_FRESH_S of the last (while room
        stands empty the queue looks every `poll_s`), is not older than HEAD_FRESH_S."""
        given = self._given.get(index)
        if given is None or given[0] != queued_at or now - given[2] > HEAD_FRESH_S:
            given = (queued_at, now, now)
        elif now - given[1] > HEAD_FRESH_S:
            return False
        self._given[index] = (queued_at, given[1], now)
        return True
