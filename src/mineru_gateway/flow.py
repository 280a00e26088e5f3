"""Flow control: the gateway's own queue, who is served next, and when a worker has room.

Pure on purpose, like `routing.py` beside it: no I/O, no clocks (callers pass `now`), no asyncio.
`workers/dispatcher.py` drives it from the relay.

Why the gateway holds the queue: forwarding every request at once leaves the order to the
workers' first-come queues, so one tenant's MinerU batch (thousands of page and block requests)
makes everyone else wait behind it (docs/flow-control.md, benchmarks/results/flow.md). Here a
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
- **Flows inside a tenant and band** (documents): a request's flow is its document id (the
  `X-Document-Id` header, name configurable); requests without one form the tenant's default
  flow. The tenant's turns go to the flow that has had the least service so far (least attained
  service, on estimated cost), ties to the oldest head: a 3-page document sent while a 300-page
  one parses goes ahead of it until it has had as much, so short documents finish near their
  time alone and a long one loses only the short ones' work (docs/flow-control.md, "Documents").
  A tenant remembers at most `max_flows` flows; idle ones are forgotten least recently used
  first, and a new id while all are busy joins the default flow: never a refusal.
- **Steps inside a flow**: MinerU parses a page as a layout request, then one request per block;
  a flow's block requests (text, table, formula) go ahead of its new layout requests, so pages
  started finish before new ones start. Otherwise FIFO.

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
from bisect import insort
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mineru_gateway.prompts import PromptKind
from mineru_gateway.routing import LoadModel, WorkerView

# MinerU's second step: one request per block of a page whose layout is known.
BLOCK_KINDS = frozenset({PromptKind.TEXT, PromptKind.TABLE, PromptKind.FORMULA})


def task_of(kind: PromptKind) -> str:
    """layout (a page's first step), block (its second) or other: queue metrics' task label."""
    if kind is PromptKind.LAYOUT:
        return "layout"
    return "block" if kind in BLOCK_KINDS else "other"


# -- room on workers ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoomPolicy:
    """When a worker can take one more request without queueing it behind a full batch."""

    default_batch: int = 256  # vLLM's default max_num_seqs, until a worker's own is learnt
    headroom: float = 0.0  # requests allowed to wait on a worker, as a share of its batch
    min_headroom: int = 2
    # Of a worker's capacity, the last `reserve` requests' room is only for requests of a
    # tenant (or, inside a tenant, a flow) below its share (`FairQueue.below_share`).
    reserve: int = 0
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

    def has_open_room(self, view: WorkerView) -> bool:
        """Room outside the reserve (which leaves at least one request's): what a request at or
        above its share may take."""
        return self.has_room(view) and self.beyond_reserve(view)

    def beyond_reserve(self, view: WorkerView) -> bool:
        """Of a worker with room (`has_room`): whether its room goes beyond the reserve."""
        return self.occupied(view) < max(1, self.capacity(view) - self.reserve)

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
    flow: str | None = None  # its document id; None: the tenant's default flow
    kind: PromptKind = PromptKind.OTHER  # the MinerU task its prompt asks for
    handle: Any = None  # the caller's (the dispatcher's future), opaque here
    queued: bool = False
    seq: int = 0  # arrival order in the queue, set by `push`
    # Back on the turn a refusal kept (`KeptTurns`): the `seq` it had when it first came, which
    # `push` gives it again, so a full queue sheds requests that came after it first
    # (docs/flow-control.md, "Backpressure"). 0: it comes for the first time.
    first_seq: int = 0
    shed_why: str = "queue_full"  # why `push` pushed it out, when it did

    @property
    def returning(self) -> bool:
        return self.first_seq > 0

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def is_block(self) -> bool:
        """A request of MinerU's second step (a block of a page)."""
        return self.kind in BLOCK_KINDS

    @property
    def task(self) -> str:
        return task_of(self.kind)


class TenantsElsewhere(Protocol):
    """What the gateway's other replicas hold of each tenant (fleet/tenants.py)."""

    def others(self, tenant: str) -> tuple[int, int, int]:
        """The other replicas' (in flight, queued, queued bytes) of the tenant."""

    def publish(self, tenant: str, in_flight: int, queued: int, queued_bytes: int) -> None:
        """This replica's counts of the tenant, now."""


# How far past `max_queued` (the gateway's, a tenant's) a request back on its kept turn may
# wait when nothing that came after it first is left to push out, as a multiple of it.
RETURNING_ROOM = 2


@dataclass(frozen=True, slots=True)
class QueueLimits:
    max_queued: int = 4096
    max_queued_bytes: int = 2 * 1024**3
    max_wait_s: float = 300.0
    max_flows: int = 64  # document flows a tenant keeps (busy and remembered idle ones)
    order_steps: bool = True  # a flow's block requests ahead of its layout requests


class Rejected(Exception):
    """The queue cannot take a ticket: `why` is tenant_queue_full, tenant_queue_bytes_full,
    queue_full or queue_bytes_full."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass(slots=True)
class _Flow:
    """A document of a tenant (or the tenant's requests without one), over all bands."""

    attained: float = 0.0  # estimated cost dispatched so far: least first
    queued: int = 0
    in_flight: int = 0
    done: int = 0

    @property
    def idle(self) -> bool:
        return not (self.queued or self.in_flight)


@dataclass(slots=True)
class _TenantState:
    """A tenant's counts over all bands, its position in each band's fair order, its flows."""

    policy: TenantPolicy
    queued: int = 0
    queued_bytes: int = 0
    in_flight: int = 0
    finish: dict[int, float] = field(default_factory=dict)  # band -> last finish tag
    # Document id -> its flow, least recently used first; the default flow (None) is not
    # among them (it is never forgotten while the tenant is known).
    flows: OrderedDict[str, _Flow] = field(default_factory=OrderedDict)
    default_flow: _Flow = field(default_factory=_Flow)

    def share(self, by_bytes: bool) -> float:
        return (self.queued_bytes if by_bytes else self.queued) / self.policy.weight

    def flow(self, key: str | None) -> _Flow:
        if key is None:
            return self.default_flow
        return self.flows[key]

    def place(self, ticket: Ticket, max_flows: int) -> _Flow:
        """The ticket's flow, made (or remembered afresh) if need be. Over `max_flows` the
        least recently used idle flow is forgotten; with none idle the ticket joins the default
        flow (`ticket.flow` becomes None)."""
        key = ticket.flow
        if key is None:
            return self.default_flow
        flows = self.flows
        found = flows.get(key)
        if found is not None:
            flows.move_to_end(key)
            return found
        if len(flows) >= max_flows:
            idle = next((k for k, f in flows.items() if f.idle), None)
            if idle is None:
                ticket.flow = None
                return self.default_flow
            del flows[idle]
        made = flows[key] = _Flow()
        return made

    def busy_flows(self) -> int:
        """Flows with requests queued or in flight (the default one included)."""
        return sum(1 for f in self.flows.values() if not f.idle) + (not self.default_flow.idle)


class _FlowQueue:
    """One flow's requests in one band: block requests ahead of the rest, FIFO in each."""

    __slots__ = ("blocks", "flow", "rest")

    def __init__(self, flow: _Flow) -> None:
        self.flow = flow
        self.blocks: deque[Ticket] = deque()
        self.rest: deque[Ticket] = deque()

    def head(self) -> Ticket:
        return self.blocks[0] if self.blocks else self.rest[0]

    def __bool__(self) -> bool:
        return bool(self.blocks or self.rest)


class _TenantQueue:
    """One tenant's requests in one band, by flow. Its head is the head of the flow with the
    least attained service (ties: the earliest arrival)."""

    __slots__ = ("count", "flows", "order_steps", "returning")

    def __init__(self, order_steps: bool) -> None:
        self.flows: dict[str | None, _FlowQueue] = {}
        self.count = 0
        self.returning = 0  # of them back on a kept turn
        self.order_steps = order_steps

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Ticket]:
        for queue in self.flows.values():
            yield from queue.blocks
            yield from queue.rest

    def append(self, ticket: Ticket, flow: _Flow) -> None:
        queue = self.flows.get(ticket.flow)
        if queue is None:
            queue = self.flows[ticket.flow] = _FlowQueue(flow)
        (queue.blocks if self.order_steps and ticket.is_block else queue.rest).append(ticket)
        self.count += 1
        self.returning += ticket.returning

    def head(self) -> Ticket:
        flows = self.flows
        if len(flows) == 1:
            for queue in flows.values():
                return queue.head()
        best: Ticket | None = None
        best_key = (math.inf, 0)
        for queue in flows.values():
            head = queue.head()
            key = (queue.flow.attained, head.seq)
            if key < best_key:
                best, best_key = head, key
        assert best is not None
        return best

    def newest(self) -> Ticket:
        """What a full queue sheds first: the one that came first most recently (the highest
        `seq`; a returning request has the one it first had)."""
        lists = [t for queue in self.flows.values() for t in (queue.blocks, queue.rest) if t]
        if self.returning == 0:  # in arrival order: each list's newest is its last
            return max((tickets[-1] for tickets in lists), key=lambda t: t.seq)
        newest = lists[0][-1]
        for tickets in lists:
            # A returning request is appended with its older seq; those before a list's last
            # new request came before that one.
            for ticket in reversed(tickets):
                if ticket.seq > newest.seq:
                    newest = ticket
                if not ticket.returning:
                    break
        return newest

    def remove(self, ticket: Ticket) -> None:
        queue = self.flows[ticket.flow]
        tickets = queue.blocks if self.order_steps and ticket.is_block else queue.rest
        if tickets[0] is ticket:
            tickets.popleft()
        else:
            tickets.remove(ticket)
        self.count -= 1
        self.returning -= ticket.returning
        if not queue:
            del self.flows[ticket.flow]


@dataclass(slots=True)
class _Band:
    clock: float = 0.0  # start tag of the band's last dispatch
    queues: dict[str, _TenantQueue] = field(default_factory=dict)


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
        self._seq = 0
        self.folded = 0  # requests whose document id found no flow (max_flows): default flow

    def __len__(self) -> int:
        return self.queued

    # -- admission ------------------------------------------------------------------------
    def push(self, ticket: Ticket) -> list[Ticket]:
        """Queues `ticket`; returns the tickets pushed out to make room (longest-queue drop),
        which may be `ticket` itself. Raises Rejected when its tenant's own limit is reached,
        unless `ticket` is back on a kept turn and the tenant's newest queued request came after
        it first: that one is pushed out instead."""
        self._seq += 1
        ticket.seq = ticket.first_seq or self._seq
        state = self._tenant(ticket.tenant)
        displaced = self._check_tenant(state, ticket)
        if displaced:  # the tenant may have been forgotten with the request pushed out
            state = self._tenant(ticket.tenant)
        flow = self._place(state, ticket)
        queues = self._bands.setdefault(ticket.priority, _Band()).queues
        tenant_queue = queues.get(ticket.name)
        if tenant_queue is None:
            tenant_queue = queues[ticket.name] = _TenantQueue(self.limits.order_steps)
        tenant_queue.append(ticket, flow)
        flow.queued += 1
        self._count(state, ticket, +1)
        ticket.queued = True
        return displaced + self._shed()

    def _check_tenant(self, state: _TenantState, ticket: Ticket) -> list[Ticket]:
        """Raises Rejected if the tenant's own limits leave no room for `ticket`; the tenant's
        request pushed out to make room for a returning one, if one was (never for bytes)."""
        policy = state.policy
        if policy.max_queued is None and policy.max_queued_bytes is None:
            return []
        _, queued, queued_bytes = self._others(policy.name)
        queued += state.queued
        victim = None
        limit = policy.max_queued
        if limit is not None and queued >= limit:
            victim = self._newest_of(policy.name) if ticket.returning else None
            if victim is not None and victim.seq < ticket.seq:
                # Nothing that came after it first is left: back on its turn, it waits.
                victim = None
                room = queued < RETURNING_ROOM * limit
            else:  # it takes the place of one that came after it first, if there is one
                room = victim is not None and queued <= RETURNING_ROOM * limit
            if not room:
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
        if victim is None:
            return []
        self.remove(victim)
        victim.shed_why = "tenant_queue_full"
        return [victim]

    def _newest_of(self, tenant: str) -> Ticket | None:
        """What the tenant's full queue sheds first, in its least urgent band."""
        bands = [priority for priority, band in self._bands.items() if tenant in band.queues]
        if not bands:
            return None
        return self._bands[max(bands)].queues[tenant].newest()

    def _shed(self) -> list[Ticket]:
        shed: list[Ticket] = []
        limit = self.limits.max_queued
        while self.queued > limit:
            victim = self._longest_newest(by_bytes=False)
            if victim.returning and self.queued <= RETURNING_ROOM * limit:
                break  # back on its turn, nothing that came after it first is left: it waits
            shed.append(self._drop(victim))
        while self.queued_bytes > self.limits.max_queued_bytes:
            shed.append(self._drop(self._longest_newest(by_bytes=True)))
        return shed

    def _longest_newest(self, *, by_bytes: bool) -> Ticket:
        """What a full queue sheds: the newest request (`_TenantQueue.newest`) of the tenant
        holding most of the queue for its weight."""
        state = max(
            (s for s in self._tenants.values() if s.queued),
            key=lambda s: s.share(by_bytes),
        )
        victim = self._newest_of(state.policy.name)
        assert victim is not None
        return victim

    def _drop(self, victim: Ticket) -> Ticket:
        self.remove(victim)
        victim.shed_why = "queue_full"
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
                yield tag, everywhere / state.policy.weight, tickets.head()

    def pop(self, ticket: Ticket) -> None:
        """Takes `ticket` (the head of its tenant's queue, as `next` returned it) out for
        dispatch: its tenant's clock moves on by its cost over the tenant's weight."""
        band = self._bands[ticket.priority]
        state = self._tenants[ticket.name]
        start = max(band.clock, state.finish.get(ticket.priority, 0.0))
        state.finish[ticket.priority] = start + ticket.cost / state.policy.weight
        band.clock = start
        self._unlink(ticket)
        self._started(state, ticket)

    def _started(self, state: _TenantState, ticket: Ticket) -> None:
        flow = state.flow(ticket.flow)
        flow.attained += ticket.cost
        flow.in_flight += 1
        state.in_flight += 1
        self._publish(state)

    def done(self, ticket: Ticket) -> tuple[int, int, int] | None:
        """A dispatched ticket's request has ended: its tenant may start another. Its
        document's requests (queued, in flight, done) now, if it has a flow of its own."""
        state = self._tenants.get(ticket.name)
        if state is None:
            return None
        own = state.flows.get(ticket.flow) if ticket.flow is not None else None
        flow = state.default_flow if own is None else own
        flow.in_flight = max(0, flow.in_flight - 1)
        flow.done += 1
        state.in_flight = max(0, state.in_flight - 1)
        self._publish(state)
        self._forget_if_idle(state)
        return None if own is None else (own.queued, own.in_flight, own.done)

    def remove(self, ticket: Ticket) -> None:
        """Takes a queued ticket out without serving it (its client left, it waited too long,
        or it was shed). Does nothing for a ticket no longer queued."""
        if ticket.queued:
            self._unlink(ticket)
            self._forget_if_idle(self._tenants[ticket.name])

    def _unlink(self, ticket: Ticket) -> None:
        band = self._bands[ticket.priority]
        tickets = band.queues[ticket.name]
        tickets.remove(ticket)
        state = self._tenants[ticket.name]
        flow = state.flow(ticket.flow)
        flow.queued -= 1
        if not tickets:
            del band.queues[ticket.name]
            if not band.queues:
                # An empty band keeps no clock: the next request there starts it afresh, and
                # the tenants' finish tags in it are forgotten with it.
                del self._bands[ticket.priority]
                for state in self._tenants.values():
                    state.finish.pop(ticket.priority, None)
        ticket.queued = False
        self._count(state, ticket, -1)

    # -- bookkeeping ----------------------------------------------------------------------
    def _tenant(self, policy: TenantPolicy) -> _TenantState:
        state = self._tenants.get(policy.name)
        if state is None:
            state = self._tenants[policy.name] = _TenantState(policy)
        return state

    def _place(self, state: _TenantState, ticket: Ticket) -> _Flow:
        asked = ticket.flow
        flow = state.place(ticket, self.limits.max_flows)
        if asked is not None and ticket.flow is None:
            self.folded += 1
        return flow

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

    def below_share(self, ticket: Ticket) -> bool:
        """Whether the ticket's tenant has fewer requests in flight for its weight than another
        tenant with requests in flight, or, inside its tenant, its flow fewer than another flow:
        such a request may take the room workers keep in reserve (`RoomPolicy.reserve`), so
        that it starts at the next engine step however full a flood keeps the batches."""
        mine = self._share(ticket.tenant)
        for name, other in self._tenants.items():
            if name != ticket.name and other.in_flight and self._share(other.policy) > mine:
                return True
        state = self._tenants.get(ticket.name)
        if state is None:
            return False
        if ticket.flow is None:
            own_in_flight = state.default_flow.in_flight
        else:
            own = state.flows.get(ticket.flow)
            own_in_flight = 0 if own is None else own.in_flight
        if state.default_flow.in_flight > own_in_flight:
            return True
        return any(flow.in_flight > own_in_flight for flow in state.flows.values())

    def _share(self, tenant: TenantPolicy) -> float:
        """The tenant's requests in flight, in every replica, for its weight."""
        return (self.in_flight(tenant.name) + self._others(tenant.name)[0]) / tenant.weight

    def start_unqueued(self, ticket: Ticket) -> None:
        """Counts a request dispatched at once, without queueing, against its tenant and its
        flow."""
        state = self._tenant(ticket.tenant)
        self._place(state, ticket)
        self._started(state, ticket)

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

    def flows_by_tenant(self) -> dict[str, int]:
        """Each tenant's flows with requests queued or in flight (its default flow included)."""
        return {name: state.busy_flows() for name, state in self._tenants.items()}

    def by_task(self) -> dict[str, int]:
        """Queued requests by task (layout, block, other)."""
        found: dict[str, int] = {}
        for ticket in self.tickets():
            found[ticket.task] = found.get(ticket.task, 0) + 1
        return found

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


class KeptTurns:
    """The requests refused lately, by identity, and when their `Retry-After` sends them back.

    A client that honours `Retry-After` comes back at its slot, and is queued by when it first
    came (`Ticket.first_seq`): a full queue pushes out whatever came after it first, new or
    returning, before it (`FairQueue.push`). Without this a refused request loses its place
    again to whatever arrived the moment room appeared (MinerU's client sends its next request
    the moment one ends) and runs out of retries (docs/flow-control.md, "Backpressure").
    Bounded: a turn lapses `grace_s` after its slot, and past `max_kept` the oldest go.
    """

    # `Retry-After` is its slot rounded up to whole seconds; a client's timer may fire a little
    # before a slot it was told exactly.
    EARLY_S = 0.25

    def __init__(self, grace_s: float = 120.0, max_kept: int = 65_536) -> None:
        self.grace_s = grace_s
        self.max_kept = max_kept
        # identity -> its kept turns (slot, the seq it first had), earliest slot first: requests
        # with the same body (a block every page has) are refused and come back each on its own
        self._turns: dict[bytes, list[tuple[float, int]]] = {}
        self._kept = 0
        self._lapsing: deque[tuple[float, bytes]] = deque()  # (lapses at, identity), in order

    def __len__(self) -> int:
        return self._kept

    def keep(self, identity: bytes, back_at: float, first_seq: int, now: float) -> None:
        """The refused request `identity`, to come back at `back_at`, first queued as
        `first_seq` (`Ticket.seq`)."""
        insort(self._turns.setdefault(identity, []), (back_at, first_seq))
        self._kept += 1
        self._lapsing.append((back_at + self.grace_s, identity))
        if len(self._lapsing) > 2 * self.max_kept:  # turns used up leave their entries behind
            self._lapsing = deque(
                sorted((t[0] + self.grace_s, i) for i, turns in self._turns.items() for t in turns)
            )
        self._lapse(now)
        while self._kept > self.max_kept:  # the turns of the oldest refusals go first
            _, identity = self._lapsing.popleft()
            self._drop(identity, self._turns.get(identity, [])[:1])

    def back(self, identity: bytes, now: float) -> int:
        """The seq the request first had if it is back on a kept turn now (the turn is used up
        then), else 0. One back before its slot is not: refused again, it gets a later one."""
        self._lapse(now)
        self._drop_lapsed(identity, now)
        turns = self._turns.get(identity)
        if not turns or now < turns[0][0] - self.EARLY_S:
            return 0
        _, first_seq = turns.pop(0)
        self._kept -= 1
        if not turns:
            del self._turns[identity]
        return first_seq

    def _lapse(self, now: float) -> None:
        lapsing = self._lapsing
        while lapsing and lapsing[0][0] <= now:
            _, identity = lapsing.popleft()
            self._drop_lapsed(identity, now)

    def _drop_lapsed(self, identity: bytes, now: float) -> None:
        lapsed = now - self.grace_s
        self._drop(identity, [t for t in self._turns.get(identity, ()) if t[0] <= lapsed])

    def _drop(self, identity: bytes, gone: list[tuple[float, int]]) -> None:
        if not gone:
            return
        turns = self._turns[identity]
        for turn in gone:
            turns.remove(turn)
        self._kept -= len(gone)
        if not turns:
            del self._turns[identity]


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
