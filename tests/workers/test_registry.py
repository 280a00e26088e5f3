"""The registry's view of workers: what routing gets to see."""

from __future__ import annotations

import asyncio
import time

import pytest

from mineru_gateway.cost import Cost
from mineru_gateway.routing import LoadModel, RoundRobin
from mineru_gateway.vllm_contract import FULL_PATH, LOAD_PATH, VllmLoad
from mineru_gateway.workers.registry import (
    HealthPolicy,
    Scrape,
    WorkerRegistry,
    learn_batch,
)
from mineru_gateway.workers.upstream import Timeouts, UpstreamClient
from tests.conftest import StartSim
from tests.support.workers import Script


def registry_of(
    *urls: str,
    pace_weighting: bool = True,
    health_timeout_s: float = 1,
    client: UpstreamClient | None = None,
) -> WorkerRegistry:
    return WorkerRegistry(
        list(urls),
        client or UpstreamClient(Timeouts(1, 1, 1)),
        RoundRobin(),
        HealthPolicy(interval_s=60, timeout_s=health_timeout_s, slow_probes_to_eject=3),
        pace_weighting=pace_weighting,
    )


def test_a_lease_releases_its_prefill_at_the_first_byte_and_the_rest_at_the_end() -> None:
    registry = registry_of("http://a:1")
    worker = registry.membership.workers[0]
    page, block = Cost(prefill=1.4, hold=1.0), Cost(prefill=0.1, hold=1.0)
    with registry.routing.lease(worker, block):
        with registry.routing.lease(worker, page) as lease:
            assert (worker.in_flight, worker.own_cost) == (2, pytest.approx(3.5))
            lease.prefilled()
            lease.prefilled()  # idempotent: released once
            assert worker.own_cost == pytest.approx(2.1)
        assert (worker.in_flight, worker.own_cost) == (1, pytest.approx(1.1))
    assert (worker.in_flight, worker.own_cost) == (0, 0.0)


def test_a_lease_ended_before_its_first_byte_releases_everything() -> None:
    registry = registry_of("http://a:1")
    worker = registry.membership.workers[0]
    with registry.routing.lease(worker, Cost(prefill=0.5, hold=1.0)):
        with (
            pytest.raises(RuntimeError),
            registry.routing.lease(worker, Cost(prefill=1.4, hold=1.0)),
        ):
            raise RuntimeError("the worker dropped the connection")
        assert (worker.in_flight, worker.own_cost) == (1, pytest.approx(1.5))


@pytest.mark.parametrize(("pace_weighting", "expected"), [(True, {0.5, 1.5}), (False, {1.0})])
def test_pace_weighting_scales_workers_by_reported_latency(
    pace_weighting: bool, expected: set[float]
) -> None:
    registry = registry_of("http://a:1", "http://b:1", pace_weighting=pace_weighting)
    for worker, itl in zip(registry.membership.workers, (0.01, 0.03), strict=True):
        worker.healthy, worker.itl_s = True, itl
    assert {view.slowness for view in registry.routing.views()} == expected


async def test_a_worker_slow_to_answer_its_probe_stays_in_routing_until_three_in_a_row(
    scripted: tuple[Script, str],
) -> None:
    script, url = scripted
    client = UpstreamClient(Timeouts(1, 1, 1))
    # A prompt probe takes milliseconds; 0.5 s leaves room for a loaded machine (at 0.2 s the
    # first, prompt probe was once late on CI) and the slow ones answer a whole second late.
    registry = registry_of(url, health_timeout_s=0.5, client=client)
    await client.start()
    try:
        worker = registry.membership.workers[0]
        await registry.checks.check(worker)
        assert worker.healthy
        script.health_delay_s = 1.0  # busy: /health answers after the probe gave up
        await registry.checks.check(worker)
        await registry.checks.check(worker)
        assert worker.healthy, "two slow probes are load, not a dead worker"
        assert "took longer than 0.5 s" in (worker.last_error or "")
        script.health_delay_s = 0.0
        await registry.checks.check(worker)  # a good probe starts the count again
        script.health_delay_s = 1.0
        for _ in range(2):
            await registry.checks.check(worker)
        assert worker.healthy
        await registry.checks.check(worker)
        assert not worker.healthy, "the third slow probe in a row takes it out"
        script.health_delay_s = 0.0
        await registry.checks.check(worker)
        assert worker.healthy
    finally:
        await client.close()


async def test_a_worker_answering_its_probe_with_an_error_is_taken_out_at_once(
    scripted: tuple[Script, str],
) -> None:
    script, url = scripted
    client = UpstreamClient(Timeouts(1, 1, 1))
    registry = registry_of(url, client=client)
    await client.start()
    try:
        worker = registry.membership.workers[0]
        await registry.checks.check(worker)
        assert worker.healthy
        script.healthy = False  # vLLM's /health answers 503 when its engine is dead
        await registry.checks.check(worker)
        assert not worker.healthy
        assert "503" in (worker.last_error or "")
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("readings", "learnt"),
    [
        ([(0, 5), (0, 5)], 0),  # nothing waits: the batch size is not known
        ([(3, 40), (2, 61)], 0),  # requests waiting for the next step, the batch still filling
        ([(3, 128), (1, 128)], 128),  # a plateau with requests waiting: its batch
        ([(40, 11), (30, 11), (0, 13), (0, 15)], 15),  # caught short, then it ran more
        ([(5, 120), (5, 120), (9, 90), (9, 90)], 120),  # the most seen is kept
    ],
)
def test_a_workers_batch_size_is_learnt_from_its_reported_load(
    readings: list[tuple[float, float]], learnt: int
) -> None:
    registry = registry_of("http://a:1")
    worker = registry.membership.workers[0]
    for waiting, running in readings:
        load = VllmLoad(waiting, running, 0.1, 0.0, 0.0)
        learn_batch(worker, load)
        worker.scrape = Scrape(load, 0.0, 0)
    assert worker.batch_seen == learnt
    view = registry.routing.views()[0]
    assert view.batch_limit == (learnt or None)


def test_a_workers_view_is_kept_until_something_it_shows_changes() -> None:
    registry = WorkerRegistry(
        ["http://a:1", "http://b:1"],
        UpstreamClient(Timeouts(1, 1, 1)),
        RoundRobin(),
        load=LoadModel(stale_after_s=0.3),
    )
    a, b = registry.membership.workers
    a.healthy = b.healthy = True
    a.models = {"m": {"id": "m"}}
    first = registry.routing.views()
    assert registry.routing.views()[0] is first[0] and registry.routing.views()[1] is first[1]

    with registry.routing.lease(a, Cost(prefill=0.1, hold=1.0)):
        leased = registry.routing.views()
        assert leased[0].in_flight == 1 and leased[1] is first[1]  # only a's view is new
    assert registry.routing.views()[0].in_flight == 0

    a.models = {"m": {"id": "m"}, "n": {"id": "n"}}
    assert registry.routing.views()[0].models == {"m", "n"}
    registry.membership.drain(b.url)
    assert registry.routing.views()[1].healthy is False
    registry.membership.undrain(b.url)

    reading = Scrape(VllmLoad(2, 5, 0.4, 0.0, 0.0), time.monotonic(), 0)
    a.scrape = reading
    fresh = registry.routing.views()[0]
    assert fresh.reported is not None and fresh.reported.running == 5
    assert fresh.reported.age_s < 0.3 and registry.routing.views()[0] is fresh
    with registry.routing.lease(a, Cost(prefill=0.1, hold=1.0)):
        counted = registry.routing.views()[0]  # new counts, the same reading
        assert counted.in_flight == 1 and counted.reported is fresh.reported
    assert registry.routing.views()[0].reported is fresh.reported
    time.sleep(0.35)  # the figures cross stale_after_s: the view is rebuilt without them
    stale = registry.routing.views()[0]
    assert stale is not fresh and stale.reported is None and stale.in_flight == 0
    assert (
        registry.routing.views()[0] is stale
    )  # and kept: a stale reading has nothing more to cross
    a.scrape = Scrape(VllmLoad(1, 2, 0.4, 0.0, 0.0), time.monotonic(), 0)
    assert registry.routing.views()[0].reported is not None  # a new reading goes in at once


async def test_a_workers_load_is_read_filtered_or_whole_where_it_cannot_filter(
    start_sim: StartSim, scripted: tuple[Script, str]
) -> None:
    """vLLM answers `/metrics/?name[]=...` with the named series only; with several API
    servers (a multiprocess registry) the filtered page is empty, and a server without the
    `/metrics/` mount answers 404: then the whole page, from then on, and a reading all the
    same. A worker that cannot be reached says nothing about filtering."""
    script, no_mount = scripted  # only `/metrics`: `/metrics/` is redirected to it (307)
    script.metrics = b"vllm:num_requests_running 2.0\nvllm:num_requests_waiting 1.0\n"
    one, several = start_sim(), start_sim(api_server_count=2)
    client = UpstreamClient(Timeouts(1, 1, 1))
    registry = registry_of(one, several, no_mount, "http://127.0.0.1:9", client=client)
    await client.start()
    try:
        await registry.checks.check_all()
        for _ in range(2):
            for worker in registry.membership.workers:
                await registry.read_load(worker)
        filtered, multiprocess, missing, unreachable = registry.membership.workers
        assert [w.load_path for w in registry.membership.workers] == [
            LOAD_PATH,
            FULL_PATH,
            FULL_PATH,
            LOAD_PATH,
        ]
        assert filtered.scrape is not None and multiprocess.scrape is not None
        assert missing.scrape is not None, "the scripted worker's whole page is read"
        assert unreachable.scrape is None
        assert [w.describe(time.monotonic())["load_read"] for w in registry.membership.workers] == [
            "filtered",
            "whole",
            "whole",
            "filtered",
        ]
        # Back after an outage, a worker may be another vLLM: its filtered read is tried again.
        await registry.checks.check(missing)
        assert missing.healthy and missing.load_path == FULL_PATH, "no outage, no new try"
        assert not unreachable.healthy
        script.healthy = False
        await registry.checks.check(missing)
        script.healthy = True
        await registry.checks.check(missing)
        assert missing.healthy and missing.load_path == LOAD_PATH
        await registry.read_load(missing)
        assert missing.load_path == FULL_PATH
    finally:
        await client.close()


async def test_requests_sent_while_a_load_read_is_under_way_count_as_the_gateways_own(
    scripted: tuple[Script, str],
) -> None:
    """The worker's figures may include a request the gateway sent while it was reading them.
    Taken for someone else's, it stood as a phantom request on the worker until the next read,
    and at a full batch sent the next request to the other, full worker."""
    script, url = scripted
    script.metrics = b"vllm:num_requests_running 1.0\nvllm:num_requests_waiting 0.0\n"
    client = UpstreamClient(Timeouts(1, 1, 1))
    registry = registry_of(url, client=client)
    await client.start()
    try:
        await registry.checks.check_all()
        worker = registry.membership.workers[0]
        worker.load_path = FULL_PATH  # it has no `/metrics/`: one read, not a fallback
        read = asyncio.ensure_future(registry.read_load(worker))
        await asyncio.sleep(0)  # the read has begun: it waits for the worker's answer
        assert not read.done()
        with registry.routing.lease(worker, Cost(prefill=0.1, hold=1.0)):  # sent during the read
            await read
            reported = worker.reported(time.monotonic())
            assert reported is not None and reported.own_at_scrape == 1
            # what routing and flow control count as others' requests on the worker: none
            assert (reported.running, reported.waiting) == (1, 0)
            assert reported.external == 0
    finally:
        await client.close()
