"""Routing views: why no worker can take a request."""

from __future__ import annotations

import random

import pytest

from mineru_gateway.errors import ModelNotFound, NoHealthyWorker
from mineru_gateway.metrics import GatewayMetrics
from mineru_gateway.routing import LoadModel, RoundRobin
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.views import RoutingViews

pytestmark = pytest.mark.unit


def views_of(membership: Membership) -> RoutingViews:
    return RoutingViews(
        membership,
        RoundRobin(),
        load=LoadModel(),
        metrics=GatewayMetrics(),
        rng=random.Random(0),
        retry_after_s=2.0,
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("m", NoHealthyWorker),  # a's model: a is out (ejected), the model is still known
        ("d", NoHealthyWorker),  # the draining worker's model
        ("never", ModelNotFound),  # no member serves it
        (None, None),  # any model: b takes it
    ],
)
def test_a_known_model_with_no_worker_now_is_503_and_an_unknown_one_404(
    model: str | None, expected: type[Exception] | None
) -> None:
    membership = Membership(["http://a:1", "http://b:1", "http://d:1"])
    a, b, d = membership.workers
    a.models, b.models, d.models = {"m": {}}, {"n": {}}, {"d": {}}
    b.healthy = d.healthy = True
    membership.drain(d.url)
    routing = views_of(membership)
    if expected is None:
        assert routing.choose(model) is b
        return
    with pytest.raises(expected) as raised:
        routing.choose(model)
    status = 503 if expected is NoHealthyWorker else 404
    assert raised.value.status == status
    assert (raised.value.retry_after_s is not None) == (status == 503)


def test_with_no_healthy_worker_at_all_every_model_is_503() -> None:
    membership = Membership(["http://a:1"])
    with pytest.raises(NoHealthyWorker):
        views_of(membership).choose("never")
