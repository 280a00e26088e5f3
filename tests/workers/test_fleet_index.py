"""Decisions over a large fleet (workers/fleet_index.py): a few workers drawn from those with
room, kept up to date on events, never a full one while others have room."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mineru_gateway.cost import Cost
from mineru_gateway.flow import FairQueue, RoomPolicy, TenantPolicy
from mineru_gateway.routing import QueueLength
from mineru_gateway.workers.dispatcher import Admission, Dispatcher
from mineru_gateway.workers.registry import WorkerRegistry
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient

pytestmark = pytest.mark.unit

MODEL = "m"
BATCH = 4


def big_fleet(size: int, *, sample: int = 8) -> Dispatcher:
    registry = WorkerRegistry(
        [f"http://w{n}:1" for n in range(size)],
        UpstreamClient(Timeouts(1, 1, 1)),
        QueueLength(),
        batch_limit=BATCH,
        rng=random.Random(7),
        sample=sample,
    )
    for worker in registry.membership.workers:
        worker.healthy, worker.models = True, {MODEL: {"id": MODEL}}
    room = RoomPolicy(headroom=0.0, min_headroom=0)  # exactly BATCH per worker
    return Dispatcher(registry, FairQueue(), room)


def ask() -> Admission:
    return Admission(TenantPolicy("a"), 0, Cost(prefill=0.0, hold=1.0), 100, MODEL)


async def test_at_256_workers_a_quarter_full_get_no_request() -> None:
    dispatcher = big_fleet(256)
    registry = dispatcher.registry
    full = registry.membership.workers[::4]
    for worker in full:
        for _ in range(BATCH):
            registry.routing.acquire(worker, Cost(prefill=0.0, hold=1.0))
    grants = [await dispatcher.acquire(ask()) for _ in range(600)]  # of 768 places left
    chosen = Counter(grant.lease.worker.url for grant in grants)
    assert not chosen.keys() & {worker.url for worker in full}
    assert len(chosen) > 150  # spread over the workers with room, not stuck on a few
    assert max(chosen.values()) <= BATCH
    for grant in grants:
        grant.release()


async def test_one_request_at_a_time_stays_on_a_worker_it_holds_a_connection_to() -> None:
    """Among equally loaded workers the one this process just used wins (its connection is
    kept alive), while it has room; full, the next request goes elsewhere."""
    dispatcher = big_fleet(256)
    registry = dispatcher.registry
    chosen: Counter[str] = Counter()
    for _ in range(200):
        grant = await dispatcher.acquire(ask())
        chosen[grant.lease.worker.url] += 1
        grant.release()
    [(warm, times)] = chosen.most_common(1)
    assert times >= 199
    worker = registry.membership.by_url[warm]
    for _ in range(BATCH):
        registry.routing.acquire(worker, Cost(prefill=0.0, hold=1.0))
    grant = await dispatcher.acquire(ask())
    assert grant.lease.worker.url != warm
    grant.release()


async def test_requests_sixteen_at_a_time_reuse_the_workers_they_left_idle() -> None:
    """More requests at once than a decision draws: each still goes to a worker whose last
    request here just ended (an idle kept-alive connection), not to a random cold one."""
    dispatcher = big_fleet(1024)
    window = [await dispatcher.acquire(ask()) for _ in range(16)]
    used = {grant.lease.worker.url for grant in window}
    for _ in range(500):
        window.pop(0).release()
        window.append(await dispatcher.acquire(ask()))
        used.add(window[-1].lease.worker.url)
    assert len(used) <= 20
    for grant in window:
        grant.release()


async def test_a_warm_worker_with_more_load_is_not_preferred() -> None:
    dispatcher = big_fleet(16)
    registry = dispatcher.registry
    grant = await dispatcher.acquire(ask())
    warm = grant.lease.worker
    grant.release()
    registry.routing.acquire(warm, Cost(prefill=0.0, hold=1.0))  # another request of this process
    for _ in range(20):
        grant = await dispatcher.acquire(ask())
        assert grant.lease.worker is not warm
        grant.release()


async def test_held_requests_fill_the_fleet_evenly_and_then_queue() -> None:
    """Kept leases: each decision sees the last one's (the index moves a worker as it fills),
    so the fleet fills to exactly its room and the next request waits."""
    dispatcher = big_fleet(64)
    grants = [await dispatcher.acquire(ask()) for _ in range(64 * BATCH)]
    per_worker = Counter(grant.lease.worker.url for grant in grants)
    assert set(per_worker.values()) == {BATCH}
    waiting = dispatcher.registry.routing.offer(MODEL, dispatcher.room)
    assert not waiting.roomy
    grants.pop().release()  # room on one worker: it is found at once
    offer = dispatcher.registry.routing.offer(MODEL, dispatcher.room)
    assert offer.roomy and len(offer.views) == 1
    for grant in grants:
        grant.release()


async def test_a_decision_looks_at_no_more_than_its_sample() -> None:
    dispatcher = big_fleet(512, sample=5)
    offer = dispatcher.registry.routing.offer(MODEL, dispatcher.room)
    assert offer.roomy and len(offer.views) == 5
