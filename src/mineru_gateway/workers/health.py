"""Whether each worker may take requests: passive outcomes and active probes.

Health is learnt two ways: an active probe (`GET /health`, and `GET /v1/models` every
MODELS_EVERY_S or while the worker is out) every `interval_s`, or less often as the budget of
GETs allows (registry.py), and passively: a worker that cannot be connected to, or answers 5xx
or drops connections `eject_after` times in a row, is taken out of routing and comes back on its
next good probe. A probe that is refused or answered with an error takes a worker out at once;
one that merely times out does so only `slow_probes_to_eject` times in a row: a worker busy with
a full batch (or sharing a few cores) answers `/health` late, and taking every such worker out
would turn load into a "no healthy worker" outage.

Whoever sends a request reports the attempt's outcome with one call, `report(worker, outcome)`;
this module alone decides what that means for the worker's health.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import structlog

from mineru_gateway.errors import GatewayError, UpstreamTimeout
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.vllm_contract import LOAD_PATH
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.upstream import UpstreamClient
from mineru_gateway.workers.worker import Worker

log = structlog.get_logger("mineru_gateway.registry")

# A worker's models change only with a restart (which a failed probe or read shows first): asked
# again this often, not at every probe (docs/operate/fleet-scale.md).
MODELS_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """How the registry probes workers and when it takes one out of routing."""

    interval_s: float = 2.0  # between two active probes
    timeout_s: float = 2.0  # one probe: /health, then /v1/models
    eject_after: int = 3  # consecutive passive failures (5xx, dropped connections)
    slow_probes_to_eject: int = 3  # consecutive probes that only timed out
    busy_hold_s: float = 1.0  # after a queue-full 503 the worker takes one more this often


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt on a worker showed about the worker's health."""

    failure: str | None = None  # a reason label (connect_error, status_5xx, ...); None: fine
    detail: str = ""
    eject_now: bool = False  # a refused connection: no need to count
    busy: bool = False  # alive, but its own queue is full (vLLM's queue-full 503)

    @classmethod
    def failed(cls, reason: str, detail: str, *, eject_now: bool = False) -> Outcome:
        return cls(reason, detail, eject_now)


SUCCESS = Outcome()
# A worker refusing work because vLLM's own queue is full (--max-num-queued-reqs or -tokens) is
# alive and answering: it is held back and never ejected for it (docs/vllm.md, "A full engine
# queue").
BUSY = Outcome(detail="its own queue is full", busy=True)


class Health:
    """Judges the workers of `membership` by `policy`, from outcomes and probes."""

    def __init__(
        self,
        membership: Membership,
        client: UpstreamClient,
        policy: HealthPolicy,
        metrics: GatewayMetrics,
    ) -> None:
        self._membership = membership
        self._client = client
        self.policy = policy
        self._metrics = metrics

    # -- passive ---------------------------------------------------------------------------
    def report(self, worker: Worker, outcome: Outcome) -> None:
        """How an attempt on `worker` went. A failure (a refused connection, a 5xx, a dropped
        stream) counts towards ejection; `eject_now` ejects without counting."""
        if outcome.failure is None:
            worker.failures = 0
            if outcome.busy:
                self._hold(worker)
            return
        worker.failures += 1
        worker.last_error = outcome.detail
        if worker.healthy and (outcome.eject_now or worker.failures >= self.policy.eject_after):
            worker.healthy = False
            self._membership.mark(worker)
            self._metrics.ejections.inc(worker.url, outcome.failure)
            log.warning(
                "worker_ejected", worker=worker.url, reason=outcome.failure, error=outcome.detail
            )

    def _hold(self, worker: Worker) -> None:
        """After vLLM's queue-full 503, `worker` gets no more of this gateway's requests than
        it held when it refused, one more every `busy_hold_s` without another refusal
        (`Worker.queue_limit`): the rest go to workers with room, or wait in the gateway's
        queue, which is served again as the limit grows or a request on the worker ends."""
        self._metrics.worker_queue_full.inc(worker.url)
        now = time.monotonic()
        growing = worker.queue_limit(now)[0] is not None
        worker.refused(now, self.policy.busy_hold_s)
        self._membership.mark(worker)
        if not growing:
            self._grow_later(worker, now)

    def _grow_later(self, worker: Worker, now: float) -> None:
        limit, grows_at = worker.queue_limit(now)
        if limit is not None:
            loop = asyncio.get_running_loop()
            loop.call_at(loop.time() + grows_at - now, self._grown, worker)

    def _grown(self, worker: Worker) -> None:
        self._membership.changed(worker)  # placed again with its new limit; the queue is served
        self._grow_later(worker, time.monotonic())

    # -- active ----------------------------------------------------------------------------
    async def probe(self, worker: Worker, now: float) -> None:
        """The periodic probe: `/health`, and its models only when last listed long ago or
        while it is out (it may come back another vLLM)."""
        listed = worker.models_at is not None and now - worker.models_at < MODELS_EVERY_S
        await self.check(worker, models=not (listed and worker.healthy))

    async def check(self, worker: Worker, *, models: bool = True) -> None:
        """`/health`, then (`models`) `/v1/models`."""
        timeout = self.policy.timeout_s
        try:
            await self._client.get_ok(f"{worker.url}/health", timeout)
            listed = worker.models
            if models:
                listing = await self._client.get_json(f"{worker.url}/v1/models", timeout)
                listed = {card["id"]: card for card in listing["data"]}
                worker.models_at = time.monotonic()
        except UpstreamTimeout as exc:
            worker.slow_probes += 1
            if worker.healthy and worker.slow_probes < self.policy.slow_probes_to_eject:
                worker.last_error = str(exc)
                log.info("worker_probe_slow", worker=worker.url, error=str(exc))
            else:
                self.set_health(worker, False, str(exc))
        except GatewayError as failed:
            self.set_health(worker, False, str(failed))
        except (KeyError, TypeError) as bad:
            self.set_health(worker, False, f"unexpected /v1/models answer: {bad!r}")
        else:
            self._take_models(worker, listed)
            worker.failures = 0
            worker.slow_probes = 0
            self.set_health(worker, True, None)
        worker.last_checked = time.time()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(worker) for worker in self._membership.workers))

    def _take_models(self, worker: Worker, models: dict[str, dict[str, Any]]) -> None:
        if models is worker.models or models == worker.models:
            return  # the same: the views built on the models stay
        if models.keys() != worker.models.keys():
            self._membership.mark(worker)
        worker.models = models

    def set_health(self, worker: Worker, healthy: bool, error: str | None) -> None:
        """What a probe found; a change is told to the membership's listeners."""
        changed = healthy != worker.healthy
        if changed:
            event = "worker_healthy" if healthy else "worker_unhealthy"
            log.info(event, worker=worker.url, error=error)
            if healthy:
                # Back after an outage: maybe another vLLM (a restart with one API server
                # where there were several), so its filtered read is tried again.
                worker.load_path = LOAD_PATH
        worker.healthy = healthy
        if error is not None:
            worker.last_error = error
        elif changed:  # healthy again: the error from before (a start-up refusal) is past
            worker.last_error = None
        if changed:
            self._membership.changed(worker)
