"""The dispatcher over a real registry (its workers' state set by hand): waits, grants, sheds."""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from mineru_gateway.cost import Cost
from mineru_gateway.errors import ModelNotFound, NoHealthyWorker, Overloaded, ShuttingDown
from mineru_gateway.flow import FairQueue, QueueLimits, RoomPolicy, TenantPolicy
from mineru_gateway.routing import LeastInflight, WorkerView
from mineru_gateway.siblings import Doorbell, Siblings
from mineru_gateway.workers.coordination import HEAD_FRESH_S, SIBLING_POLL_S, Shared
from mineru_gateway.workers.dispatcher import Admission, Dispatcher, Grant
from mineru_gateway.workers.group_load import TENANT_WIDTH, GroupLoad, GroupTenants, QueueHeads
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

A, B = TenantPolicy("a"), TenantPolicy("b")
MODEL = "m"


def fleet(
    *urls: str, batch: int = 2, limits: QueueLimits | None = None, enabled: bool = True
) -> Dispatcher:
    registry = WorkerRegistry(
        list(urls), UpstreamClient(Timeouts(1, 1, 1)), LeastInflight(), batch_limit=batch
    )
    for worker in registry.workers:
        worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
    room = RoomPolicy(headroom=0.0, min_headroom=0)  # exactly `batch` per worker
    return Dispatcher(registry, FairQueue(limits), room, enabled=enabled)


def ask(tenant: TenantPolicy = A, priority: int = 0, model: str | None = MODEL) -> Admission:
    return Admission(tenant, priority, Cost(prefill=0.0, hold=1.0), 100, model)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_request_with_room_is_granted_at_once() -> None:
    dispatcher = fleet("http://w0", "http://w1")
    grant = await dispatcher.acquire(ask())
    assert grant.queued_s == 0.0
    assert sum(w.in_flight for w in dispatcher.registry.workers) == 1
    grant.release()
    grant.release()  # idempotent
    assert sum(w.in_flight for w in dispatcher.registry.workers) == 0
    assert dispatcher.queue.in_flight("a") == 0


async def test_waiters_are_served_fairly_as_room_frees() -> None:
    dispatcher = fleet("http://w0", batch=2)
    running = [await dispatcher.acquire(ask(A)) for _ in range(2)]
    flood = [asyncio.ensure_future(dispatcher.acquire(ask(A))) for _ in range(20)]
    await settle()
    latecomer = asyncio.ensure_future(dispatcher.acquire(ask(B)))
    await settle()
    assert len(dispatcher.queue) == 21 and not latecomer.done()
    running.pop(0).release()  # one slot frees: B's request goes before A's 20
    await settle()
    assert latecomer.done() and not any(task.done() for task in flood)
    grant = latecomer.result()
    assert grant.lease.worker.url == "http://w0" and grant.queued_s >= 0
    for task in flood:
        task.cancel()
    await settle()
    assert dispatcher.queue.is_idle()


async def test_the_worker_is_chosen_when_room_appears() -> None:
    dispatcher = fleet("http://w0", "http://w1", batch=1)
    first = await dispatcher.acquire(ask())
    second = await dispatcher.acquire(ask())
    assert {first.lease.worker.url, second.lease.worker.url} == {"http://w0", "http://w1"}
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    second.release()
    granted = await asyncio.wait_for(waiting, 1)
    assert granted.lease.worker.url == second.lease.worker.url  # the one with room now


async def test_a_cancelled_waiter_leaves_the_queue_at_once() -> None:
    dispatcher = fleet("http://w0", batch=1)
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    assert len(dispatcher.queue) == 1
    waiting.cancel()
    await settle()
    assert dispatcher.queue.is_idle() and dispatcher.queue.queued_bytes == 0
    holder.release()
    assert dispatcher.registry.workers[0].in_flight == 0


async def test_a_waiter_cancelled_as_it_is_granted_gives_its_lease_back() -> None:
    dispatcher = fleet("http://w0", batch=1)
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    holder.release()  # grants the waiter's future synchronously...
    waiting.cancel()  # ...and its task is cancelled before it resumes
    await settle()
    assert waiting.cancelled()
    assert dispatcher.registry.workers[0].in_flight == 0
    assert dispatcher.queue.in_flight("a") == 0


async def test_a_request_that_waits_too_long_gets_429_with_retry_after() -> None:
    dispatcher = fleet("http://w0", batch=1, limits=QueueLimits(max_wait_s=0.05))
    await dispatcher.acquire(ask())
    with pytest.raises(Overloaded) as error:
        await dispatcher.acquire(ask())
    assert error.value.status == 429 and error.value.reason == "queue_timeout"
    assert error.value.headers()[0][0] == b"retry-after"
    assert dispatcher.queue.is_idle()


async def test_a_full_queue_sheds_the_flooding_tenant() -> None:
    dispatcher = fleet("http://w0", batch=1, limits=QueueLimits(max_queued=3))
    await dispatcher.acquire(ask())
    flood = [asyncio.ensure_future(dispatcher.acquire(ask(A))) for _ in range(3)]
    await settle()
    other = asyncio.ensure_future(dispatcher.acquire(ask(B)))
    await settle()
    assert isinstance(flood[-1].exception(), Overloaded)
    assert flood[-1].exception().reason == "queue_full"  # type: ignore[union-attr]
    assert not other.done()
    for task in (*flood[:2], other):
        task.cancel()
    await settle()


async def test_queued_requests_get_503_when_no_worker_is_healthy() -> None:
    dispatcher = fleet("http://w0", batch=1)
    await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    worker = dispatcher.registry.workers[0]
    dispatcher.registry.checks.set_health(worker, False, "gone")
    await settle()
    assert isinstance(waiting.exception(), NoHealthyWorker)
    with pytest.raises(NoHealthyWorker):
        await dispatcher.acquire(ask())


async def test_closing_answers_every_waiter_and_every_newcomer_with_503() -> None:
    dispatcher = fleet("http://w0", batch=1)
    await dispatcher.acquire(ask())
    waiting = [asyncio.ensure_future(dispatcher.acquire(ask())) for _ in range(3)]
    await settle()
    dispatcher.close()
    await settle()
    assert all(isinstance(task.exception(), ShuttingDown) for task in waiting)
    with pytest.raises(ShuttingDown):
        await dispatcher.acquire(ask())


async def test_without_flow_control_every_request_goes_at_once() -> None:
    dispatcher = fleet("http://w0", batch=1, enabled=False)
    grants = [await dispatcher.acquire(ask()) for _ in range(5)]
    assert dispatcher.registry.workers[0].in_flight == 5
    for grant in grants:
        grant.release()
    assert dispatcher.registry.workers[0].in_flight == 0


async def test_a_retry_takes_another_worker_without_queueing() -> None:
    dispatcher = fleet("http://w0", "http://w1", batch=1)
    first = await dispatcher.acquire(ask())
    other = await dispatcher.acquire(ask())
    other.release()
    retried: Grant = dispatcher.retry(first, ask(), exclude=[first.lease.worker.url])
    assert retried.lease.worker.url != first.lease.worker.url
    assert first.lease.released and dispatcher.queue.in_flight("a") == 1
    retried.release()
    with pytest.raises(NoHealthyWorker):
        dispatcher.retry(retried, ask(), exclude=["http://w0", "http://w1"])


async def test_a_waiter_cancelled_just_before_room_appears_is_not_served() -> None:
    dispatcher = fleet("http://w0", batch=1)
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    behind = asyncio.ensure_future(dispatcher.acquire(ask(B)))
    await settle()
    waiting.cancel()  # its future is cancelled now; its task runs its handler later...
    holder.release()  # ...after this pump, which must pass it over
    await settle()
    assert waiting.cancelled()
    assert behind.done() and dispatcher.registry.workers[0].in_flight == 1
    behind.result().release()
    assert dispatcher.queue.is_idle() and dispatcher.registry.workers[0].in_flight == 0


async def test_queued_requests_for_a_model_no_worker_serves_any_more_get_404() -> None:
    dispatcher = fleet("http://w0", "http://w1", batch=1)
    w0, w1 = dispatcher.registry.workers
    w1.models = {"other": {"id": "other"}}
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    w0.models = {}  # w0 now serves nothing: no healthy worker serves MODEL
    holder.release()
    await settle()
    assert isinstance(waiting.exception(), ModelNotFound)
    assert dispatcher.queue.is_idle()


async def test_queued_requests_for_a_model_whose_workers_are_ejected_get_503() -> None:
    """The model is still known (its worker is a member, out of routing for now): the
    requests may come back later, unlike those for a model no member serves."""
    dispatcher = fleet("http://w0", "http://w1", batch=1)
    w0, w1 = dispatcher.registry.workers
    w1.models = {"other": {"id": "other"}}
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    dispatcher.registry.checks.set_health(w0, False, "gone")  # w1 alone is healthy
    holder.release()
    await settle()
    error = waiting.exception()
    assert isinstance(error, NoHealthyWorker) and error.retry_after_s is not None
    assert dispatcher.queue.is_idle()
    with pytest.raises(NoHealthyWorker):
        await dispatcher.acquire(ask())
    with pytest.raises(ModelNotFound):
        await dispatcher.acquire(ask(model="never-served"))


class LockProbe:
    """A routing policy that notes, at each choice, whether the processes' table is locked
    (another open file of it cannot take the lock), then picks the least loaded."""

    name = "lock_probe"

    def __init__(self, table: Path) -> None:
        self._fd = os.open(table, os.O_RDWR)
        self.locked: list[bool] = []

    def held(self) -> bool:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return False

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        self.locked.append(self.held())
        return min(candidates, key=lambda view: view.in_flight)

    def close(self) -> None:
        os.close(self._fd)


async def test_with_sibling_processes_every_decision_holds_the_table(tmp_path: Path) -> None:
    """Requests ending in one engine step bring two processes their next requests at once: each
    decision, from the views to the lease, holds the table, at once, from the queue or again."""
    group = GroupLoad(tmp_path / "t", 2, 0)
    probe = LockProbe(tmp_path / "t")
    registry = WorkerRegistry(
        ["http://w0", "http://w1"],
        UpstreamClient(Timeouts(1, 1, 1)),
        probe,
        batch_limit=1,
        group=group,
    )
    for worker in registry.workers:
        worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
    coordination = Shared(group, QueueHeads(tmp_path / "heads", 2, 0), ring=lambda index: None)
    room = RoomPolicy(headroom=0.0, min_headroom=0)
    dispatcher = Dispatcher(registry, FairQueue(), room, coordination=coordination)
    first = await dispatcher.acquire(ask())  # at once
    second = await dispatcher.acquire(ask())
    queued = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    first.release()  # the queue is served
    third = await asyncio.wait_for(queued, 1)
    again = dispatcher.retry(second, ask(), exclude=[second.lease.worker.url])
    assert probe.locked == [True] * 4
    assert not probe.held()  # and let go after each
    for grant in (third, again):
        grant.release()
    probe.close()


async def test_a_waiting_queue_takes_room_a_sibling_process_left_without_an_event(
    tmp_path: Path,
) -> None:
    """Room another process's request leaves shows only in the shared table: a process whose
    requests wait looks again every SIBLING_POLL_S rather than at its own next release or
    reading (none come here: no reads, no requests of its own)."""

    def process(index: int) -> Dispatcher:
        table = GroupLoad(tmp_path / "t", 2, index)
        registry = WorkerRegistry(
            ["http://w0"],
            UpstreamClient(Timeouts(1, 1, 1)),
            LeastInflight(),
            batch_limit=1,
            group=table,
        )
        worker = registry.workers[0]
        worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
        heads = QueueHeads(tmp_path / "heads", 2, index)
        coordination = Shared(table, heads, ring=lambda index: None)  # no rings: only looks
        room = RoomPolicy(headroom=0.0, min_headroom=0)
        return Dispatcher(registry, FairQueue(), room, coordination=coordination)

    first, second = process(0), process(1)
    held = await first.acquire(ask())
    waiting = asyncio.ensure_future(second.acquire(ask()))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # the worker's one slot is the first process's
    held.release()
    granted = await asyncio.wait_for(waiting, 1)
    assert granted.lease.worker.url == "http://w0" and granted.queued_s >= 0.1
    granted.release()


@pytest.fixture
def doorbells() -> Iterator[list[Doorbell]]:
    rung: list[Doorbell] = []
    yield rung
    for doorbell in rung:
        doorbell.close()


def sibling(
    tmp_path: Path,
    doorbells: list[Doorbell],
    index: int,
    *,
    batch: int,
    count: int = 2,
    poll_s: float = SIBLING_POLL_S,
) -> Dispatcher:
    """Process `index` of `count` gateway processes over one worker, sharing what
    `serve --processes N` shares: the workers' and tenants' counts, the queue heads and the
    doorbells."""
    table = GroupLoad(tmp_path / "workers", count, index)
    registry = WorkerRegistry(
        ["http://w0"],
        UpstreamClient(Timeouts(1, 1, 1)),
        LeastInflight(),
        batch_limit=batch,
        group=table,
    )
    worker = registry.workers[0]
    worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
    tenants = GroupTenants(GroupLoad(tmp_path / "tenants", count, index, width=TENANT_WIDTH))
    doorbell = Siblings(index, count, tmp_path).doorbell()
    doorbells.append(doorbell)
    dispatcher = Dispatcher(
        registry,
        FairQueue(elsewhere=tenants),
        RoomPolicy(headroom=0.0, min_headroom=0),
        coordination=Shared(
            table, QueueHeads(tmp_path / "heads", count, index, tenants), doorbell.ring, poll_s
        ),
    )
    doorbell.listen(dispatcher.pump)
    return dispatcher


def pair(
    tmp_path: Path, doorbells: list[Doorbell], *, batch: int, poll_s: float = SIBLING_POLL_S
) -> list[Dispatcher]:
    return [sibling(tmp_path, doorbells, index, batch=batch, poll_s=poll_s) for index in range(2)]


async def test_room_goes_to_the_most_urgent_request_of_any_process(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """A's batch holds the worker through the first process and queues more there; B's request
    waits in the second. Room that A's request leaves goes to B (a tenant with nothing in
    flight), though the first process's own queue would have taken it at once."""
    first, second = pair(tmp_path, doorbells, batch=3)
    held = [await first.acquire(ask(A)) for _ in range(3)]
    a_waits = asyncio.ensure_future(first.acquire(ask(A)))
    b_waits = asyncio.ensure_future(second.acquire(ask(B)))
    await asyncio.sleep(0.05)  # both queued, heads posted
    held.pop().release()
    b = await asyncio.wait_for(b_waits, 1)
    assert not a_waits.done()
    held.pop().release()  # no head waits elsewhere now: the first process's own request goes
    a = await asyncio.wait_for(a_waits, 1)
    for grant in (*held, a, b):
        grant.release()


async def test_a_more_urgent_band_in_another_process_goes_first(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    first, second = pair(tmp_path, doorbells, batch=1)
    held = await first.acquire(ask(A))
    background = asyncio.ensure_future(first.acquire(ask(B, priority=5)))
    urgent = asyncio.ensure_future(second.acquire(ask(A, priority=-1)))
    await asyncio.sleep(0.05)
    held.release()
    grant = await asyncio.wait_for(urgent, 1)
    assert not background.done()
    grant.release()
    (await asyncio.wait_for(background, 1)).release()


async def test_a_newcomer_does_not_take_room_a_more_urgent_request_waits_for(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """The first process has nothing queued when room appears, but B waits in the second:
    A's next request, arriving before the second process looks again, queues behind it."""
    first, second = pair(tmp_path, doorbells, batch=2)
    held = [await first.acquire(ask(A)) for _ in range(2)]
    b_waits = asyncio.ensure_future(second.acquire(ask(B)))
    await asyncio.sleep(0.05)
    held.pop().release()
    a_next = asyncio.ensure_future(first.acquire(ask(A)))
    await settle()
    assert not a_next.done()
    b = await asyncio.wait_for(b_waits, 1)
    held.pop().release()
    (await asyncio.wait_for(a_next, 1)).release()
    b.release()


async def test_room_does_not_wait_for_a_head_its_process_stopped_posting(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """A process that died (or hangs) with a request queued leaves its last head posted: after
    HEAD_FRESH_S it is ignored and the room is used here."""
    first = sibling(tmp_path, doorbells, 0, batch=1)
    dead = QueueHeads(tmp_path / "heads", 2, 1)
    held = await first.acquire(ask(A))
    waiting = asyncio.ensure_future(first.acquire(ask(A)))
    await settle()
    dead.post(first.now(), -10, "b", 1.0, 0.0, None, queued_at=first.now())  # and no more
    held.release()
    grant = await asyncio.wait_for(waiting, 1)
    assert grant.queued_s >= HEAD_FRESH_S
    grant.release()


async def test_more_room_than_urgent_heads_is_used_at_once(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """One request waiting elsewhere holds back one request's room, not all of it."""
    first, second = pair(tmp_path, doorbells, batch=3)
    held = [await first.acquire(ask(A)) for _ in range(3)]
    b_waits = asyncio.ensure_future(second.acquire(ask(B)))
    a_waits = [asyncio.ensure_future(first.acquire(ask(A))) for _ in range(2)]
    await asyncio.sleep(0.05)
    held.pop().release()
    held.pop().release()  # two free: one is B's, one the first process's next request
    await settle()
    assert sum(task.done() for task in a_waits) == 1
    b = await asyncio.wait_for(b_waits, 1)
    grants = [task.result() for task in a_waits if task.done()]
    for grant in (*held, *grants, b):
        grant.release()
    for task in a_waits:
        if not task.done():
            (await asyncio.wait_for(task, 1)).release()


async def test_room_is_not_left_for_long_to_a_process_that_does_not_take_it(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """The processes' views of a worker can differ for a while (each probes health itself,
    learns batch sizes from readings): a head that keeps posting but does not take the room
    left for it is passed over after HEAD_FRESH_S. Here the second process counts a batch of
    one, the first a batch of two."""
    first = sibling(tmp_path, doorbells, 0, batch=2)
    second = sibling(tmp_path, doorbells, 1, batch=1)
    held = await first.acquire(ask(A))
    blocked = asyncio.ensure_future(second.acquire(ask(B)))
    await asyncio.sleep(0.05)
    assert not blocked.done()  # no room in its view: it waits, posting its head
    grant = await asyncio.wait_for(first.acquire(ask(A)), 1)
    assert grant.queued_s >= HEAD_FRESH_S
    assert not blocked.done()
    blocked.cancel()
    for lease in (held, grant):
        lease.release()


async def test_room_a_process_has_no_request_for_is_rung_over_to_a_waiting_sibling(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """With its look at the table taken out (a 10 s poll), the second process's request is
    served when the first one's request ends only because the first rings it."""
    first, second = pair(tmp_path, doorbells, batch=1, poll_s=10.0)
    held = await first.acquire(ask(A))
    waiting = asyncio.ensure_future(second.acquire(ask(B)))
    await settle()
    held.release()
    grant = await asyncio.wait_for(waiting, 1)
    assert grant.queued_s < 1
    grant.release()


async def test_a_process_holding_no_room_is_not_starved_by_one_that_holds_it_all(
    tmp_path: Path, doorbells: list[Doorbell]
) -> None:
    """The same tenant queues in both processes; the first holds the worker's only slot and
    would refill it from its own queue at every release. The request that has waited longer,
    in the second process, goes first: it is not left waiting until the first's queue runs
    dry."""
    first, second = pair(tmp_path, doorbells, batch=1, poll_s=10.0)  # only rings wake a queue
    held = await first.acquire(ask(A))
    older = asyncio.ensure_future(second.acquire(ask(A)))
    await asyncio.sleep(0.01)
    newer = asyncio.ensure_future(first.acquire(ask(A)))
    await settle()
    held.release()
    grant = await asyncio.wait_for(older, 1)
    assert not newer.done()
    grant.release()  # and back: the first process's request is the only one left
    (await asyncio.wait_for(newer, 1)).release()
