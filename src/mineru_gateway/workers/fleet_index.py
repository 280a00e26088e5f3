"""Which workers have room, kept up to date on events, so a decision never walks the fleet.

Building every worker's view, filtering them for the model and for room and scoring them all
would cost each routing decision work that grows with the fleet (docs/operate/fleet-scale.md).
Instead each worker sits in one of two bags per model it serves, *roomy* or *full* (or in none:
unhealthy, draining, removed), and moves between them when something about it changes: a lease
taken or released, a reading, a probe, a drain (`mark`). A decision draws `sample` workers from
the roomy bag (power of d choices) and hands their fresh views to the routing policy; with no
more roomy workers than `sample`, that is all of them, as exact as a walk.

What changes without an event here is caught at the draw: a worker's view also depends on the
clock (its reading ages), so each drawn view is checked again and a full one moves bags. The
other way round, room a reading that ages out leaves shows at the worker's next reading, or,
when no roomy worker is left, by looking at the full workers again, at most every `rescan_s`.

Connections: a worker with no request of this process on it, whose last request here ended
less than a keep-alive ago, holds an idle connection from this process. The index keeps those
workers in the order their last request ended; the latest `WARM_DRAWN` of them with room join
each draw, and the policy takes a warm worker among equally loaded ones: in a large fleet a
random pick would otherwise mostly land on a worker whose connection has lapsed and open a new
one first (docs/operate/fleet-scale.md).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

from mineru_gateway.routing import WorkerView
from mineru_gateway.workers.membership import Membership
from mineru_gateway.workers.worker import WARM_S, Worker

RESCAN_S = 0.1  # at most this often, a full look for room no event reported
WARM_DRAWN = 2  # workers with a kept-alive connection that join a draw


class RoomCheck(Protocol):
    """What the index asks of flow control's room policy (flow.RoomPolicy)."""

    def has_room(self, view: WorkerView) -> bool: ...


class NoRoomCheck:
    """Every routable worker has room but one held back for a full queue: routing without flow
    control."""

    def has_room(self, view: WorkerView) -> bool:
        return view.healthy and not view.held


ANY_ROOM = NoRoomCheck()


class _Bag:
    """Workers in no order: adding, removing and drawing one at random cost the same at any
    size (a list and each worker's place in it)."""

    __slots__ = ("items", "where")

    def __init__(self) -> None:
        self.items: list[Worker] = []
        self.where: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.items)

    def add(self, worker: Worker) -> None:
        if worker.url not in self.where:
            self.where[worker.url] = len(self.items)
            self.items.append(worker)

    def discard(self, url: str) -> None:
        at = self.where.pop(url, None)
        if at is None:
            return
        last = self.items.pop()
        if at < len(self.items):
            self.items[at] = last
            self.where[last.url] = at

    def draw(self, count: int, rng: random.Random) -> list[Worker]:
        """`count` distinct workers at random; all of them, in order, when there are no more."""
        items = self.items
        if len(items) <= count:
            return list(items)
        return [items[at] for at in rng.sample(range(len(items)), count)]


class _Pool:
    """The routable workers that serve one model (or any: the `None` pool)."""

    __slots__ = ("full", "roomy")

    def __init__(self) -> None:
        self.roomy = _Bag()
        self.full = _Bag()

    def __bool__(self) -> bool:
        return bool(self.roomy.items or self.full.items)


class Offer(NamedTuple):
    """A decision's candidates: fresh views of drawn workers with room, else (none has room)
    of drawn routable workers; `roomy` tells which."""

    views: list[WorkerView]
    roomy: bool


class FleetIndex:
    def __init__(
        self,
        membership: Membership,
        build: Callable[[Worker, float], WorkerView],
        rng: random.Random,
        sample: int,
        rescan_s: float = RESCAN_S,
    ) -> None:
        """`build(worker, now)` is a worker's view now; `sample` the workers a decision draws."""
        self._membership = membership
        self._build = build
        self._rng = rng
        self.sample = sample
        self._rescan_s = rescan_s
        self._room: RoomCheck | None = None
        self._dirty: dict[str, Worker] = {}
        # url -> (worker, the models it is placed under, whether in the roomy bags)
        self._placed: dict[str, tuple[Worker, frozenset[str], bool]] = {}
        # Views the last placing built, of workers it found roomy by `_room`, at `_fresh_at`: a
        # decision at that moment reads them instead of building and checking them again.
        self._fresh: dict[str, WorkerView] = {}
        self._fresh_at = -float("inf")
        self._pools: dict[str | None, _Pool] = {None: _Pool()}
        self._rescanned = -float("inf")
        # Workers with an idle kept-alive connection from this process, the latest last.
        self._idle_warm: dict[str, Worker] = {}
        membership.watch(self.mark)

    def mark(self, worker: Worker) -> None:
        """Something about `worker` changed: it is placed again before the next decision."""
        self._dirty[worker.url] = worker

    def mark_all(self) -> None:
        for worker in self._membership.by_url.values():
            self._dirty[worker.url] = worker

    # -- what decisions ask ----------------------------------------------------------------
    def offer(self, model: str | None, room: RoomCheck, exclude: Iterable[str] = ()) -> Offer:
        """Up to `sample` views of routable workers that serve `model`, not in `exclude`: those
        with room if any has, else any (empty when none is routable)."""
        now = time.monotonic()
        sorted_by = self._refresh(room, now)
        pool = self._pools.get(model)
        if pool is None or not (pool.roomy.items or pool.full.items):
            return Offer([], False)
        skip = frozenset(exclude)
        views = self._draw_roomy(pool, room, skip, now)
        if not views and self._rescan(now):
            self._flush(sorted_by, now)
            views = self._draw_roomy(pool, room, skip, now)
        if views:
            return Offer(views, True)
        drawn = [w for w in pool.full.draw(self.sample + len(skip), self._rng) if w.url not in skip]
        built = [self._build(worker, now) for worker in drawn[: self.sample]]
        return Offer([view for view in built if view.healthy], False)

    def routable_models(self, room: RoomCheck) -> frozenset[str]:
        """Every model some routable worker serves."""
        self._refresh(room, time.monotonic())
        return frozenset(model for model, pool in self._pools.items() if model and pool)

    def any_routable(self, room: RoomCheck) -> bool:
        self._refresh(room, time.monotonic())
        return bool(self._pools[None])

    def roomy_models(self, room: RoomCheck) -> tuple[bool, frozenset[str]]:
        """Whether any worker has room, and the models those with room serve."""
        now = time.monotonic()
        sorted_by = self._refresh(room, now)
        if not self._pools[None].roomy and self._rescan(now):
            self._flush(sorted_by, now)
        roomy = bool(self._pools[None].roomy)
        models = frozenset(m for m, pool in self._pools.items() if m and pool.roomy)
        return roomy, models

    # -- keeping the bags ------------------------------------------------------------------
    def _refresh(self, room: RoomCheck, now: float) -> RoomCheck:
        """The room the bags are sorted by, with every change since placed: the first room
        policy asked with; `ANY_ROOM` (a retry, routing without flow control) reads the same
        bags, roomy first."""
        if self._room is None or (room is not self._room and room is not ANY_ROOM):
            self._room = room
            self.mark_all()
        if self._dirty:
            self._flush(self._room, now)
        return self._room

    def _rescan(self, now: float) -> bool:
        """Whether to look at the full workers again (no roomy one is left), for room no event
        here told of (module docstring); they are marked if so."""
        if now - self._rescanned < self._rescan_s:
            return False
        self._rescanned = now
        for worker in self._pools[None].full.items:
            self._dirty[worker.url] = worker
        return True

    def _flush(self, room: RoomCheck, now: float) -> None:
        dirty, self._dirty = self._dirty, {}
        if self._fresh_at != now:
            self._fresh.clear()
            self._fresh_at = now
        for url, worker in dirty.items():
            self._place(url, worker, room, now)

    def _place(self, url: str, worker: Worker, room: RoomCheck, now: float) -> None:
        """Puts the worker in the bags its view says (it stays where it is when that has not
        changed, as under load, where only its counts do)."""
        self._idle_warm.pop(url, None)
        if worker.in_flight == 0 and now - worker.released_at < WARM_S:
            self._idle_warm[url] = worker  # its request just ended (module docstring)
        if self._fresh_at == now:
            self._fresh.pop(url, None)
        placed = self._placed.get(url)
        # None: removed (or replaced by a new worker at the same URL, marked too)
        view = self._build(worker, now) if self._membership.by_url.get(url) is worker else None
        if view is None or not view.healthy:
            if placed is not None:
                self._unplace(url, placed[1])
            return
        roomy = room.has_room(view)
        if roomy and room is self._room and self._fresh_at == now:
            self._fresh[url] = view  # only views of the placing at `_fresh_at` are kept
        if placed is not None:
            if placed[2] == roomy and (placed[1] is view.models or placed[1] == view.models):
                return
            self._unplace(url, placed[1])
        self._placed[url] = (worker, view.models, roomy)
        for model in (None, *view.models):
            into = self._pools.get(model)
            if into is None:
                into = self._pools[model] = _Pool()
            (into.roomy if roomy else into.full).add(worker)

    def _unplace(self, url: str, models: frozenset[str]) -> None:
        del self._placed[url]
        for model in (None, *models):
            pool = self._pools[model]
            pool.roomy.discard(url)
            pool.full.discard(url)

    def _check(self, worker: Worker, room: RoomCheck, now: float, views: list[WorkerView]) -> None:
        """Adds the worker's view to `views` if it has room by `room`; else (its room went
        without an event, module docstring) it moves bags."""
        view = self._roomy_view(worker, room, now)
        if view is not None:
            views.append(view)
        else:
            self._place(worker.url, worker, self._room or room, now)

    def _roomy_view(self, worker: Worker, room: RoomCheck, now: float) -> WorkerView | None:
        """The worker's view now if it has room by `room`, else None: the one placing found
        roomy a moment ago if there is one (`_fresh`), else built and checked."""
        if now == self._fresh_at and room is self._room:
            view = self._fresh.get(worker.url)
            if view is not None:
                return view
        view = self._build(worker, now)
        return view if room.has_room(view) else None

    def _draw_roomy(
        self, pool: _Pool, room: RoomCheck, skip: frozenset[str], now: float
    ) -> list[WorkerView]:
        """Fresh views of up to `sample` roomy workers, each checked again: one found full
        (module docstring) moves bags and another is drawn, a few times."""
        if len(pool.roomy) <= self.sample:  # looked at whole, the warm workers among them
            views: list[WorkerView] = []
            for worker in list(pool.roomy.items):
                if worker.url not in skip:
                    self._check(worker, room, now, views)
            return views
        views = self._warm(pool, room, skip, now)
        seen = set(skip)
        seen.update(view.name for view in views)
        for _ in range(4):
            wanted = self.sample - len(views)
            if wanted <= 0:
                break
            roomy = pool.roomy
            whole = len(roomy) <= wanted + len(seen)  # every roomy worker is drawn
            drawn = roomy.draw(wanted + len(seen), self._rng)
            fresh = [worker for worker in drawn if worker.url not in seen][:wanted]
            for worker in fresh:
                seen.add(worker.url)
                self._check(worker, room, now, views)
            if whole or not fresh:
                break  # every roomy worker was looked at
        return views

    def _warm(
        self, pool: _Pool, room: RoomCheck, skip: frozenset[str], now: float
    ) -> list[WorkerView]:
        """Views of up to WARM_DRAWN workers with an idle kept-alive connection from this
        process (`WorkerView.warm`) and room; the latest released first."""
        idle_warm = self._idle_warm
        while idle_warm:  # the oldest first: those whose keep-alive has lapsed go
            oldest = next(iter(idle_warm.values()))
            if now - oldest.released_at < WARM_S:
                break
            del idle_warm[oldest.url]
        views: list[WorkerView] = []
        roomy = pool.roomy.where
        for url, worker in reversed(idle_warm.items()):
            if url in skip or url not in roomy or worker.in_flight:
                continue
            view = self._roomy_view(worker, room, now)
            if view is not None:
                views.append(view)
                if len(views) == WARM_DRAWN:
                    break
        return views
