"""Routing policies: immutable worker views in, a choice out.

Pure on purpose (STYLE.md): no I/O, no web objects, no clocks. The registry builds a `WorkerView`
per worker from what it knows (health, the gateway's own in-flight count, models served) and a
policy picks one. Randomness comes from the caller's `random.Random`, so tests can seed it.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What a policy may know about one worker at the moment of a decision."""

    name: str
    healthy: bool = True
    in_flight: int = 0
    models: frozenset[str] = field(default_factory=frozenset)

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        """Picks one of `candidates` (never empty: see `candidates_for`)."""
        ...


def candidates_for(
    views: Iterable[WorkerView], model: str | None, exclude: Iterable[str] = ()
) -> list[WorkerView]:
    """The healthy workers that serve `model`, minus those already tried (`exclude`)."""
    tried = frozenset(exclude)
    return [v for v in views if v.healthy and v.serves(model) and v.name not in tried]


class LeastInflight:
    """Fewest requests this gateway has in flight on the worker; ties broken at random.

    Random tie-breaking matters: picking the first of equals sends every burst to worker 0.
    """

    name = "least_inflight"

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        fewest = min(view.in_flight for view in candidates)
        return rng.choice([view for view in candidates if view.in_flight == fewest])


class RoundRobin:
    """Each worker in turn, whatever its load. Keeps only a cursor, no knowledge of workers."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        ordered = sorted(candidates, key=lambda view: view.name)
        choice = ordered[self._cursor % len(ordered)]
        self._cursor += 1
        return choice


def make_policy(name: str) -> RoutingPolicy:
    policies: dict[str, type[LeastInflight] | type[RoundRobin]] = {
        LeastInflight.name: LeastInflight,
        RoundRobin.name: RoundRobin,
    }
    try:
        return policies[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(policies)}") from None
