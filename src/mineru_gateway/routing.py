"""Routing policies: immutable worker views in, a choice out.

Pure on purpose (docs/architecture.md): no I/O, no web objects, no clocks. The registry builds
a `WorkerView` per worker from what it knows and a policy picks one. Randomness comes from the
caller's `random.Random`, so tests can seed it.

The load signal combines two sources:
- the gateway's own in-flight requests and their estimated cost: exact and instant, so consecutive
  decisions see each other and a burst cannot herd onto one worker;
- the worker's own queue from its `/metrics` (`vllm:num_requests_waiting`/`running`,
  `vllm:kv_cache_usage_perc`), a few hundred milliseconds old: the only way to see load this
  gateway did not send (other gateway replicas, clients calling the worker directly). Requests
  the worker reports beyond this gateway's own count hold one batch slot each (their prompts are
  unknown), and a waiting queue, whoever sent it, adds `waiting_weight` per waiting request: a
  worker with requests waiting has a full batch (or KV cache), so a new request there waits too.
A worker whose figures are stale contributes only the gateway's own counts (its view carries no
reading: freshness is judged once, where the view is built, `LoadModel.fresh`); a worker that
reports a slower pace (a degraded NPU) has its load scaled by its `slowness`; a nearly full KV
cache is avoided.

    score = (own_cost + external + waiting_weight * waiting) * slowness * kv_factor
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol, get_args

from mineru_gateway.values import value

STALE_AFTER_S = 1.0  # worker figures older than this are ignored, by default
RoutingPolicyName = Literal["queue", "p2c", "least_inflight", "round_robin"]
POLICY_NAMES: tuple[RoutingPolicyName, ...] = get_args(RoutingPolicyName)


@value
class ReportedLoad:
    """A worker's own queue, as its `/metrics` said `age_s` seconds ago."""

    waiting: float
    running: float
    kv_usage: float
    age_s: float
    own_at_scrape: int  # this gateway's requests on the worker when it was scraped (read_load)
    # Requests the worker reported beyond this gateway's own (other gateways', direct ones):
    # what routing and flow control count as load someone else put there. Worked out once per
    # reading: routing and the room check read it for every worker on every request.
    external: float = field(init=False)

    def __post_init__(self) -> None:
        external = max(0.0, self.running + self.waiting - self.own_at_scrape)
        object.__setattr__(self, "external", external)  # frozen, as far as mypy knows


@value  # immutable (to mypy), and cheap to build: one per worker that changed, per request
class WorkerView:
    """What a policy may know about one worker at the moment of a decision."""

    name: str
    healthy: bool = True
    in_flight: int = 0
    models: frozenset[str] = field(default_factory=frozenset)
    own_cost: float = 0.0  # estimated cost of this gateway's in-flight requests on the worker
    # The worker's own figures while they are fresh enough to route on, None otherwise (no
    # reading yet, or one older than `LoadModel.stale_after_s`). Whoever builds the view judges
    # that once (`LoadModel.fresh`): routing and the room check read it for every worker on
    # every request, three times each.
    reported: ReportedLoad | None = None
    slowness: float = 1.0  # the worker's pace relative to its peers (2.0: half speed)
    batch_limit: int | None = None  # its running batch's size (max_num_seqs), when known
    # This process holds a kept-alive connection to it (it sent there lately): among equals a
    # policy takes such a worker, so a request need not open a connection first
    # (docs/operate/fleet-scale.md, "Connections").
    warm: bool = False
    # The worker refused a request lately because its own queue was full (vLLM's queue-full
    # 503): it takes no more until the hold ends (workers/health.py), and is never ejected for it.
    held: bool = False

    def serves(self, model: str | None) -> bool:
        return model is None or model in self.models


class RoutingPolicy(Protocol):
    name: ClassVar[str]

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

    name: ClassVar[str] = "least_inflight"

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        fewest = min(view.in_flight for view in candidates)
        return _one_of([view for view in candidates if view.in_flight == fewest], rng)


class RoundRobin:
    """Each worker in turn, whatever its load. Keeps only a cursor, no knowledge of workers."""

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        ordered = sorted(candidates, key=lambda view: view.name)
        choice = ordered[self._cursor % len(ordered)]
        self._cursor += 1
        return choice


@dataclass(frozen=True, slots=True)
class LoadModel:
    """How a worker's view becomes one number: lower is better."""

    stale_after_s: float = STALE_AFTER_S  # older worker figures are ignored (own counts only)
    kv_avoid_above: float = 0.95  # such workers are skipped while any other can serve
    kv_penalty_from: float = 0.8  # from here the score grows, up to 3x at a full cache
    waiting_weight: float = 1.0  # extra slots per request the worker reports waiting

    def fresh(self, reported: ReportedLoad | None) -> ReportedLoad | None:
        """`reported` if it is recent enough to route on: what goes into a `WorkerView`."""
        return reported if reported is not None and reported.age_s <= self.stale_after_s else None

    def score(self, view: WorkerView) -> float:
        reported = view.reported
        load = view.own_cost
        if reported is None:
            return load * view.slowness
        load += reported.external
        load += self.waiting_weight * reported.waiting
        kv_factor = 1.0
        if reported.kv_usage > self.kv_penalty_from:
            over = reported.kv_usage - self.kv_penalty_from
            kv_factor += 2.0 * over / (1.0 - self.kv_penalty_from)
        return load * view.slowness * kv_factor

    def usable(self, candidates: Sequence[WorkerView]) -> Sequence[WorkerView]:
        """Candidates without a nearly full KV cache, or all of them if none is left."""
        roomy = [
            view
            for view in candidates
            if (reported := view.reported) is None or reported.kv_usage < self.kv_avoid_above
        ]
        return roomy or candidates


class QueueLength:
    """The least loaded worker by `LoadModel.score`; ties broken at random."""

    name: ClassVar[str] = "queue"

    def __init__(self, model: LoadModel | None = None) -> None:
        self.model = model or LoadModel()

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        return _lowest(self.model.usable(candidates), self.model.score, rng)


class PowerOfTwoChoices:
    """Two workers drawn at random, the less loaded by `LoadModel.score` wins.

    Cheaper to be wrong with than `queue`: with stale figures it still spreads load, because the
    draw itself is random.
    """

    name: ClassVar[str] = "p2c"

    def __init__(self, model: LoadModel | None = None) -> None:
        self.model = model or LoadModel()

    def choose(self, candidates: Sequence[WorkerView], rng: random.Random) -> WorkerView:
        usable = self.model.usable(candidates)
        drawn = rng.sample(list(usable), 2) if len(usable) > 2 else usable
        return _lowest(drawn, self.model.score, rng)


def _lowest(
    views: Sequence[WorkerView], score: Callable[[WorkerView], float], rng: random.Random
) -> WorkerView:
    scores = [score(view) for view in views]
    # Relative tolerance: float noise must not defeat random tie-breaking.
    bound = min(scores) * (1 + 1e-9)
    ties = [view for view, value in zip(views, scores, strict=True) if value <= bound]
    return _one_of(ties, rng)


def _one_of(ties: list[WorkerView], rng: random.Random) -> WorkerView:
    """One of equally good workers: a warm one (`WorkerView.warm`) if any, else at random."""
    if len(ties) == 1:
        return ties[0]
    warm = [view for view in ties if view.warm]
    return rng.choice(warm or ties)


def make_policy(name: str, model: LoadModel | None = None) -> RoutingPolicy:
    if name == QueueLength.name:
        return QueueLength(model)
    if name == PowerOfTwoChoices.name:
        return PowerOfTwoChoices(model)
    if name == LeastInflight.name:
        return LeastInflight()
    if name == RoundRobin.name:
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; known: {list(POLICY_NAMES)}")
