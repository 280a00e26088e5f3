"""Routing policies on hand-made worker views: pure functions, table-driven."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from mineru_gateway.routing import (
    POLICY_NAMES,
    LeastInflight,
    LoadModel,
    PowerOfTwoChoices,
    QueueLength,
    ReportedLoad,
    RoundRobin,
    WorkerView,
    candidates_for,
    make_policy,
)

pytestmark = pytest.mark.unit

M = frozenset({"m"})


def view(
    name: str, in_flight: int = 0, healthy: bool = True, models: frozenset[str] = M
) -> WorkerView:
    return WorkerView(name, healthy, in_flight, models)


@pytest.mark.parametrize(
    ("views", "model", "exclude", "expected"),
    [
        ([view("a"), view("b")], "m", (), ["a", "b"]),
        ([view("a", healthy=False), view("b")], "m", (), ["b"]),
        ([view("a"), view("b", models=frozenset({"x"}))], "m", (), ["a"]),
        ([view("a"), view("b", models=frozenset({"x"}))], None, (), ["a", "b"]),
        ([view("a"), view("b")], "m", ("a",), ["b"]),
        ([view("a", healthy=False)], "m", (), []),
    ],
)
def test_candidates(
    views: list[WorkerView], model: str | None, exclude: tuple[str, ...], expected: list[str]
) -> None:
    assert [v.name for v in candidates_for(views, model, exclude)] == expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ({"a": 3, "b": 1, "c": 2}, {"b"}),
        ({"a": 0, "b": 0, "c": 5}, {"a", "b"}),
        ({"a": 7}, {"a"}),
    ],
)
def test_least_inflight_picks_among_the_least_loaded(
    loads: dict[str, int], expected: set[str]
) -> None:
    views = [view(name, load) for name, load in loads.items()]
    rng = random.Random(1)
    chosen = {LeastInflight().choose(views, rng).name for _ in range(200)}
    assert chosen == expected


def test_least_inflight_breaks_ties_at_random_not_by_position() -> None:
    views = [view(name) for name in "abcd"]
    rng = random.Random(7)
    counts = Counter(LeastInflight().choose(views, rng).name for _ in range(4000))
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 800


def test_round_robin_cycles_in_a_stable_order() -> None:
    policy = RoundRobin()
    views = [view("b"), view("a"), view("c")]
    picks = [policy.choose(views, random.Random()).name for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_make_policy() -> None:
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("least_inflight").name == "least_inflight"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("nope")


# -- the load model: queue and p2c ------------------------------------------------------------
def loaded(
    name: str,
    own_cost: float = 0.0,
    reported: ReportedLoad | None = None,
    slowness: float = 1.0,
    healthy: bool = True,
) -> WorkerView:
    """A view as the registry builds one: its reading only while fresh (`LoadModel.fresh`)."""
    reported = LoadModel().fresh(reported)
    return WorkerView(name, healthy, 0, M, own_cost=own_cost, reported=reported, slowness=slowness)


def fresh(waiting: float = 0, running: float = 0, kv: float = 0.0, own: int = 0) -> ReportedLoad:
    return ReportedLoad(waiting, running, kv, age_s=0.1, own_at_scrape=own)


def stale(waiting: float = 0, running: float = 0, kv: float = 0.0) -> ReportedLoad:
    return ReportedLoad(waiting, running, kv, age_s=5.0, own_at_scrape=0)


def test_a_reading_is_routed_on_until_it_is_older_than_stale_after_s() -> None:
    model = LoadModel(stale_after_s=1.0)
    reading = fresh(running=3)
    assert model.fresh(reading) is reading
    assert model.fresh(replace(reading, age_s=1.0)) is not None  # the threshold itself counts
    assert model.fresh(replace(reading, age_s=1.01)) is None
    assert model.fresh(None) is None
    assert LoadModel(stale_after_s=10.0).fresh(stale(running=3)) is not None


def test_a_readings_external_load_is_what_the_worker_has_beyond_this_gateways_own() -> None:
    assert fresh(waiting=2, running=3, own=4).external == 1
    assert fresh(waiting=0, running=1, own=5).external == 0  # our count is ahead of its reading
    assert replace(fresh(waiting=2, running=3, own=4), own_at_scrape=0).external == 5
    assert fresh(waiting=2, running=3, own=4) == fresh(waiting=2, running=3, own=4)


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        # the gateway's own estimated cost decides when workers report nothing
        ([loaded("a", 30), loaded("b", 4)], "b"),
        # load the gateway did not send (40 requests, a slot each) outweighs its own 30
        ([loaded("a", 0, fresh(running=40)), loaded("b", 30, fresh(running=10, own=10))], "b"),
        # the worker's count includes this gateway's requests: they are not counted twice
        ([loaded("a", 5, fresh(running=5, own=5)), loaded("b", 2, fresh(running=9))], "a"),
        # requests waiting at a worker (a full batch) weigh more than running ones: 5 + 1x5
        ([loaded("a", 0, fresh(waiting=5)), loaded("b", 9, fresh(running=9, own=9))], "b"),
        ([loaded("a", 0, fresh(waiting=5)), loaded("b", 11, fresh(running=11, own=11))], "a"),
        # stale figures are ignored: own cost alone decides
        ([loaded("a", 10, stale(waiting=50)), loaded("b", 20)], "a"),
        # a slow worker's load weighs more
        ([loaded("a", 30, slowness=2.0), loaded("b", 50)], "b"),
        # a nearly full KV cache is avoided even when otherwise least loaded
        ([loaded("a", 0, fresh(kv=0.97)), loaded("b", 500)], "b"),
        # ... unless every worker is that full
        ([loaded("a", 0, fresh(kv=0.97)), loaded("b", 500, fresh(kv=0.99))], "a"),
        # a dead worker is never a candidate (filtered before the policy)
        ([loaded("a", 0, healthy=False), loaded("b", 900)], "b"),
    ],
)
def test_queue_policy_picks_the_least_loaded(views: list[WorkerView], expected: str) -> None:
    candidates = candidates_for(views, "m")
    assert QueueLength().choose(candidates, random.Random(0)).name == expected


def test_kv_pressure_raises_the_score_before_the_cut_off() -> None:
    model = LoadModel()
    calm = loaded("a", 100, fresh(kv=0.5))
    pressed = loaded("b", 100, fresh(kv=0.9))
    assert model.score(pressed) == pytest.approx(2 * model.score(calm))


def test_queue_ties_are_broken_at_random() -> None:
    views = [loaded(name, 5.0, fresh(running=1, own=1)) for name in "abcd"]
    rng = random.Random(3)
    counts = Counter(QueueLength().choose(views, rng).name for _ in range(4000))
    assert set(counts) == set("abcd")
    assert min(counts.values()) > 800


def test_stale_figures_do_not_herd_traffic_onto_one_worker() -> None:
    # Every worker's figures are old; one of them looked idle back then. Routing must spread
    # by the gateway's own counts, which change with every decision.
    views = {
        "a": loaded("a", 0, stale(running=0)),
        "b": loaded("b", 0, stale(running=40)),
        "c": loaded("c", 0, stale(running=40)),
    }
    policy, rng = QueueLength(), random.Random(5)
    picks = Counter()
    for _ in range(30):
        choice = policy.choose(list(views.values()), rng)
        picks[choice.name] += 1
        views[choice.name] = loaded(choice.name, views[choice.name].own_cost + 10, stale())
    assert picks == {"a": 10, "b": 10, "c": 10}


def test_p2c_never_picks_the_worse_of_its_two_draws() -> None:
    views = [loaded("a", 10), loaded("b", 20), loaded("c", 30)]
    rng = random.Random(11)
    counts = Counter(PowerOfTwoChoices().choose(views, rng).name for _ in range(3000))
    assert "c" not in counts  # the most loaded loses every pair it is drawn in
    assert counts["a"] > counts["b"] > 0


def test_make_policy_knows_every_policy() -> None:
    assert [make_policy(name).name for name in POLICY_NAMES] == list(POLICY_NAMES)
