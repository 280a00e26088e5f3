"""What load each worker reports: its queue read from its `/metrics`, and what is learnt from it.

Routing and flow control count the gateway's own requests at once (`Lease`); the workers' own
queues, which include everyone else's requests, come from here every `interval_s` or less
often, as the registry's budget allows (docs/architecture.md, docs/operate/fleet-scale.md).
Each reading is corrected for the gateway's requests sent while it was under way, teaches a
worker's pace (inter-token latency) and batch size.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from mineru_gateway.errors import GatewayError, UpstreamStatusError
from mineru_gateway.vllm_contract import FULL_PATH, VllmLoad, parse_vllm_load
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.worker import Reading, Scrape, Worker

log = structlog.get_logger("mineru_gateway.registry")

ITL_SMOOTHING = 0.3


class LoadReader:
    def __init__(self, membership: Membership, client: UpstreamClient, interval_s: float) -> None:
        self._membership = membership
        self._client = client
        self.interval_s = interval_s

    @property
    def _timeout(self) -> float:
        return max(1.0, 4 * self.interval_s)

    async def read_all(self) -> None:
        workers = self._membership.workers
        await asyncio.gather(*(self.read(w) for w in workers if w.healthy))

    async def read(self, worker: Worker) -> bool:
        """Reads `worker`'s load; whether a reading was taken."""
        own, leased, path = worker.in_flight, worker.leased, worker.load_path
        why = "the filtered read has no load series"
        try:
            text = await self._client.get_ok(worker.url + path, self._timeout)
        except UpstreamStatusError as error:
            if path == FULL_PATH:
                return False
            text, why = b"", str(error)
        except GatewayError:
            return False  # the figures age; past `stale_after_s` routing ignores them
        load = parse_vllm_load(text)
        if load is not None:
            # The worker may have counted the requests sent while the read was under way: they
            # are ours too. Counted as someone else's, each would stand as a phantom request on
            # the worker until the next read, and could send a request to a worker whose batch
            # is full. Ours that ended meanwhile stay
            # counted: that can only hide someone else's request, never make up one.
            own += worker.leased - leased
            worker.read_at = time.monotonic()
            take(worker, Reading(load, worker.read_at), own)
            return True
        if path != FULL_PATH:
            # vLLM with several API servers (a multiprocess registry knows no names), or a
            # server without vLLM's `/metrics/` mount: the whole page from now on.
            worker.load_path = FULL_PATH
            log.info("worker_load_unfiltered", worker=worker.url, reason=why)
            return await self.read(worker)
        return False


def take(worker: Worker, reading: Reading, own: int) -> None:
    """`reading` becomes the worker's figures, `own` the gateway's count at it; what it teaches
    (pace, batch size) is learnt from it against the previous one."""
    if worker.scrape is not None and worker.scrape.at >= reading.at:
        return  # a reading already taken
    learn_pace(worker, reading.load)
    learn_batch(worker, reading.load)
    worker.scrape = Scrape(reading.load, reading.at, own)
    worker.changed()


def learn_pace(worker: Worker, load: VllmLoad) -> None:
    """A worker's smoothed inter-token latency, from the tokens it made since its last
    reading (before `worker.scrape` becomes `load`)."""
    previous = worker.scrape
    if previous is None:
        return
    tokens = load.itl_count - previous.load.itl_count
    if tokens <= 0:
        return  # idle, or the worker restarted: keep what was learnt
    itl = (load.itl_sum - previous.load.itl_sum) / tokens
    if worker.itl_s is None:
        worker.itl_s = itl
    else:
        worker.itl_s += ITL_SMOOTHING * (itl - worker.itl_s)


def learn_batch(worker: Worker, load: VllmLoad) -> None:
    """A worker's batch size from its own figures (before `worker.scrape` becomes `load`).

    A snapshot's `waiting` proves nothing by itself: new requests wait for the next engine step
    at any load, and a burst of long prompts waits on the step's token budget while the batch
    fills. A plateau does: the same number running in two readings in a row, with requests
    waiting in both, is the batch's limit (its `max_num_seqs`, or what its KV cache holds). The
    most seen is kept; a worker seen running more than that had been caught short of it, and
    since flow control lets a headroom more through, the estimate grows until requests wait.
    """
    running = round(load.running)
    previous = worker.scrape.load if worker.scrape is not None else None
    plateau = (
        previous is not None
        and load.waiting > 0
        and previous.waiting > 0
        and round(previous.running) == running
    )
    if plateau or (worker.batch_seen and running > worker.batch_seen):
        worker.batch_seen = max(worker.batch_seen, running)
