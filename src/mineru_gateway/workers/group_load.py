"""What every process of one gateway has in flight on each worker, in shared memory.

`serve --processes N` runs N processes, each routing on its own in-flight requests plus the
workers' reported queues. Another process's requests would reach it only through the next
reading, up to `load_interval_s` old: at exactly full batches, two processes could each see the
last free slot of a worker and both send there, and one request would wait in the worker's queue
for a whole answer to end (benchmarks/results/processes_full_batch.md). Processes of one host can
do better than replicas: each publishes its count and estimated cost per worker in a table all
of them map, and routes on the group's.

The table is a file in the processes' private directory (siblings.py), made by whichever process
opens it first: a row of (count, cost) pairs per process, one column per worker, and a row of
keys saying which worker a column is (a hash of its URL; 0 is a free column). Each process
writes only its own row; a column is claimed under an exclusive `flock` of the file (once per
worker, whichever process meets it first). A process that (re)starts zeroes its row: a process
that died holds nothing.

Columns are reused: each process marks the columns it holds, and a column no process has held
for `RECLAIM_AFTER_S` (a worker removed, a pod replaced by one at a new address) is free for
another worker once the table has no free column left (docs/operate/fleet-scale.md).

Instant counts are not enough: requests that end in the same engine step on two workers bring
their clients' next requests to two processes at the same moment, and both can read the table
before either has written it (benchmarks/results/processes_full_batch.md). So a routing
decision, from reading the views to taking the lease, holds the table's lock
(`Coordination.deciding`, workers/coordination.py): two flock calls per request, the processes
deciding one at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import math
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

log = structlog.get_logger("mineru_gateway.group_load")

# Workers whose counts can be shared at once; columns of workers gone are reused (8 bytes of key
# and 8 of release time per column, 8 + 16 per process).
COLUMNS = 4096
WIDTH = 2  # a worker's figures per process: (count, cost)
RECLAIM_AFTER_S = 60.0  # a column no process has held for this long is free for another worker
_TOMBSTONE = -1  # a reclaimed column's key: free to claim, but probing goes on past it


class GroupFull(Exception):
    """Every column of the table is taken."""


def _mapped(path: Path, size: int) -> tuple[int, mmap.mmap]:
    """The processes' shared file at `path`, made (zero-filled) to `size` bytes by whichever
    process opens it first, and mapped: its descriptor and its map."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)  # zero-filled
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return fd, mmap.mmap(fd, size)


def _write(values: memoryview[float], at: int, figures: tuple[float, ...]) -> None:
    """`figures` into `values` from `at`, item by item: a slice assignment needs a buffer built
    first, twice the cost for a few figures."""
    for figure in figures:
        values[at] = figure
        at += 1


def table_size(processes: int, columns: int = COLUMNS, width: int = WIDTH) -> int:
    """Bytes of a table for `processes` processes: the keys, when each column was last let go,
    which process holds it, then a row of figures per process."""
    return 8 + 16 * columns + 8 * columns * processes + 8 * width * columns * processes


def key_of(name: str) -> int:
    """A column's key: 63 bits of a hash of its name (a worker's URL, a tenant's name), never 0
    (a free column)."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")
    return (digest >> 1) or 1


class GroupLoad:
    """One process's view of the table: its own row to write, the others' to add up. A column
    holds `width` figures per process (a worker's count and cost; a tenant's counts:
    `TENANT_WIDTH`)."""

    def __init__(
        self,
        path: Path,
        processes: int,
        index: int,
        columns: int = COLUMNS,
        width: int = WIDTH,
        reclaim_after_s: float = RECLAIM_AFTER_S,
    ) -> None:
        self._columns = columns
        self._reclaim_after_s = reclaim_after_s
        self._width = width
        self._depth = 0  # `locked` blocks open
        self._fd, self._map = _mapped(path, table_size(processes, columns, width))
        start, held = 8 + 16 * columns, 8 + 16 * columns + 8 * columns * processes
        self._releases = memoryview(self._map)[:8].cast("q")
        self._keys = memoryview(self._map)[8 : 8 + 8 * columns].cast("q")
        self._gone = memoryview(self._map)[8 + 8 * columns : start].cast("d")
        self._held = memoryview(self._map)[start:held].cast("q")
        self._values = memoryview(self._map)[held:].cast("d")
        row = width * columns
        self._own = row * index  # where this process's row starts
        self._others = [row * i for i in range(processes) if i != index]
        self._values[self._own : self._own + row] = memoryview(bytes(8 * row)).cast("d")
        self._holders = [columns * i for i in range(processes)]
        self._own_held = columns * index
        with self.locked():  # what this process held before it (re)started is let go now
            now = time.monotonic()
            for column in range(columns):
                if self._held[self._own_held + column]:
                    self._held[self._own_held + column] = 0
                    self._gone[column] = now

    def column(self, name: str) -> int:
        """The column of a worker (by URL) or tenant (by name), claimed if no process has yet."""
        key = key_of(name)
        found = self._find(key)
        if found is not None and self._keys[found] == key:
            self._held[self._own_held + found] = 1
            return found
        with self.locked():
            found = self._find(key)  # another process may have claimed it meanwhile
            if found is None and self._reclaim():
                found = self._find(key)
            if found is None:
                log.warning("group_table_full", columns=self._columns, name=name)
                raise GroupFull(
                    f"all {self._columns} columns are held by workers in use, or let go less "
                    f"than {self._reclaim_after_s:g} s ago"
                )
            self._keys[found] = key
            self._held[self._own_held + found] = 1
            return found

    def release(self, name: str) -> None:
        """This process no longer uses the column of `name` (a worker removed): its figures
        there are zeroed, and once no process has held it for a while it may be reused."""
        key = key_of(name)
        found = self._find(key)
        if found is None or self._keys[found] != key:
            return
        with self.locked():
            self.publish_row(found, (0.0,) * self._width)
            self._held[self._own_held + found] = 0
            self._gone[found] = time.monotonic()

    def _reclaim(self) -> bool:
        """Frees the columns no process has held for `reclaim_after_s` (under the lock); whether
        any was. Walks the table: only when no column is free."""
        oldest = time.monotonic() - self._reclaim_after_s
        freed = 0
        for column in range(self._columns):
            key, gone = self._keys[column], self._gone[column]
            if key <= 0 or gone == 0.0 or gone > oldest:
                continue
            if any(self._held[holder + column] for holder in self._holders):
                continue
            self._keys[column] = _TOMBSTONE
            self._gone[column] = 0.0
            freed += 1
        if freed:
            log.info("group_table_columns_reclaimed", columns=freed)
        return freed > 0

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
        """The column holding `key`, else the first free or reclaimed one on its probe path,
        else None."""
        start = key % self._columns
        reclaimed = None
        for step in range(self._columns):
            column = (start + step) % self._columns
            held = self._keys[column]
            if held == key:
                return column
            if held == 0:
                return column if reclaimed is None else reclaimed
            if held == _TOMBSTONE and reclaimed is None:
                reclaimed = column
        return reclaimed

    def worker(self, url: str) -> WorkerColumn:
        """The worker's column, claimed if no process has yet (`GroupFull` if none is left)."""
        column = self.column(url)
        return WorkerColumn(self._values, self._own, self._others, column, self._releases)

    def releases(self) -> int:
        """A number that changes whenever any process's count on a worker falls: room may have
        appeared that no event of this process told of (fleet_index.py)."""
        return self._releases[0]

    def publish_row(self, column: int, figures: tuple[float, ...]) -> None:
        """This process's `width` figures in the column, now."""
        _write(self._values, self._own + self._width * column, figures)

    def total(self, column: int, figure: int) -> float:
        """Figure `figure` of the column summed over every process, this one included."""
        values, at = self._values, self._width * column + figure
        return values[self._own + at] + sum(values[row + at] for row in self._others)

    def others_row(self, column: int) -> list[float]:
        """The other processes' `width` figures in the column, each summed."""
        width, values = self._width, self._values
        sums = [0.0] * width
        for row in self._others:
            at = row + width * column
            for i in range(width):
                sums[i] += values[at + i]
        return sums

    def close(self) -> None:
        self._releases.release()
        self._keys.release()
        self._gone.release()
        self._held.release()
        self._values.release()
        self._map.close()
        os.close(self._fd)


class WorkerColumn:
    """One worker's column of the workers' table, as one process writes and reads it: the
    request path's use (three writes and a read per request), so each is a single call."""

    __slots__ = ("_others", "_own", "_releases", "_values")

    def __init__(
        self,
        values: memoryview[float],
        own: int,
        others: list[int],
        column: int,
        releases: memoryview[int],
    ) -> None:
        self._values = values
        self._own = own + WIDTH * column
        self._others = [row + WIDTH * column for row in others]
        self._releases = releases

    def publish(self, count: int, cost: float) -> None:
        """This process's requests on the worker and their estimated cost, now."""
        if count < self._values[self._own]:
            self._releases[0] += 1  # unlocked: a lost increment still changes the number
        self._values[self._own] = count
        self._values[self._own + 1] = cost

    def others(self) -> tuple[int, float]:
        """The other processes' requests on the worker and their cost, summed."""
        count, cost = 0.0, 0.0
        values = self._values
        for at in self._others:
            count += values[at]
            cost += values[at + 1]
        return int(count), cost


# -- tenants and queue heads --------------------------------------------------------------------

TENANT_WIDTH = 3  # a tenant's figures per process: (in flight, queued, queued bytes)


class GroupTenants:
    """Every process's counts of each tenant (`flow.TenantsElsewhere`), in a table of their own:
    a tenant's `max_in_flight` and `max_queued` and its fair share are then the whole gateway's,
    not each process's. Tenants are API keys and named tenants, so a bounded set; one met once
    the table is full is counted by this process alone, with a warning."""

    def __init__(self, table: GroupLoad) -> None:
        self._table = table
        self._columns: dict[str, int] = {}

    def column_of(self, tenant: str) -> int:
        """The tenant's column, claimed at first sight; -1 for one counted by this process
        alone."""
        column = self._columns.get(tenant)
        if column is None:
            try:
                column = self._table.column(tenant)
            except GroupFull as full:
                log.warning("tenant_counts_not_shared", tenant=tenant, reason=str(full))
                column = -1
            self._columns[tenant] = column
        return column

    def others(self, tenant: str) -> tuple[int, int, int]:
        column = self.column_of(tenant)
        if column < 0:
            return 0, 0, 0
        in_flight, queued, queued_bytes = self._table.others_row(column)
        return int(in_flight), int(queued), int(queued_bytes)

    def in_flight_limited(self, tenant: str) -> int:
        return self.others(tenant)[0]

    def publish(self, tenant: str, in_flight: int, queued: int, queued_bytes: int) -> None:
        column = self.column_of(tenant)
        if column >= 0:
            self._table.publish_row(column, (in_flight, queued, queued_bytes))

    def in_flight_at(self, column: int) -> float:
        """Every process's requests in flight of the tenant in `column`, this one's included."""
        return self._table.total(column, 0)


# when posted, priority, share, model key, when queued, tenant column, weight, and the tenant's
# requests in flight in other replicas (fleet state) when posted
_HEAD_WIDTH = 8


@functools.lru_cache(maxsize=256)
def model_key(model: str | None) -> float:
    """A model's key in a posted head, exact as a double (52 bits); 0 for a request that any
    worker serves."""
    return 0.0 if model is None else float(key_of(model) >> 11)


class QueueHeads:
    """Each process's most urgent queued request, posted for the others to give way to.

    A process's queue orders only its own requests, and room a request leaves is taken first by
    its own process (it pumps its queue at once; the others look every `SIBLING_POLL_S`). Left
    at that, a process that holds no room starves while a sibling keeps refilling the worker
    from its queue (benchmarks/results/flow_processes.md), and room goes to requests less urgent
    than one waiting elsewhere. So each process posts its head, and a process about to use room
    that only more urgent heads elsewhere should take leaves it and rings those processes
    (siblings.py, `Doorbell`), whose queues take it; a lost ring waits for that queue's next
    look.

    The order between processes: the priority band, then the tenant's share of the gateway's
    requests in flight for its weight (read from the tenants' table at the moment of the
    decision for both heads, so a request that just ended counts alike for both), then the
    longest waiting. The processes' views of a worker can differ for a while (each probes health
    itself; readings reach the others a little later), so a head that does not take the room it
    is left is passed over after a while (workers/coordination.py). A head older than the caller's
    `since` is ignored: its process has stopped posting (it died, or it is stuck), and room must
    not wait for it. Read and written under the workers' table lock
    (`Coordination.deciding`), so a head is never read half-written.
    """

    def __init__(
        self, path: Path, processes: int, index: int, tenants: GroupTenants | None = None
    ) -> None:
        self._tenants = tenants
        self._fd, self._map = _mapped(path, 8 * _HEAD_WIDTH * processes)
        self._values = memoryview(self._map).cast("d")
        self._own = _HEAD_WIDTH * index
        self._others = [(i, _HEAD_WIDTH * i) for i in range(processes) if i != index]
        self.clear()

    def post(
        self,
        at: float,
        priority: int,
        tenant: str,
        weight: float,
        share: float,
        model: str | None,
        queued_at: float,
    ) -> None:
        """This process's head now: its tenant's `share` stands for it where the tenant has no
        column; `queued_at` tells one head from the next and orders equal shares. What the
        share counts beyond the replica's table (other replicas' requests, fleet state) is
        posted with it, so that the head is ranked on the same counts as a share read here."""
        column = -1 if self._tenants is None else self._tenants.column_of(tenant)
        remote = 0.0
        if column >= 0 and self._tenants is not None:
            remote = max(0.0, share * weight - self._tenants.in_flight_at(column))
        head = (at, priority, share, model_key(model), queued_at, column, weight, remote)
        _write(self._values, self._own, head)

    def clear(self) -> None:
        self._values[self._own] = -math.inf  # posted never

    def ahead(
        self, priority: int, share: float, queued_at: float, since: float
    ) -> list[tuple[int, float, float]]:
        """The heads, posted at `since` or later, that go before a request of `priority`,
        queued at `queued_at`, whose tenant holds `share` (module docstring: band, share,
        age), as (process index, model key, when queued)."""
        values, found = self._values, []
        for index, at in self._others:
            if values[at] < since or values[at + 1] > priority:
                continue
            theirs = values[at + 2]
            column = int(values[at + 5])
            if column >= 0 and self._tenants is not None:
                in_flight = self._tenants.in_flight_at(column) + values[at + 7]
                theirs = in_flight / values[at + 6]
            if (values[at + 1], theirs, values[at + 4]) < (priority, share, queued_at):
                found.append((index, values[at + 3], values[at + 4]))
        return found

    def waiting(self, since: float) -> list[int]:
        """The other processes with a head posted at `since` or later."""
        values, found = self._values, []
        for index, at in self._others:
            if values[at] >= since:
                found.append(index)
        return found

    def posted_since(self, since: float) -> bool:
        """Whether any other process has a head posted at `since` or later: asked on every
        request (no process has requests waiting, most of the time), before anything dearer."""
        values = self._values
        for _, at in self._others:  # noqa: SIM110 - any() over a generator costs more
            if values[at] >= since:
                return True
        return False

    def close(self) -> None:
        self._values.release()
        self._map.close()
        os.close(self._fd)
