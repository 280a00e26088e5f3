"""What autoscaling follows: the gateway's queue per model, and how long it takes to drain.

The gateway holds the queue, so the workers' `vllm:num_requests_waiting` stays near zero however
much waits: scaling the workers on it never scales up (docs/operate/autoscaling.md). Read at
scrape time from the dispatcher, like the other queue gauges (metrics.py):

- `mineru_gateway_queue_depth{model}`: requests waiting in this process's queue for the model;
- `mineru_gateway_backlog_seconds{model}`: their estimated cost (cost.py) over the cost the
  fleet finished per second lately (flow.py, `CostDrain`); with nothing finished lately, the
  oldest request's wait so far.

Every model a worker serves has both series, at 0 while nothing waits, so that an autoscaler's
query always finds one.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mineru_gateway.workers.dispatcher import Dispatcher


class BacklogCollector(Collector):
    def __init__(self, dispatcher: Dispatcher) -> None:
        self._dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        dispatcher = self._dispatcher
        now = dispatcher.now()
        depth = GaugeMetricFamily(
            "mineru_gateway_queue_depth",
            "Requests waiting in the gateway's queue, by model.",
            labels=["model"],
        )
        backlog = GaugeMetricFamily(
            "mineru_gateway_backlog_seconds",
            "Seconds the fleet needs to work off the gateway's queue at its recent pace, "
            "by model (docs/operate/autoscaling.md).",
            labels=["model"],
        )
        queued = dispatcher.queue.by_model()
        served = {model for view in dispatcher.registry.routing.views() for model in view.models}
        for model in sorted(served | {m for m in queued if m is not None}):
            waiting = queued.get(model)
            depth.add_metric([model], 0 if waiting is None else waiting.requests)
            seconds = 0.0 if waiting is None else dispatcher.cost_drain.backlog(waiting, model, now)
            backlog.add_metric([model], seconds)
        unnamed = queued.get(None)
        if unnamed is not None:
            depth.add_metric([""], unnamed.requests)
            backlog.add_metric([""], dispatcher.cost_drain.backlog(unnamed, None, now))
        yield depth
        yield backlog
