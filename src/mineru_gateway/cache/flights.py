"""Shared generations (single flight): identical requests in flight wait for one generation.

A generation runs in a task of its own, not in any client's: a client that leaves stops waiting
without stopping it while others still wait; the last to leave cancels it, which closes the
upstream request as a lone client's leaving does (api/relay.py). Every waiter gets the same
outcome: the answer, or the error the generation ended with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    __slots__ = ("_task", "abandoned", "waiters")

    def __init__(self, task: asyncio.Task[T]) -> None:
        self._task = task
        self.waiters = 0
        self.abandoned = False  # every waiter left: it is being cancelled

    async def wait(self) -> T:
        """The generation's result; leaving (this task cancelled) as the last waiter cancels
        the generation."""
        self.waiters += 1
        try:
            return await asyncio.shield(self._task)
        finally:
            self.waiters -= 1
            if self.waiters == 0 and not self._task.done():
                self.abandoned = True
                self._task.cancel()

    @property
    def joinable(self) -> bool:
        return not self.abandoned and not self._task.done()


class Flights(Generic[T]):
    """Generations in flight by key; `register` False runs them without sharing."""

    def __init__(self, register: bool = True) -> None:
        self._register = register
        self._flying: dict[bytes, Flight[T]] = {}

    def find(self, key: bytes) -> Flight[T] | None:
        flight = self._flying.get(key)
        return flight if flight is not None and flight.joinable else None

    def start(self, key: bytes, work: Coroutine[Any, Any, T]) -> Flight[T]:
        task = asyncio.ensure_future(work)
        flight = Flight(task)
        if self._register:
            self._flying[key] = flight
            task.add_done_callback(lambda done: self._landed(key, flight, done))
        else:
            task.add_done_callback(_retrieved)
        return flight

    def __len__(self) -> int:
        return len(self._flying)

    def _landed(self, key: bytes, flight: Flight[T], done: asyncio.Future[Any]) -> None:
        _retrieved(done)
        if self._flying.get(key) is flight:
            del self._flying[key]


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Marks the outcome read: its waiters read it, or all left and nobody will."""
    if not task.cancelled():
        task.exception()
