"""Shared generations (single flight): identical requests in flight wait for one generation.

The first request of a key leads: its generation runs in its own task, as any request's work
does, and the requests that arrive while it runs wait for its outcome (`Flight.wait`). Nothing
is spawned per request, and a waiter costs a future only when one arrives.

Leaving: a waiter that leaves stops waiting. The leader's client leaving while others wait does
not stop the generation (`Flight.leader_left`: the relay asks it, api/relay.py); the last one
to leave, leader or waiter, cancels it, which closes the upstream request as a lone client's
leaving does. Every waiter gets the same outcome: the answer, or the error the generation ended
with.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    """One generation in flight: the leader's task, and the outcome its waiters wait for."""

    __slots__ = ("_leader", "_outcome", "abandoned", "leader_gone", "waiters")

    def __init__(self, leader: asyncio.Task[object]) -> None:
        self._leader = leader
        self._outcome: asyncio.Future[T] | None = None  # made when a first waiter arrives
        self.waiters = 0
        self.leader_gone = False  # the leader's client left; the generation goes on for others
        self.abandoned = False  # every client left: it is being cancelled

    async def wait(self) -> T:
        """The generation's outcome; leaving (this task cancelled) as the last one cancels the
        generation."""
        outcome = self._outcome
        if outcome is None:
            outcome = self._outcome = self._leader.get_loop().create_future()
        self.waiters += 1
        try:
            return await asyncio.shield(outcome)
        finally:
            self.waiters -= 1
            if self.waiters == 0 and self.leader_gone and not outcome.done():
                self.abandoned = True
                self._leader.cancel()

    def leader_left(self) -> bool:
        """The leader's client left: True (the generation goes on) while others wait."""
        if self.waiters == 0 or self.abandoned:
            self.abandoned = True  # being cancelled: no request may join it now
            return False
        self.leader_gone = True
        return True

    def landed(self, result: T) -> None:
        if self._outcome is not None and not self._outcome.done():
            self._outcome.set_result(result)

    def failed(self, error: BaseException) -> None:
        outcome = self._outcome
        if outcome is None or outcome.done():
            return
        if isinstance(error, asyncio.CancelledError):
            outcome.cancel()
        else:
            outcome.set_exception(error)
            outcome.exception()  # read: every waiter may have left

    @property
    def joinable(self) -> bool:
        return not self.abandoned and (self._outcome is None or not self._outcome.done())


class Flights(Generic[T]):
    """Generations in flight by key; `register` False leads them without sharing."""

    def __init__(self, register: bool = True) -> None:
        self._register = register
        self._flying: dict[bytes, Flight[T]] = {}
        # The loop the generations run on, named to `current_task`: looked up without it, the
        # running loop costs a getpid() system call per request on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    def find(self, key: bytes) -> Flight[T] | None:
        flight = self._flying.get(key)
        return flight if flight is not None and flight.joinable else None

    def lead(self, key: bytes) -> Flight[T]:
        """A generation the current task leads; `landed` (or `failed`) then `done`."""
        task = None if self._loop is None else asyncio.current_task(self._loop)
        if task is None:  # the first generation, or one on another loop (tests)
            self._loop = asyncio.get_running_loop()
            task = asyncio.current_task(self._loop)
        assert task is not None
        flight: Flight[T] = Flight(task)
        if self._register:
            self._flying[key] = flight
        return flight

    def done(self, key: bytes, flight: Flight[T]) -> None:
        if self._flying.get(key) is flight:
            del self._flying[key]

    def __len__(self) -> int:
        return len(self._flying)
