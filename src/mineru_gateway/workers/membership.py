"""The gateway's set of workers: who they are, which are drained, and who hears of a change.

Workers join from the settings, DNS discovery and the admin API, and leave the same ways. Every
other part of the registry reads the same `Worker` objects from here; whoever changes what a
worker offers (health, counts, load figures, drain) calls `changed(worker)`, and the listeners
(flow control's pump, docs/flow-control.md) look for room again. Watchers (the routing index,
fleet_index.py) hear which worker changed, counts included, so that they need not look at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from mineru_gateway.metrics import WorkerGauges
from mineru_gateway.workers.worker import Worker

log = structlog.get_logger("mineru_gateway.registry")


class Membership:
    def __init__(self, urls: Iterable[str]) -> None:
        self._watchers: list[Callable[[Worker], None]] = []
        self._listed: list[Worker] | None = None
        self.by_url = {url: self._new_worker(url) for url in urls}
        self._listeners: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """`listener()` runs whenever a worker may have gained room: a request ended, fresh load
        figures arrived, a worker's health or membership changed (flow control pumps on it)."""
        self._listeners.append(listener)

    def watch(self, watcher: Callable[[Worker], None]) -> None:
        """`watcher(worker)` runs whenever something about `worker` changed, its counts too."""
        self._watchers.append(watcher)

    def mark(self, worker: Worker) -> None:
        """Tells the watchers that `worker` changed, without the listeners."""
        for watcher in self._watchers:
            watcher(worker)

    def changed(self, *workers: Worker) -> None:
        """`workers` changed (their watchers hear it) and may have room: the listeners look."""
        for worker in workers:
            self.mark(worker)
        for listener in self._listeners:
            listener()

    @property
    def workers(self) -> list[Worker]:
        return list(self.by_url.values())

    def workers_list(self) -> list[Worker]:
        """The workers, as a list made again only when one joins or leaves (asked by the
        registry's sweep at every tick)."""
        if self._listed is None:
            self._listed = list(self.by_url.values())
        return self._listed

    def worker(self, url: str) -> Worker:
        return self.by_url[url]

    def add(self, url: str) -> Worker:
        """Adds a worker; it takes traffic after its first good probe."""
        worker = self.by_url.get(url)
        if worker is None:
            worker = self.by_url[url] = self._new_worker(url)
            self._listed = None
            self.mark(worker)
        return worker

    def _new_worker(self, url: str) -> Worker:
        return Worker(url, watcher=self.mark)

    def remove(self, url: str) -> None:
        """Stops routing to `url`; requests already there finish normally."""
        worker = self.by_url.pop(url, None)
        self._listed = None
        self.changed(*([] if worker is None else [worker]))

    def drain(self, url: str) -> Worker:
        """No new requests go to `url` (queued ones go elsewhere); those on it finish."""
        return self._set_draining(url, True)

    def undrain(self, url: str) -> Worker:
        """`url` takes requests again (once healthy)."""
        return self._set_draining(url, False)

    def _set_draining(self, url: str, draining: bool) -> Worker:
        worker = self.by_url[url]
        worker.draining = draining
        log.info(
            "worker_draining" if draining else "worker_undrained",
            worker=url,
            in_flight=worker.in_flight,
            healthy=worker.healthy,
        )
        self.changed(worker)
        return worker

    async def wait_idle(self, worker: Worker, timeout_s: float, poll_s: float = 0.05) -> bool:
        """True once nothing of this gateway's is in flight on `worker`, False at the timeout."""
        deadline = time.monotonic() + timeout_s
        while worker.in_flight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll_s)
        return True

    # -- what the rest of the gateway reads ----------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        """The union of healthy workers' model cards, one per model id."""
        union: dict[str, dict[str, Any]] = {}
        for worker in self.by_url.values():
            if worker.healthy:
                for model_id, card in worker.models.items():
                    union.setdefault(model_id, card)
        return list(union.values())

    def any_healthy(self) -> bool:
        return any(worker.healthy for worker in self.by_url.values())

    def gauges(self) -> list[WorkerGauges]:
        now = time.monotonic()
        gauges = []
        for worker in self.by_url.values():
            reported = worker.reported(now)
            gauges.append(
                WorkerGauges(
                    worker=worker.url,
                    healthy=worker.healthy,
                    in_flight=worker.in_flight,
                    waiting=reported.waiting if reported else None,
                    running=reported.running if reported else None,
                    kv_usage=reported.kv_usage if reported else None,
                    scrape_age_s=reported.age_s if reported else None,
                )
            )
        return gauges
