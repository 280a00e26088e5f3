"""One worker's state as the gateway sees it, and a request's lease on it.

A `Worker` holds what the registry's parts learn of one worker (health, models, load) and owns
its counts: a `Lease` changes them only through the worker's `hold` / `prefilled` / `let_go`,
which also tell its watcher (the routing index) to place it again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mineru_gateway.cost import Cost
from mineru_gateway.routing import LoadModel, ReportedLoad, WorkerView
from mineru_gateway.vllm_contract import FULL_PATH, LOAD_PATH, VllmLoad
from mineru_gateway.workers.upstream import KEEPALIVE_S

# A worker's connection from this process counts as kept alive (`WorkerView.warm`) for this
# long after its last request here ended: the pool's keep-alive, less a margin for the request
# about to be sent.
WARM_S = KEEPALIVE_S - 0.5
# A limit learnt from a queue-full 503 grows by one request a step and lapses after this many
# steps without another refusal (docs/vllm.md, "A full engine queue").
LIMIT_STEPS = 32


@dataclass(frozen=True, slots=True)
class Reading:
    """A worker's load figures and when they were read (time.monotonic())."""

    load: VllmLoad
    at: float


@dataclass(frozen=True, slots=True)
class Scrape(Reading):
    """A reading taken into this gateway's view, with its own count at that moment."""

    own_in_flight: int


class _BuiltView(NamedTuple):
    """A worker's last view, the reading and models it was built from (compared by identity)
    and until when its reading's freshness holds."""

    view: WorkerView
    scrape: Scrape | None
    models: dict[str, dict[str, Any]]
    until: float


@dataclass(slots=True)
class Worker:
    """Mutable state of one worker, owned by the registry (one event loop, no locks needed)."""

    url: str
    healthy: bool = False
    in_flight: int = 0
    own_cost: float = 0.0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_error: str | None = None
    last_checked: float | None = None
    failures: int = 0  # consecutive passive failures
    slow_probes: int = 0  # consecutive health probes that timed out
    # vLLM's queue was full (its 503, health.py): the worker takes no more of this gateway's
    # requests than it held then, one more for every `limit_step_s` without another refusal,
    # until the limit lapses (`queue_limit`).
    refused_at: float | None = None
    limit_at_refusal: int = 0
    limit_step_s: float = 1.0
    scrape: Scrape | None = None
    itl_s: float | None = None  # smoothed mean inter-token latency the worker reports
    batch_seen: int = 0  # most requests seen running while others waited: its batch size
    draining: bool = False  # takes no new requests (a rolling restart, an operator's drain)
    load_path: str = LOAD_PATH  # FULL_PATH from a failed filtered read until an outage ends
    leased: int = 0  # leases ever given on it (read_load: the requests sent during a read)
    read_at: float | None = None  # its last good load read (time.monotonic()): it is up
    models_at: float | None = None  # its models were last listed (time.monotonic())
    # This process's last request there ended (time.monotonic()): its connection is kept
    # alive a while, and routing prefers such a worker among equals (fleet_index.py).
    released_at: float = -math.inf
    # Told of every change of its counts: the routing index (fleet_index.py) moves it then.
    watcher: Callable[[Worker], None] | None = field(default=None, repr=False, compare=False)
    _view: _BuiltView | None = field(default=None, repr=False, compare=False)

    def hold(self, cost: Cost) -> None:
        """A request and its whole cost are on the worker from now."""
        self.in_flight += 1
        self.leased += 1
        self.own_cost += cost.total
        self.changed()

    def prefilled(self, cost: Cost) -> None:
        """A request's prompt is no longer queued work on the worker (its first byte came)."""
        self.own_cost = max(0.0, self.own_cost - cost.prefill)
        self.changed()

    def let_go(self, cost: Cost, prefill_done: bool, now: float) -> None:
        """A request left the worker: what it still held of its cost goes with it."""
        self.in_flight -= 1
        self.released_at = now
        held = cost.hold if prefill_done else cost.total
        self.own_cost = max(0.0, self.own_cost - held) if self.in_flight else 0.0
        self.changed()

    def changed(self) -> None:
        """Something routing sees of the worker changed: its watcher places it again."""
        if self.watcher is not None:
            self.watcher(self)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def reported(self, now: float) -> ReportedLoad | None:
        if self.scrape is None:
            return None
        scrape, load = self.scrape, self.scrape.load
        age = now - scrape.at
        return ReportedLoad(load.waiting, load.running, load.kv_usage, age, scrape.own_in_flight)

    def view(
        self, now: float, slowness: float, batch_limit: int | None, load: LoadModel
    ) -> WorkerView:
        """What routing and flow control see of this worker now: its reading only while
        `load` judges it fresh (`WorkerView.reported`).

        Built once and kept while nothing it shows has changed: routing asks for every worker's
        view on every request, so building them all each time costs every request more with
        each worker (docs/proxy-costs.md, "Also per request"). The view is rebuilt when its
        reading crosses `load.stale_after_s` (the threshold routing and flow control apply,
        config.py): until then the reading goes in, from then on none.
        """
        scrape, built, routable = self.scrape, self._view, self.routable
        in_flight, cost = self.in_flight, self.own_cost
        warm = now - self.released_at < WARM_S
        limit, limit_until = (None, math.inf) if self.refused_at is None else self.queue_limit(now)
        held = limit is not None and in_flight >= limit
        if built is not None and now < built.until and built.scrape is scrape:
            view, until = built.view, built.until
            same_models = built.models is self.models
            if (
                same_models
                and view.warm == warm
                and view.held == held
                and view.in_flight == in_flight
                and view.own_cost == cost
                and view.healthy == routable
                and view.slowness == slowness
                and view.batch_limit == batch_limit
            ):
                return view
            # Under load only the counts change, on every request: the same reading (its age
            # as of the last build, as above) goes into the new view.
            reported = view.reported
            models = view.models if same_models else frozenset(self.models)
        else:
            reported = load.fresh(self.reported(now))
            models = frozenset(self.models)
            until = math.inf  # no reading, or a stale one: nothing to cross
            if scrape is not None and reported is not None:
                until = scrape.at + load.stale_after_s
        # Positional: a fraction of the keyword form's cost (docs/proxy-costs.md).
        view = WorkerView(
            self.url, routable, in_flight, models, cost, reported, slowness, batch_limit, warm, held
        )
        if limit is not None:
            until = min(until, limit_until)  # built again when the limit grows
        self._view = _BuiltView(view, scrape, self.models, until)
        return view

    def refused(self, now: float, step_s: float) -> None:
        """vLLM refused a request because its queue was full: it holds what it has of ours
        (the refused request's own lease aside) and no more, for now."""
        self.refused_at = now
        self.limit_at_refusal = max(0, self.in_flight - 1)
        self.limit_step_s = step_s

    def queue_limit(self, now: float) -> tuple[int | None, float]:
        """How many of this gateway's requests the worker takes after a refusal (None: no
        limit learnt, or it lapsed after LIMIT_STEPS steps), and when that grows next."""
        if self.refused_at is None:
            return None, math.inf
        steps = int((now - self.refused_at) / self.limit_step_s)
        if steps > LIMIT_STEPS:
            self.refused_at = None  # lapsed
            return None, math.inf
        grows_at = self.refused_at + (steps + 1) * self.limit_step_s
        return self.limit_at_refusal + steps, grows_at

    def describe(self, now: float) -> dict[str, Any]:
        reported = self.reported(now)
        return {
            "url": self.url,
            "state": "draining" if self.draining else "healthy" if self.healthy else "unhealthy",
            "in_flight": self.in_flight,
            "estimated_cost": round(self.own_cost, 1),
            "models": sorted(self.models),
            "reported": None
            if reported is None
            else {
                "waiting": reported.waiting,
                "running": reported.running,
                "kv_cache_usage": reported.kv_usage,
                "age_s": round(reported.age_s, 3),
            },
            "inter_token_latency_s": self.itl_s,
            "batch_seen": self.batch_seen or None,
            # "filtered": the few series routing needs; "whole": the whole page (read_load)
            "load_read": "whole" if self.load_path == FULL_PATH else "filtered",
            # Requests of this gateway it takes, learnt from vLLM's queue-full 503 (None: any).
            "queue_limit": self.queue_limit(time.monotonic())[0],
            "last_error": self.last_error,
            "last_checked": self.last_checked,
        }


class Lease:
    """A request's place on a worker, counted from `acquire` until `release()` (idempotent).

    `prefilled()` releases the prefill part of its cost at the answer's first byte.
    """

    __slots__ = ("_on_release", "cost", "prefill_done", "released", "worker")

    def __init__(self, worker: Worker, cost: Cost, on_release: Callable[[], None]) -> None:
        self.worker = worker
        self.cost = cost
        self.prefill_done = False
        self.released = False
        self._on_release = on_release
        worker.hold(cost)

    def prefilled(self) -> None:
        """The worker sent the first byte of the answer: the prompt is no longer queued work."""
        if not self.prefill_done:
            self.prefill_done = True
            self.worker.prefilled(self.cost)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.worker.let_go(self.cost, self.prefill_done, time.monotonic())
        self._on_release()
