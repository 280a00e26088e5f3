"""The dispatcher over a real registry (its workers' state set by hand): waits, grants, sheds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from mineru_gateway.cost import Cost
from mineru_gateway.errors import ModelNotFound, NoHealthyWorker, Overloaded, ShuttingDown
from mineru_gateway.flow import FairQueue, QueueLimits, RoomPolicy, TenantPolicy
from mineru_gateway.routing import LeastInflight
from mineru_gateway.workers.dispatcher import Admission, Dispatcher, Grant
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

pytestmark = pytest.mark.unit

A, B = TenantPolicy("a"), TenantPolicy("b")
MODEL = "m"


def fleet(
    *urls: str,
    batch: int = 2,
    limits: QueueLimits | None = None,
    enabled: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> Dispatcher:
    registry = WorkerRegistry(
        list(urls), UpstreamClient(Timeouts(1, 1, 1)), LeastInflight(), batch_limit=batch
    )
    for worker in registry.membership.workers:
        worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
    room = RoomPolicy(headroom=0.0, min_headroom=0)  # exactly `batch` per worker
    return Dispatcher(registry, FairQueue(limits), room, enabled=enabled, clock=clock)


def ask(
    tenant: TenantPolicy = A,
    priority: int = 0,
    model: str | None = MODEL,
    identity: bytes | None = None,
) -> Admission:
    cost = Cost(prefill=0.0, hold=1.0)
    return Admission(tenant, priority, cost, 100, model, identity=identity)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_request_with_room_is_granted_at_once() -> None:
    dispatcher = fleet("http://w0", "http://w1")
    grant = await dispatcher.acquire(ask())
    assert grant.queued_s == 0.0
    assert sum(w.in_flight for w in dispatcher.registry.membership.workers) == 1
    grant.release()
    grant.release()  # idempotent
    assert sum(w.in_flight for w in dispatcher.registry.membership.workers) == 0
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
    assert dispatcher.registry.membership.workers[0].in_flight == 0


async def test_a_waiter_cancelled_as_it_is_granted_gives_its_lease_back() -> None:
    dispatcher = fleet("http://w0", batch=1)
    holder = await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    holder.release()  # grants the waiter's future synchronously...
    waiting.cancel()  # ...and its task is cancelled before it resumes
    await settle()
    assert waiting.cancelled()
    assert dispatcher.registry.membership.workers[0].in_flight == 0
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


async def test_a_refused_request_back_at_its_retry_after_keeps_its_turn() -> None:
    """A request refused at a full queue and back when its Retry-After said pushes out one that
    came in meanwhile, instead of being refused again; back early, it is refused again
    (docs/flow-control.md, "Backpressure")."""
    now = [100.0]
    dispatcher = fleet("http://w0", batch=1, limits=QueueLimits(max_queued=1), clock=lambda: now[0])
    held = await dispatcher.acquire(ask())  # the worker's one place
    first = asyncio.ensure_future(dispatcher.acquire(ask(identity=b"first")))
    await settle()
    with pytest.raises(Overloaded) as refused:
        await dispatcher.acquire(ask(identity=b"late"))
    wait = refused.value.retry_after_s
    assert wait is not None and wait >= 1
    now[0] += wait / 2
    with pytest.raises(Overloaded) as early:
        await dispatcher.acquire(ask(identity=b"late"))
    assert early.value.reason == "queue_full" and not first.done()
    wait = early.value.retry_after_s
    assert wait is not None
    held.release()  # `first` goes to the worker; the queue's place is free
    await settle()
    meanwhile = asyncio.ensure_future(dispatcher.acquire(ask(identity=b"meanwhile")))
    await settle()
    now[0] += wait
    back = asyncio.ensure_future(dispatcher.acquire(ask(identity=b"late")))
    await settle()
    pushed_out = meanwhile.exception()
    assert isinstance(pushed_out, Overloaded) and pushed_out.reason == "queue_full"
    assert not back.done()
    first.result().release()
    await settle()
    assert isinstance(back.result(), Grant)
    # Without an identity a request keeps no turn: refused, and refused again when back.
    anonymous = fleet("http://w0", batch=1, limits=QueueLimits(max_queued=0))
    await anonymous.acquire(ask())
    for _ in range(2):
        with pytest.raises(Overloaded):
            await anonymous.acquire(ask())
    assert not anonymous.turns


async def test_queued_requests_get_503_when_no_worker_is_healthy() -> None:
    dispatcher = fleet("http://w0", batch=1)
    await dispatcher.acquire(ask())
    waiting = asyncio.ensure_future(dispatcher.acquire(ask()))
    await settle()
    worker = dispatcher.registry.membership.workers[0]
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
    assert dispatcher.registry.membership.workers[0].in_flight == 5
    for grant in grants:
        grant.release()
    assert dispatcher.registry.membership.workers[0].in_flight == 0


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
    assert behind.done() and dispatcher.registry.membership.workers[0].in_flight == 1
    behind.result().release()
    assert dispatcher.queue.is_idle() and dispatcher.registry.membership.workers[0].in_flight == 0


async def test_queued_requests_for_a_model_no_worker_serves_any_more_get_404() -> None:
    dispatcher = fleet("http://w0", "http://w1", batch=1)
    w0, w1 = dispatcher.registry.membership.workers
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
    w0, w1 = dispatcher.registry.membership.workers
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
