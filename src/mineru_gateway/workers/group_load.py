"""What every process of one gateway has in flight on each worker, in shared memory.

`serve --processes N` runs N processes, each routing on its own in-flight requests plus the
workers' reported queues. Another process's requests reached it only through the next reading,
up to `load_interval_s` old: at exactly full batches, two processes could each see the last free
slot of a worker and both send there, and one request waited for a whole answer to end in the
worker's queue (18 s with 512-token answers, in 2 rounds of 4: benchmarks/results/
processes_full_batch.md). Processes of one host can do better than replicas: each publishes its
count and estimated cost per worker in a table all of them map, and routes on the group's.

The table is a file in the processes' private directory (siblings.py), made by whichever process
opens it first: a row of (count, cost) pairs per process, one column per worker, and a row of
keys saying which worker a column is (a hash of its URL; 0 is a free column). Each process
writes only its own row; a column is claimed under an exclusive `flock` of the file (once per
worker, whichever process meets it first). A process that (re)starts zeroes its row: a process
that died holds nothing.

Instant counts are not enough: requests that end in the same engine step on two workers bring
their clients' next requests to two processes at the same moment, and both can read the table
before either has written it (with the counts alone, still 1 round in 4). So a routing decision,
from reading the views to taking the lease, holds the table's lock (`WorkerRegistry.deciding`):
two flock calls per request, the processes deciding one at a time (then none in 6).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

# Workers whose counts can be shared over the gateway's life: columns are not reused, and pods
# on Kubernetes come back with new addresses (4,096 columns: 32 KB of keys, 64 KB a process).
COLUMNS = 4096
_PAIR = 2  # (count, cost) per process and worker


class GroupFull(Exception):
    """Every column of the table is taken."""


def table_size(processes: int, columns: int = COLUMNS) -> int:
    """Bytes of a table for `processes` processes: the keys, then a row per process."""
    return 8 * columns + 8 * _PAIR * columns * processes


def _key(url: str) -> int:
    """A worker's key: 63 bits of a hash of its URL, never 0 (a free column)."""
    digest = int.from_bytes(hashlib.blake2b(url.encode(), digest_size=8).digest(), "big")
    return (digest >> 1) or 1


class GroupLoad:
    """One process's view of the table: its own row to write, the others' to add up."""

    def __init__(self, path: Path, processes: int, index: int, columns: int = COLUMNS) -> None:
        self._columns = columns
        size = table_size(processes, columns)
        self._depth = 0  # `locked` blocks open
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with self.locked():
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # zero-filled
        self._map = mmap.mmap(self._fd, size)
        self._keys = memoryview(self._map)[: 8 * columns].cast("q")
        self._values = memoryview(self._map)[8 * columns :].cast("d")
        self._own = _PAIR * columns * index  # where this process's row starts
        self._others = [_PAIR * columns * i for i in range(processes) if i != index]
        self._values[self._own : self._own + _PAIR * columns] = memoryview(
            bytes(8 * _PAIR * columns)
        ).cast("d")

    def column(self, url: str) -> int:
        """The worker's column, claimed if no process has yet."""
        key = _key(url)
        found = self._find(key)
        if found is not None and self._keys[found] == key:
            return found
        with self.locked():
            found = self._find(key)  # another process may have claimed it meanwhile
            if found is None:
                raise GroupFull(f"more than {self._columns} workers seen")
            self._keys[found] = key
            return found

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The table to this process alone for the block (an exclusive flock). Blocks may nest
        (a lease released in a decision can pump the queue, which decides): the lock is let go
        when the outermost ends."""
        self._depth += 1
        if self._depth == 1:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _find(self, key: int) -> int | None:
        """The column holding `key`, else the first free one on its probe path, else None."""
        start = key % self._columns
        for step in range(self._columns):
            column = (start + step) % self._columns
            held = self._keys[column]
            if held == key or held == 0:
                return column
        return None

    def publish(self, column: int, count: int, cost: float) -> None:
        """This process's requests on the worker and their estimated cost, now."""
        at = self._own + _PAIR * column
        self._values[at] = count
        self._values[at + 1] = cost

    def others(self, column: int) -> tuple[int, float]:
        """The other processes' requests on the worker and their cost, summed."""
        count, cost = 0.0, 0.0
        values = self._values
        for row in self._others:
            at = row + _PAIR * column
            count += values[at]
            cost += values[at + 1]
        return int(count), cost

    def close(self) -> None:
        self._keys.release()
        self._values.release()
        self._map.close()
        os.close(self._fd)
