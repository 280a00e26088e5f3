"""Flow control: the gateway's own queue, who is served next, and when a worker has room (issue 13).

Pure on purpose, like `routing.py` beside it: no I/O, no clocks (callers pass `now`), no asyncio.
`workers/dispatcher.py` drives it from the relay.

Why the gateway holds the queue: forwarding every request at once leaves the order to the
workers' first-come queues, so one tenant's MinerU batch (thousands of page and block requests)
makes everyone else wait behind it; measured 158x on B's TTFT p99 (docs/flow-control.md). Here a
request waits in the gateway until some worker has room, and only then is the worker chosen, on
the freshest load (late binding).

The order, from first to last:
- **Priority bands**, strictly: a lower `priority` first, as vLLM orders its own queue (the
  request's `priority` field, default 0, and `--scheduling-policy priority`).
- **Fair sharing between tenants inside a band**: start-time fair queuing on estimated cost. A
  tenant's head request gets the tag `max(band clock, tenant's last finish)`; the lowest tag goes
  first, and then the tenant's finish moves on by `cost / weight` and the band clock to the tag.
  A tenant with a small share is served next however many requests another has queued; two
  backlogged tenants are served in proportion to their weights.
- **FIFO within a tenant and band.**

With several replicas sharing fleet state (docs/operate/fleet-state.md) each holds a queue of
its own requests; given `TenantsElsewhere`, a tenant's limits and its share count every
replica's requests. Inside a band the order is then by share first (the tenant with the fewest
of the fleet's requests in flight for its weight), the fair-queuing tag second: each replica's
tags run on its own clock, advanced by its own dispatches, and cannot be compared with
another's, while shares can. Ordered by tags, a light tenant's request would queue behind a
flooding tenant's in a replica whose dispatches are a fraction of the fleet's
(docs/flow-control.md).

Backpressure: the queue is bounded in requests and in bytes (page images are megabytes), per
tenant (when configured) and in total. When the total is full, the request that goes is the newest
of the tenant holding most of the queue for its weight (longest-queue drop): a flooding tenant
cannot fill the queue and lock the others out of it.

Room on a worker: its own requests plus what it reports beyond them, against its batch size
(`max_num_seqs`, configured or learnt) plus a little headroom, since continuous batching wants a
few requests waiting to fill each step; and its KV cache must not be (nearly) full, since a
worker short of KV cache queues requests before its batch is full. The worker's reported
`waiting` alone is no sign of a full batch: every request waits there until the next engine step,
so a snapshot shows some waiting at any load.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mineru_gateway.routing import LoadModel, WorkerView

# -- room on workers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoomPolicy:
    """When a worker can take one more request without queueing it behind a full batch."""

    default_batch: int = 256  # vLLM's default max_num_seqs, until a worker's own is learnt
    headroom: float = 0.0  # requests allowed to wait on a worker, as a share of its batch
    min_headroom: int = 2
    load: LoadModel = field(default_factory=LoadModel)
    # batch_limit -> its capacity: asked for every worker on every request, from the few batch
    # sizes the workers have (configured, learnt, or vLLM's default).
    _capacities: dict[int | None, int] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def capacity(self, view: WorkerView) -> int:
        """Requests the worker may hold: its batch, and the headroom on top of it (a share of
        the batch, at least `min_headroom`)."""
        capacity = self._capacities.get(view.batch_limit)
        if capacity is None:
            batch = view.batch_limit or self.default_batch
            capacity = batch + max(self.min_headroom, math.ceil(self.headroom * batch))
            self._capacities[view.batch_limit] = capacity
        return capacity

    def occupied(self, view: WorkerView) -> float:
        """This gateway's requests on the worker plus those it reports beyond them."""
        reported = view.reported
        return view.in_flight + (0.0 if reported is None else reported.external)

    def has_room(self, view: WorkerView) -> bool:
        if not view.healthy or view.held:
            return False
        reported = view.reported
        if reported is not None and reported.kv_usage >= self.load.kv_avoid_above:
            return False  # short of KV cache: what is sent now waits inside the worker
        return self.occupied(view) < self.capacity(view)

    def roomy(self, views: Iterable[WorkerView]) -> list[WorkerView]:
        return [view for view in views if self.has_room(view)]

    def free(self, roomy: Iterable[WorkerView]) -> int:
        """Requests the workers with room can still take (each at least one)."""
        return sum(max(1, math.ceil(self.capacity(view) - self.occupied(view))) for view in roomy)


# -- tenants and tickets ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's share and limits. None: no limit of its own (the queue's totals still hold)."""

    name: str
    weight: float = 1.0
    priority: int = 0  # its requests' priority when they name none
    # The most urgent priority its requests may ask for (lower is more urgent); None: its own
    # default, so a tenant can mark work as background but cannot jump ahead of others.
    min_priority: int | None = None
    max_queued: int | None = None
    max_queued_bytes: int | None = None
    max_in_flight: int | None = None

    def effective_priority(self, asked: int | None) -> int:
        if asked is None:
            return self.priority
        floor = self.priority if self.min_priority is None else self.min_priority
        return max(asked, floor)


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place in the queue. `handle` is the caller's (the dispatcher's future)."""

    tenant: TenantPolicy
    priority: int
    cost: float  # estimated cost in batch slots (cost.py)
    size: int  # bytes held while queued
    enqueued_at: float
    model: str | None = None
    handle: Any = None  # the caller's (the dispatcher's future), opaque here
    queued: bool = False

    @property
    def name(self) -> str:
        return self.tenant.name


class TenantsElsewhere(Protocol):
    """What the gateway's other replicas hold of each tenant (fleet/tenants.py)."""

    def others(self, tenant: str) -> tuple[int, int, int]:
        """The other replicas' (in flight, queued, queued bytes) of the tenant."""

    def publish(self, tenant: str, in_flight: int, queued: int, queued_bytes: int) -> None:
        """This replica's counts of the tenant, now."""


@dataclass(frozen=True, slots=True)
class QueueLimits:
    max_queued: int = 4096
    max_queued_bytes: int = 2 * 1024**3
    max_wait_s: float = 300.0


class Rejected(Exception):
    """The queue cannot take a ticket: `why` is tenant_queue_full, tenant_queue_bytes_full,
    queue_full or queue_bytes_full."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass(slots=True)
class _TenantState:
    """A tenant's counts over all bands, and its position in each band's fair order."""

    policy: TenantPolicy
    queued: int = 0
    queued_bytes: int = 0
    in_flight: int = 0
    finish: dict[int, float] = field(default_factory=dict)  # band -> last finish tag

    def share(self, by_bytes: bool) -> float:
        return (self.queued_bytes if by_bytes else self.queued) / self.policy.weight


@dataclass(slots=True)
class _Band:
    clock: float = 0.0  # start tag of the band's last dispatch
    queues: dict[str, deque[Ticket]] = field(default_factory=dict)


@dataclass(slots=True)
class ModelQueue:
    """The queued requests for one model."""

    requests: int
    cost: float  # estimated, in batch slots (cost.py)
    oldest: float  # when the longest-waiting one arrived (the caller's clock)


class FairQueue:
    """Priority bands, fair sharing between tenants inside each, FIFO inside a tenant."""

    def __init__(
        self, limits: QueueLimits | None = None, elsewhere: TenantsElsewhere | None = None
    ) -> None:
        """`elsewhere`: the other replicas' counts of each tenant, which its queue limits and
        share then include (its `max_in_flight` is held by fleet state's slots:
        fleet/slots.py). The queue's totals stay this replica's: they bound its memory."""
        self.limits = limits or QueueLimits()
        self._elsewhere = elsewhere
        self._bands: dict[int, _Band] = {}
        self._tenants: dict[str, _TenantState] = {}
        self.queued = 0
        self.queued_bytes = 0

    def __len__(self) -> int:
        return self.queued

    # -- admission ------------------------------------------------------------------------
    def push(self, ticket: Ticket) -> list[Ticket]:
        """Queues `ticket`; returns the tickets pushed out to make room (longest-queue drop),
        which may be `ticket` itself. Raises Rejected when its tenant's own limit is reached."""
        state = self._tenant(ticket.tenant)
        self._check_tenant(state, ticket)
        self._bands.setdefault(ticket.priority, _Band()).queues.setdefault(
            ticket.name, deque()
        ).append(ticket)
        self._count(state, ticket, +1)
        ticket.queued = True
        return self._shed()

    def _check_tenant(self, state: _TenantState, ticket: Ticket) -> None:
        policy = state.policy
        if policy.max_queued is None and policy.max_queued_bytes is None:
            return
        _, queued, queued_bytes = self._others(policy.name)
        queued += state.queued
        if policy.max_queued is not None and queued >= policy.max_queued:
            raise Rejected(
                "tenant_queue_full",
                f"tenant {policy.name!r} already has {queued} requests queued "
                f"(its limit is {policy.max_queued})",
            )
        limit = policy.max_queued_bytes
        if limit is not None and queued_bytes + state.queued_bytes + ticket.size > limit:
            raise Rejected(
                "tenant_queue_bytes_full",
                f"tenant {policy.name!r} would hold more than {limit} bytes of queued requests",
            )

    def _shed(self) -> list[Ticket]:
        shed: list[Ticket] = []
        while self.queued > self.limits.max_queued:
            shed.append(self._drop_longest(by_bytes=False))
        while self.queued_bytes > self.limits.max_queued_bytes:
            shed.append(self._drop_longest(by_bytes=True))
        return shed

    def _drop_longest(self, *, by_bytes: bool) -> Ticket:
        state = max(
            (s for s in self._tenants.values() if s.queued),
            key=lambda s: s.share(by_bytes),
        )
        name = state.policy.name
        least_urgent = max(p for p, band in self._bands.items() if name in band.queues)
        victim = self._bands[least_urgent].queues[name][-1]
        self.remove(victim)
        return victim

    # -- dispatch -------------------------------------------------------------------------
    def next(self, eligible: Callable[[Ticket], bool] = lambda ticket: True) -> Ticket | None:
        """The ticket to serve next among those `eligible` allows; None if there is none.
        A tenant at its in-flight limit waits; so does everything behind an ineligible head."""
        order = _by_order if self._elsewhere is None else _by_share
        for priority in sorted(self._bands):
            band = self._bands[priority]
            for *_order, ticket in sorted(self._heads(priority, band), key=order):
                if eligible(ticket):
                    return ticket
        return None

    def _heads(self, priority: int, band: _Band) -> Iterator[tuple[float, float, Ticket]]:
        """Each tenant's head with its tag; equal tags go to the tenant with less in flight
        for its weight (a tenant whose requests went straight to workers has used its turn)."""
        for name, tickets in band.queues.items():
            state = self._tenants[name]
            if self.may_start(state.policy):
                everywhere = state.in_flight + self._others(name)[0]
                tag = max(band.clock, state.finish.get(priority, 0.0))
                yield tag, everywhere / state.policy.weight, tickets[0]

    def pop(self, ticket: Ticket) -> None:
        """Takes `ticket` (the head of its tenant's queue, as `next` returned it) out for
        dispatch: its tenant's clock moves on by its cost over the tenant's weight."""
        band = self._bands[ticket.priority]
        state = self._tenants[ticket.name]
        start = max(band.clock, state.finish.get(ticket.priority, 0.0))
        state.finish[ticket.priority] = start + ticket.cost / state.policy.weight
        band.clock = start
        self._unlink(ticket)
        state.in_flight += 1
        self._publish(state)

    def done(self, ticket: Ticket) -> None:
        """A dispatched ticket's request has ended: its tenant may start another."""
        state = self._tenants.get(ticket.name)
        if state is not None:
            state.in_flight = max(0, state.in_flight - 1)
            self._publish(state)
            self._forget_if_idle(state)

    def remove(self, ticket: Ticket) -> None:
        """Takes a queued ticket out without serving it (its client left, it waited too long,
        or it was shed). Does nothing for a ticket no longer queued."""
        if ticket.queued:
            self._unlink(ticket)
            self._forget_if_idle(self._tenants[ticket.name])

    def _unlink(self, ticket: Ticket) -> None:
        band = self._bands[ticket.priority]
        tickets = band.queues[ticket.name]
        if tickets[0] is ticket:
            tickets.popleft()
        else:
            tickets.remove(ticket)
        if not tickets:
            del band.queues[ticket.name]
            if not band.queues:
                # An empty band keeps no clock: the next request there starts it afresh, and
                # the tenants' finish tags in it are forgotten with it.
                del self._bands[ticket.priority]
                for state in self._tenants.values():
                    state.finish.pop(ticket.priority, None)
        ticket.queued = False
        self._count(self._tenants[ticket.name], ticket, -1)

    # -- bookkeeping ----------------------------------------------------------------------
    def _tenant(self, policy: TenantPolicy) -> _TenantState:
        state = self._tenants.get(policy.name)
        if state is None:
            state = self._tenants[policy.name] = _TenantState(policy)
        return state

    def _count(self, state: _TenantState, ticket: Ticket, sign: int) -> None:
        state.queued += sign
        state.queued_bytes += sign * ticket.size
        self.queued += sign
        self.queued_bytes += sign * ticket.size
        self._publish(state)

    def _publish(self, state: _TenantState) -> None:
        if self._elsewhere is not None:
            self._elsewhere.publish(
                state.policy.name, state.in_flight, state.queued, state.queued_bytes
            )

    def _others(self, tenant: str) -> tuple[int, int, int]:
        return (0, 0, 0) if self._elsewhere is None else self._elsewhere.others(tenant)

    def _forget_if_idle(self, state: _TenantState) -> None:
        """Bounded memory: an idle tenant with no fair-share position left is dropped."""
        if state.queued or state.in_flight or state.finish:
            return
        self._tenants.pop(state.policy.name, None)

    def queued_tenants(self) -> list[tuple[TenantPolicy, int]]:
        """Each tenant with requests queued, and how many."""
        return [(s.policy, s.queued) for s in self._tenants.values() if s.queued]

    def queued_of(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.queued if state else 0

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.in_flight if state else 0

    def may_start(self, tenant: TenantPolicy) -> bool:
        """Under the tenant's in-flight limit in this replica (across replicas, fleet state's
        slots hold it: fleet/slots.py)."""
        limit = tenant.max_in_flight
        return limit is None or self.in_flight(tenant.name) < limit

    def start_unqueued(self, tenant: TenantPolicy) -> None:
        """Counts a request dispatched at once, without queueing, against its tenant."""
        state = self._tenant(tenant)
        state.in_flight += 1
        self._publish(state)

    def tickets(self) -> Iterator[Ticket]:
        for band in self._bands.values():
            for tickets in band.queues.values():
                yield from tickets

    def depth(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(tenant, priority) -> (queued requests, queued bytes)."""
        depth: dict[tuple[str, int], tuple[int, int]] = {}
        for priority, band in self._bands.items():
            for name, tickets in band.queues.items():
                depth[(name, priority)] = (len(tickets), sum(t.size for t in tickets))
        return depth

    def by_model(self) -> dict[str | None, ModelQueue]:
        """What waits for each model: requests, their estimated cost, the oldest's arrival."""
        found: dict[str | None, ModelQueue] = {}
        for ticket in self.tickets():
            queue = found.get(ticket.model)
            if queue is None:
                found[ticket.model] = ModelQueue(1, ticket.cost, ticket.enqueued_at)
            else:
                queue.requests += 1
                queue.cost += ticket.cost
                queue.oldest = min(queue.oldest, ticket.enqueued_at)
        return found

    def in_flight_by_tenant(self) -> dict[str, int]:
        return {name: state.in_flight for name, state in self._tenants.items()}

    def is_idle(self) -> bool:
        return self.queued == 0


def _by_order(head: tuple[float, float, Ticket]) -> tuple[float, float]:
    return head[0], head[1]


def _by_share(head: tuple[float, float, Ticket]) -> tuple[float, float]:
    return head[1], head[0]


# -- how long to come back after --------------------------------------------------------------


class DrainRate:
    """Requests finished per second over the last `window_s` (the pace at which room appears
    on the fleet), and the `Retry-After` each refused request is told (bounded memory).

    Every refused request is given its own slot after the queue ahead of it has drained, one
    completion interval after the previous refused one: when many are refused at once (a MinerU
    client keeps 100 outstanding) they come back spread over the time the fleet needs for them,
    not all in the same second to be refused again (MinerU's client retries only 3 times: one
    Retry-After for all loses most of a burst's pages, docs/flow-control.md).
    Completions, not dispatches, are counted: the burst that fills idle workers at the onset of
    an overload (a dozen dispatches in a millisecond) says nothing of the fleet's pace, and the
    rate's span is at least `min_span_s` for the same reason.
    """

    MAX_S = 120.0  # MinerU's client caps the Retry-After it honours at 120 s
    FLOOR_S = 1.0
    UNKNOWN_RATE = 1.0  # dispatches/s assumed while nothing has been dispatched lately

    def __init__(
        self, window_s: float = 10.0, max_events: int = 4096, min_span_s: float = 5.0
    ) -> None:
        self.window_s = window_s
        self.min_span_s = min(min_span_s, window_s)
        self._events: deque[float] = deque(maxlen=max_events)
        self._next_slot = 0.0  # when the next refused request is to come back (clock time)

    def record(self, now: float) -> None:
        self._events.append(now)

    def rate(self, now: float) -> float:
        events = self._events
        while events and events[0] < now - self.window_s:
            events.popleft()
        if len(events) < 2:
            return 0.0
        return len(events) / max(now - events[0], self.min_span_s)

    def retry_after(self, queued: int, now: float) -> float:
        """Seconds this refused request should wait: until the `queued` requests ahead have
        drained at the recent rate, plus one dispatch interval per request refused before it
        whose slot is still ahead; between 1 s and 120 s."""
        rate = self.rate(now) or self.UNKNOWN_RATE
        slot = max(now + queued / rate, self._next_slot)
        slot = min(slot, now + self.MAX_S)
        self._next_slot = slot + 1 / rate
        return max(self.FLOOR_S, slot - now)


# -- how long the queue takes to drain ---------------------------------------------------------


class CostDrain:
    """Estimated cost finished per second, per model, over the last `window_s`: the pace at
    which the fleet works a model's queue off (bounded memory).

    `backlog` is the queue's cost over that pace, in seconds: what autoscaling follows
    (docs/operate/autoscaling.md). The workers' own queues stay near empty while the gateway
    holds the requests, so their `num_requests_waiting` cannot show it.
    """

    def __init__(
        self, window_s: float = 30.0, min_span_s: float = 5.0, max_events: int = 4096
    ) -> None:
        self.window_s = window_s
        self.min_span_s = min(min_span_s, window_s)
        self._max_events = max_events
        self._events: dict[str | None, deque[tuple[float, float]]] = {}

    def record(self, model: str | None, cost: float, now: float) -> None:
        events = self._events.get(model)
        if events is None:
            events = self._events[model] = deque(maxlen=self._max_events)
        events.append((now, cost))

    def rate(self, model: str | None, now: float) -> float:
        events = self._events.get(model)
        if not events:
            return 0.0
        while events and events[0][0] < now - self.window_s:
            events.popleft()
        if not events:
            del self._events[model]
            return 0.0
        return sum(cost for _, cost in events) / max(now - events[0][0], self.min_span_s)

    def backlog(self, queued: ModelQueue, model: str | None, now: float) -> float:
        """Seconds to drain `queued` at the recent pace. With nothing finished lately, the
        oldest request's wait so far: the queue has not drained for that long."""
        rate = self.rate(model, now)
        if rate > 0:
            return queued.cost / rate
        return max(0.0, now - queued.oldest)
