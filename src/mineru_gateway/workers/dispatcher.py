"""The dispatcher: where a request waits for room on a worker, and gets a lease on one.

It drives the pure queue in `flow.py` with the registry's live views (docs/flow-control.md).
`acquire` returns at once when nothing is queued and a worker has room (a single user sees no
queue at all); otherwise the request waits in the fair queue, and whenever room may have appeared
(a request ended, fresh load figures, a worker came back) `pump` hands the next requests their
workers, chosen at that moment by the routing policy among the workers with room (late binding).

A lease is taken the moment a ticket is served, before its waiter resumes, so one pump cannot
overfill a worker; a waiter cancelled at that very moment gives its lease back. Every queued
request ends one way: served, shed (429 `Retry-After`), timed out in the queue (429), failed
because no worker is healthy (503) or because the gateway is shutting down (503), or left by its
client (taken out of the queue at once).

With fleet state (`fleet`, fleet/slots.py), a request of a tenant with `max_in_flight` also needs
one of the tenant's slots in Redis, shared by every replica, before it may go to a worker: taken
as it arrives (one round trip), or, when the tenant is at its limit fleet-wide, asked for again
every `fleet.poll_s` while its requests wait (docs/operate/fleet-state.md). Slots held for a
tenant's queue go to whichever of its requests the queue serves next; a slot goes back when its
request ends, or when the tenant has fewer requests queued than slots held for them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from mineru_gateway.cost import Cost
from mineru_gateway.errors import (
    GatewayError,
    NoHealthyWorker,
    Overloaded,
    ShuttingDown,
    WorkersBusy,
)
from mineru_gateway.fleet.slots import FleetSlots, Permit
from mineru_gateway.fleet.tenants import FleetTenants
from mineru_gateway.flow import (
    CostDrain,
    DrainRate,
    FairQueue,
    KeptTurns,
    Rejected,
    RoomPolicy,
    TenantPolicy,
    Ticket,
)
from mineru_gateway.prompts import PromptKind
from mineru_gateway.routing import WorkerView
from mineru_gateway.values import value
from mineru_gateway.workers.fleet_index import ANY_ROOM
from mineru_gateway.workers.registry import Lease, Worker, WorkerRegistry


@value
class Admission:
    """What a request brings to the queue."""

    tenant: TenantPolicy
    priority: int
    cost: Cost
    size: int  # request body bytes
    model: str | None
    document: str | None = None  # its flow inside the tenant (flow.py)
    kind: PromptKind = PromptKind.OTHER
    # The same request sent again has the same identity (its cache key): a refused one keeps
    # its turn by it (flow.py's KeptTurns). None: it keeps none.
    identity: bytes | None = None


class Grant:
    """A request's lease on a worker, plus its ticket's accounting; `release()` ends both."""

    __slots__ = ("_dispatcher", "document_counts", "lease", "permit", "queued_s", "ticket")

    def __init__(
        self,
        dispatcher: Dispatcher,
        ticket: Ticket,
        lease: Lease,
        queued_s: float,
        permit: Permit | None = None,
    ) -> None:
        self._dispatcher = dispatcher
        self.ticket = ticket
        self.lease = lease
        self.queued_s = queued_s
        self.permit = permit  # the tenant's fleet-wide slot, if it needs one
        # Its document's requests (queued, in flight, done) as it ended (flow.py).
        self.document_counts: tuple[int, int, int] | None = None

    def release(self) -> None:
        if not self.lease.released:
            dispatcher = self._dispatcher
            self.document_counts = dispatcher.queue.done(self.ticket)
            dispatcher.finished(self.ticket)
            if self.permit is not None:
                dispatcher.give_back(self.permit)
                self.permit = None
            self.lease.release()  # the registry tells the dispatcher: pump


class _Waiter:
    __slots__ = ("admission", "future", "timer")

    def __init__(self, admission: Admission, future: asyncio.Future[Grant]) -> None:
        self.admission = admission
        self.future = future
        self.timer: asyncio.TimerHandle | None = None


class Dispatcher:
    def __init__(
        self,
        registry: WorkerRegistry,
        queue: FairQueue,
        room: RoomPolicy,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        fleet: FleetSlots | None = None,
        fleet_tenants: FleetTenants | None = None,
    ) -> None:
        """`fleet`: tenants' in-flight slots shared by
        every replica; None counts them in this process only. `fleet_tenants`: the queue's
        counts shared with the other replicas (started and stopped with the dispatcher)."""
        self.registry = registry
        self.routing = registry.routing  # the views, the choice and the leases (views.py)
        self.fleet = fleet
        self.fleet_tenants = fleet_tenants
        self.queue = queue
        self.room = room
        self.enabled = enabled
        self.drain_rate = DrainRate()
        self.cost_drain = CostDrain()
        self.turns = KeptTurns()
        self._seeking: asyncio.Task[None] | None = None  # `_seek_slots`, while it runs
        # Tenant -> fleet-wide slots held for its queued requests: a tenant's slots are alike,
        # so the one its queue serves next takes one, whichever request brought it.
        self._spare: dict[str, list[Permit]] = {}
        self._clock = clock
        self._pumping = False
        self._closed: GatewayError | None = None
        self._served: frozenset[str] = frozenset()
        registry.membership.on_change(self.pump)

    def now(self) -> float:
        return self._clock()

    def finished(self, ticket: Ticket) -> None:
        """A dispatched request ended: the pace the fleet works the queue off."""
        now = self._clock()
        self.drain_rate.record(now)
        self.cost_drain.record(ticket.model, ticket.cost, now)

    async def start(self) -> None:
        if self.fleet is not None:
            await self.fleet.start()
        if self.fleet_tenants is not None:
            await self.fleet_tenants.start()

    async def stop(self) -> None:
        if self._seeking is not None:
            self._seeking.cancel()
            await asyncio.gather(self._seeking, return_exceptions=True)
        if self.fleet is not None:
            await self.fleet.close()
        if self.fleet_tenants is not None:
            await self.fleet_tenants.close()

    # -- the relay's side -----------------------------------------------------------------
    async def acquire(self, admission: Admission) -> Grant:
        """A lease on a worker for this request: at once if one has room and nobody waits,
        else when the fair queue serves it. Raises Overloaded, NoHealthyWorker, ModelNotFound
        or ShuttingDown."""
        # Without fleet state no slot is taken: no coroutine to make and await for one.
        permit = None if self.fleet is None else await self._take_slot(admission.tenant)
        try:
            now = self._now_or_ticket(admission, permit)
        except BaseException:
            self.give_back(permit)
            raise
        return now if isinstance(now, Grant) else await self._wait(now, admission, permit)

    # -- fleet-wide slots -----------------------------------------------------------------
    def _needs_slot(self, tenant: TenantPolicy) -> bool:
        return self.fleet is not None and self.enabled and tenant.max_in_flight is not None

    async def _take_slot(self, tenant: TenantPolicy) -> Permit | None:
        """The tenant's fleet-wide slot, if it needs one and one is free now (one round trip)."""
        if self.fleet is None or not self._needs_slot(tenant):
            return None
        taken = await self.fleet.take(tenant, 1)
        return taken[0] if taken else None

    def give_back(self, permit: Permit | None) -> None:
        if permit is not None and self.fleet is not None:
            self.fleet.release(permit)

    def _has_slot(self, ticket: Ticket) -> bool:
        return not self._needs_slot(ticket.tenant) or bool(self._spare.get(ticket.name))

    def _spare_slot(self, ticket: Ticket) -> Permit | None:
        """One of the slots held for the tenant's queue, for `ticket`, about to be served."""
        spare = self._spare.get(ticket.name)
        if not spare:
            return None
        permit = spare.pop()
        if not spare:
            del self._spare[ticket.name]
        return permit

    def _keep_spare(self, tenant: str, permits: list[Permit]) -> None:
        """Slots for the tenant's queued requests; more than it has queued go back."""
        if permits:
            self._spare.setdefault(tenant, []).extend(permits)
        self._trim_spare(tenant)

    def _trim_spare(self, tenant: str) -> None:
        spare = self._spare.get(tenant)
        if spare is None:
            return
        while len(spare) > self.queue.queued_of(tenant):
            self.give_back(spare.pop())
        if not spare:
            del self._spare[tenant]

    def _seek_slots(self) -> None:
        """Queued requests of tenants at their fleet-wide limit ask for slots until they have
        them (one task for all)."""
        if self._seeking is None:
            self._seeking = asyncio.get_running_loop().create_task(self._seeking_slots())

    async def _seeking_slots(self) -> None:
        try:
            while (wanting := self._wanting_slots()) and self.fleet is not None:
                short = False
                for tenant, wanted in wanting:
                    permits = await self.fleet.take(tenant, wanted)
                    self._keep_spare(tenant.name, permits)
                    short = short or len(permits) < wanted
                self.pump()
                if short:
                    await asyncio.sleep(self.fleet.poll_s)
        finally:
            self._seeking = None

    def _wanting_slots(self) -> list[tuple[TenantPolicy, int]]:
        """Each tenant whose queued requests lack slots, and how many it lacks (up to its
        limit)."""
        wanting = []
        for tenant, queued in self.queue.queued_tenants():
            if self._needs_slot(tenant):
                limit = tenant.max_in_flight or 0
                lacking = min(queued, limit) - len(self._spare.get(tenant.name, ()))
                if lacking > 0:
                    wanting.append((tenant, lacking))
        return wanting

    def _now_or_ticket(self, admission: Admission, permit: Permit | None) -> Grant | Ticket:
        """A grant at once, or the ticket the request queues with."""
        offer = self.routing.offer(admission.model, self.room if self.enabled else ANY_ROOM)
        if self._closed is not None:
            raise self._closed
        ticket = Ticket(
            admission.tenant,
            admission.priority,
            admission.cost.total,
            admission.size,
            self._clock(),
            admission.model,
            admission.document,
            admission.kind,
        )
        if not self.enabled:
            worker = self.routing.choose_among(offer.views)
            return self._grant(ticket, worker, admission, 0.0, unqueued=True)
        slotted = permit is not None or not self._needs_slot(admission.tenant)
        views = self._open(ticket, offer.views) if offer.roomy else []
        if views and slotted and self.queue.is_idle() and self.queue.may_start(admission.tenant):
            worker = self.routing.choose_among(views)
            return self._grant(ticket, worker, admission, 0.0, unqueued=True, permit=permit)
        return ticket

    async def _wait(self, ticket: Ticket, admission: Admission, permit: Permit | None) -> Grant:
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(admission, future)
        ticket.handle = waiter
        if self.turns and admission.identity is not None:
            ticket.first_seq = self.turns.back(admission.identity, self._clock())
        try:
            shed = self.queue.push(ticket)
        except Rejected as rejected:
            self.give_back(permit)
            raise self._refuse(ticket, rejected.why, str(rejected)) from None
        if permit is not None:
            self._keep_spare(ticket.name, [permit])
        for victim in shed:
            self._fail(victim, self._refuse(victim, victim.shed_why, SHED[victim.shed_why]))
        if not ticket.queued:
            return await future  # shed at once: the future carries the error
        waiter.timer = asyncio.get_running_loop().call_later(
            self.queue.limits.max_wait_s, self._expire, ticket
        )
        if self._needs_slot(ticket.tenant):
            self._seek_slots()
        self.pump()
        try:
            return await future
        except asyncio.CancelledError:
            self._abandon(ticket, future)
            raise

    def retry(self, grant: Grant, admission: Admission, exclude: list[str]) -> Grant:
        """Another worker for a request whose attempt failed before any byte of an answer: at
        once, without queueing again (it has had its turn). Raises NoHealthyWorker when no
        untried worker is left."""
        worker = self.routing.choose(admission.model, exclude, self.room)
        permit, grant.permit = grant.permit, None  # the request keeps its slot
        grant.release()
        return self._grant(
            grant.ticket, worker, admission, grant.queued_s, unqueued=True, permit=permit
        )

    async def bounce(self, grant: Grant, admission: Admission) -> Grant:
        """Another place for a request whose worker refused it because its own queue is full
        (that worker is held back, health.py): at once on a worker with room, else back in the
        queue, where it waits under its usual limits. Without flow control there is no queue:
        raises WorkersBusy when no worker has room."""
        offer = self.routing.offer(admission.model, self.room if self.enabled else ANY_ROOM)
        if offer.roomy:
            worker = self.routing.choose_among(offer.views)
            permit, grant.permit = grant.permit, None  # the request keeps its slot
            grant.release()
            return self._grant(
                grant.ticket, worker, admission, grant.queued_s, unqueued=True, permit=permit
            )
        grant.release()
        if not self.enabled:
            raise WorkersBusy(
                "every worker's own queue is full; retry later",
                retry_after_s=self.registry.health.busy_hold_s,
            )
        again = await self.acquire(admission)
        again.queued_s += grant.queued_s
        return again

    def _abandon(self, ticket: Ticket, future: asyncio.Future[Grant]) -> None:
        """The waiter went away (its client disconnected): leave the queue at once, or give
        back a lease granted in the same instant."""
        self._stop_timer(ticket)
        if future.done() and not future.cancelled() and future.exception() is None:
            future.result().release()
        else:
            self._remove(ticket)

    def _remove(self, ticket: Ticket) -> None:
        """Takes a ticket out of the queue unserved; its fleet-wide slot goes back."""
        self.queue.remove(ticket)
        self._trim_spare(ticket.name)

    # -- serving the queue ----------------------------------------------------------------
    def pump(self) -> None:
        """Serves queued requests while workers have room. Re-entry is a no-op: granting a
        lease can itself report a change."""
        if self._pumping or not self.enabled:
            return
        if not self.queue.is_idle():
            self._pumping = True
            try:
                self._serve()
            finally:
                self._pumping = False

    def _serve(self) -> None:
        while not self.queue.is_idle() and self._serve_one():
            pass

    def _serve_one(self) -> bool:
        """Grants the next queued request a lease (or drops one whose client just left); False
        when nothing more can be served now."""
        if not self.routing.index.any_routable(self.room):
            self.fail_all(NoHealthyWorker("no healthy worker is available; retry later"))
            return False
        self._fail_unservable()
        roomy, models = self.routing.index.roomy_models(self.room)
        if not roomy:
            return False
        ticket = self.queue.next(
            lambda ticket: (
                (ticket.model is None or ticket.model in models)
                and self._has_slot(ticket)
                and self._has_open_room(ticket)
            )
        )
        if ticket is None:
            return False
        offer = self.routing.offer(ticket.model, self.room)
        views = self._open(ticket, offer.views) if offer.roomy else []
        if not views:
            return False
        waiter = _waiter(ticket)
        self._stop_timer(ticket)
        if waiter.future.done():
            # Its task was cancelled in this very instant (the client left) and has not run its
            # handler yet: it must not be served.
            self._remove(ticket)
            return True
        self.queue.pop(ticket)
        worker = self.routing.choose_among(views)
        queued_s = self._clock() - ticket.enqueued_at
        permit = self._spare_slot(ticket)
        grant = self._grant(ticket, worker, waiter.admission, queued_s, permit=permit)
        waiter.future.set_result(grant)
        return True

    def _open(self, ticket: Ticket, views: list[WorkerView]) -> list[WorkerView]:
        """The workers among `views` (with room: a roomy offer's) the ticket may go to: all for
        a request below its share, else those with room beyond their reserve
        (flow.RoomPolicy.reserve)."""
        room = self.room
        if not room.reserve:
            return views
        open_views = [view for view in views if room.beyond_reserve(view)]
        # Only when the reserve is all some worker has left does the ticket's share matter: a
        # walk of the tenants and the tenant's flows (`FairQueue.below_share`).
        if len(open_views) == len(views) or self.queue.below_share(ticket):
            return views
        return open_views

    def _has_open_room(self, ticket: Ticket) -> bool:
        """Whether some worker has room the ticket may take (`_open`)."""
        room = self.room
        if not room.reserve or self.queue.below_share(ticket):
            return True
        offer = self.routing.offer(ticket.model, room)
        return offer.roomy and any(room.has_open_room(view) for view in offer.views)

    def _fail_unservable(self) -> None:
        """Queued requests for a model no healthy worker serves any more cannot wait for room.
        Looked for only when the models the healthy workers serve have changed."""
        served = self.routing.index.routable_models(self.room)
        if served == self._served:
            return
        self._served = served
        for ticket in list(self.queue.tickets()):
            if ticket.model is not None and ticket.model not in served:
                self._fail(ticket, self.routing.why_no_candidate(ticket.model))

    def _grant(
        self,
        ticket: Ticket,
        worker: Worker,
        admission: Admission,
        queued_s: float,
        *,
        unqueued: bool = False,
        permit: Permit | None = None,
    ) -> Grant:
        if unqueued:
            self.queue.start_unqueued(ticket)
        lease = self.routing.acquire(worker, admission.cost)
        return Grant(self, ticket, lease, queued_s, permit)

    # -- ending waits that will not be served -------------------------------------------
    def _expire(self, ticket: Ticket) -> None:
        waiter = _waiter(ticket)
        waiter.timer = None
        wait = self.queue.limits.max_wait_s
        self._fail(ticket, self._refuse(ticket, "queue_timeout", f"waited {wait:g} s in the queue"))

    def _fail(self, ticket: Ticket, error: GatewayError) -> None:
        self._remove(ticket)
        self._stop_timer(ticket)
        waiter = _waiter(ticket)
        if not waiter.future.done():
            waiter.future.set_exception(error)

    def fail_all(self, error: GatewayError) -> None:
        for ticket in list(self.queue.tickets()):
            self._fail(ticket, error)

    def close(self, error: GatewayError | None = None) -> None:
        """From now on nothing is queued; whatever still waits gets `error` (503)."""
        self._closed = error or ShuttingDown("the gateway is shutting down; retry later")
        self.fail_all(self._closed)

    def _refuse(self, ticket: Ticket, why: str, detail: str) -> Overloaded:
        """The 429 for a queued or arriving request; by its identity, the request keeps its
        turn for when its `Retry-After` sends it back (flow.py's KeptTurns)."""
        error = self._overloaded(why, detail)
        identity = _waiter(ticket).admission.identity
        if identity is not None:
            now = self._clock()
            self.turns.keep(identity, now + (error.retry_after_s or 0.0), ticket.seq, now)
        return error

    def _overloaded(self, why: str, detail: str) -> Overloaded:
        now = self._clock()
        retry = self.drain_rate.retry_after(len(self.queue), now)
        return Overloaded(
            f"the gateway is overloaded ({detail}); retry after {retry:.0f} s",
            why=why,
            retry_after_s=retry,
        )

    def _stop_timer(self, ticket: Ticket) -> None:
        waiter = _waiter(ticket)
        if waiter.timer is not None:
            waiter.timer.cancel()
            waiter.timer = None


# What a request pushed out of the queue is told, by why (flow.py's `Ticket.shed_why`).
SHED = {
    "queue_full": "the gateway's queue is full",
    "tenant_queue_full": "its tenant's queue is full",
}


def _waiter(ticket: Ticket) -> _Waiter:
    waiter = ticket.handle
    assert isinstance(waiter, _Waiter)
    return waiter
