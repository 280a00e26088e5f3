"""Routing policies on hand-made worker views: pure functions, table-driven."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mineru_gateway.routing import (
    LeastInflight,
    RoundRobin,
    WorkerView,
    candidates_for,
    make_policy,
)

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
