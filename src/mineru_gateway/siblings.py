"""Several gateway processes on one port: how each reaches the others, and one `/metrics` for all.

`serve --processes N` (entry/processes.py) starts N processes that each listen on the gateway's
port with SO_REUSEPORT: the kernel spreads new connections over them. Each process keeps its own
worker registry, queue and counters and routes on its own in-flight counts plus the workers'
reported queues (the same signal that balances several gateway replicas). Besides the port, each
serves the whole gateway app on a private Unix socket in a directory only its user can open;
requests arriving there are marked as a sibling's. Through those sockets a process

- answers `/metrics` for the whole gateway: it asks every sibling for its own figures (as
  JSON, `families_json`: merging parsed JSON costs far less than parsing N expositions) and
  merges them (`merge_families`), so dashboards and alerts read the same series whether one
  process or many run;
- applies an operator's change to every process: adding, removing, draining or undraining a
  worker is forwarded to the siblings, or the processes would route differently;
- reads and probes the workers once for all: the first process reads their `/metrics` and
  probes their health, and the others take what it found (`readings`: each worker's reading,
  health and models), so a worker's API server answers one replica however many processes
  there are (each read costs it CPU: benchmarks/results/scrape_cost.md). The reader keeps each
  worker's part of its answer serialised until the worker changes (`Findings`), so a fetch
  joins bytes rather than serialising the fleet. A reading carries the time it was taken
  (time.monotonic() is one clock for the whole host), so it ages the same in every process;
  while the first process restarts, the others' figures age and they route on their own counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import orjson
import structlog
from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from mineru_gateway.vllm_contract import VllmLoad
from mineru_gateway.workers.group_load import (
    TENANT_WIDTH,
    GroupLoad,
    GroupTenants,
    QueueHeads,
)
from mineru_gateway.workers.worker import Scrape, Shared, Worker

log = structlog.get_logger("mineru_gateway.siblings")

SIBLING_SCOPE_KEY = "mineru_gateway.sibling"  # set on requests that came over a sibling socket
SHARED_READINGS_PATH = "/v1/internal/readings"  # answered over a sibling socket only
# A sibling's /metrics request asks for this: its figures as JSON (`families_json`), not text.
FAMILIES_TYPE = "application/x-mineru-gateway-families+json"
READER = 0  # the process that reads the workers' /metrics for all
IN_FLIGHT_FIELD = "gateway_in_flight"  # in a shared reading: the gateway's count at the read
GROUP_TABLE = "in-flight.table"  # every process's counts per worker (workers/group_load.py)
TENANT_TABLE = "tenants.table"  # every process's counts per tenant
QUEUE_HEADS = "queue-heads.table"  # every process's most urgent waiting request
# Below the siblings' servers' keep-alive (uvicorn's 5 s), so that a connection is never reused
# just as the other side closes it.
SIBLING_KEEPALIVE_S = 4.0

# Gauges that count what each process holds: the gateway's is the sum over its processes. Every
# other gauge describes something all processes see alike (a worker's health or reported queue,
# the version): the largest value stands for all, except the start time, where the earliest does.
SUMMED_GAUGES = frozenset(
    {
        "mineru_gateway_requests_in_flight",
        "mineru_gateway_queue_requests",
        "mineru_gateway_queue_bytes",
        "mineru_gateway_tenant_requests_in_flight",
        "mineru_gateway_queue_depth",
        "mineru_gateway_fleet_state_slots",
        "mineru_gateway_cache_bytes",  # each process holds its own memory cache
    }
)
EARLIEST_GAUGES = frozenset({"mineru_gateway_start_time_seconds"})
PROCESSES_GAUGE = "mineru_gateway_processes"


# A process's figures as plain data: (name, type, documentation, [(sample, labels, value)]).
FamilyData = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


def families_of(metrics: Iterable[Metric]) -> list[FamilyData]:
    return [
        (m.name, m.type, m.documentation, [(s.name, s.labels, s.value) for s in m.samples])
        for m in metrics
    ]


def families_json(registry: CollectorRegistry) -> bytes:
    """This process's figures for a sibling to merge (`merge_families`)."""
    return orjson.dumps(families_of(registry.collect()))


def merge_expositions(texts: Sequence[str]) -> bytes:
    """`merge_families` of Prometheus expositions (text)."""
    return merge_families([families_of(text_string_to_metric_families(t)) for t in texts])


def merge_families(processes: Sequence[Sequence[FamilyData]]) -> bytes:
    """One Prometheus exposition for the processes whose own figures are `processes`.

    Counters and histograms add up; gauges follow SUMMED_GAUGES / EARLIEST_GAUGES, else the
    largest value. `mineru_gateway_processes` says how many processes answered.
    """
    families: dict[str, Metric] = {}
    tables: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for process in processes:
        for name, kind, documentation, samples in process:
            merged = families.get(name)
            if merged is None:
                merged = families[name] = Metric(name, documentation, kind)
                tables[name] = {}
            table = tables[name]
            rule = _rule(name, kind)
            for sample_name, labels, value in samples:
                key = (sample_name, tuple(sorted(labels.items())))
                before = table.get(key)
                table[key] = value if before is None else rule(before, value)
    for name, merged in families.items():
        for (sample_name, pairs), value in tables[name].items():
            merged.add_sample(sample_name, dict(pairs), value)
    count = Metric(PROCESSES_GAUGE, "Gateway processes whose figures this scrape holds.", "gauge")
    count.add_sample(PROCESSES_GAUGE, {}, float(len(processes)))
    families[PROCESSES_GAUGE] = count
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families.values()))
    return generate_latest(registry)


class Doorbell:
    """A datagram socket per process, in the siblings' directory. A process that leaves room
    for a more urgent request waiting in another rings that one, whose queue then looks at
    once rather than at its next `SIBLING_POLL_S` (workers/coordination.py): the room stands
    empty for the time a datagram takes, not a whole poll. A ring that gets lost (the other
    process is restarting, its socket's buffer is full) costs only that wait."""

    def __init__(self, paths: Sequence[Path], index: int) -> None:
        self._paths = [str(path) for path in paths]
        self._index = index
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None  # listening on it

    def listen(self, on_ring: Callable[[], None]) -> None:
        """Calls `on_ring()` (in the running loop) whenever another process rings."""
        path = self._paths[self._index]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by this process's previous life
        self._socket.bind(path)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.fileno(), self._rung, on_ring)

    def _rung(self, on_ring: Callable[[], None]) -> None:
        with contextlib.suppress(BlockingIOError):
            while True:  # one look answers every ring so far
                self._socket.recv(16)
        on_ring()

    def ring(self, index: int) -> None:
        with contextlib.suppress(OSError):
            self._socket.sendto(b"!", self._paths[index])

    def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._socket.fileno())
            self._loop = None
        self._socket.close()


def _rule(name: str, kind: str) -> Callable[[float, float], float]:
    if kind != "gauge" or name in SUMMED_GAUGES:
        return operator.add
    if name in EARLIEST_GAUGES:
        return min
    return max


class _Fixed(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


@dataclass(slots=True, eq=False)
class Siblings:
    """This process's place among the gateway's processes, and its way to the others: a client
    that keeps a session per sibling, so an object with state, compared by identity (not a
    frozen value). Made before the processes start and handed to each (pickled, sessionless)."""

    index: int
    count: int
    directory: Path
    _sessions: dict[int, aiohttp.ClientSession] = field(
        default_factory=dict, init=False, repr=False
    )
    _doorbell: Doorbell | None = field(default=None, init=False, repr=False)

    def socket_path(self, index: int) -> Path:
        return self.directory / f"gateway-{index}.sock"

    @property
    def own_socket(self) -> Path:
        return self.socket_path(self.index)

    def group_load(self) -> GroupLoad:
        """The table of every process's in-flight requests per worker (group_load.py)."""
        return GroupLoad(self.directory / GROUP_TABLE, self.count, self.index)

    def group_tenants(self) -> GroupTenants:
        """Every process's counts per tenant, for the tenants' limits and shares."""
        table = GroupLoad(self.directory / TENANT_TABLE, self.count, self.index, width=TENANT_WIDTH)
        return GroupTenants(table)

    def queue_heads(self, tenants: GroupTenants) -> QueueHeads:
        """Every process's most urgent waiting request, for the others to give way to, ranked
        by the shares in `tenants`."""
        return QueueHeads(self.directory / QUEUE_HEADS, self.count, self.index, tenants)

    def doorbell(self) -> Doorbell:
        """This process's doorbell (one per process, closed with the siblings' sessions)."""
        if self._doorbell is None:
            paths = [self.directory / f"doorbell-{index}.sock" for index in range(self.count)]
            self._doorbell = Doorbell(paths, self.index)
        return self._doorbell

    @property
    def others(self) -> list[int]:
        return [index for index in range(self.count) if index != self.index]

    async def request(
        self,
        index: int,
        method: str,
        path: str,
        headers: Mapping[str, str] | None = None,
        body: bytes = b"",
        timeout_s: float = 10.0,
    ) -> tuple[int, bytes]:
        """One request to sibling `index` over its socket: (status, body)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session(index).request(
            method, "http://sibling" + path, headers=dict(headers or {}), data=body, timeout=timeout
        ) as response:
            return response.status, await response.read()

    def _session(self, index: int) -> aiohttp.ClientSession:
        """One keep-alive session per sibling, made in the event loop that first asks. A
        session and a connection for each request cost every process more than its own idle
        work: the readings alone are taken five times a second."""
        session = self._sessions.get(index)
        if session is None or session.closed:
            connector = aiohttp.UnixConnector(
                path=str(self.socket_path(index)), keepalive_timeout=SIBLING_KEEPALIVE_S
            )
            session = self._sessions[index] = aiohttp.ClientSession(connector=connector)
        return session

    async def close(self) -> None:
        """Closes the sessions to the siblings and the doorbell (at the app's shutdown)."""
        if self._doorbell is not None:
            self._doorbell.close()
            self._doorbell = None
        sessions = list(self._sessions.values())
        self._sessions.clear()
        for session in sessions:
            await session.close()

    async def metrics(self, own: CollectorRegistry) -> bytes:
        """The whole gateway's /metrics: this process's figures (`own`) and its siblings'.

        A sibling that does not answer (restarting) is left out of this scrape and logged.
        """
        headers = {"accept": FAMILIES_TYPE}
        answers = await asyncio.gather(
            *(
                self.request(index, "GET", "/metrics", headers, timeout_s=5.0)
                for index in self.others
            ),
            return_exceptions=True,
        )
        processes = [families_of(own.collect())]
        for index, answer in zip(self.others, answers, strict=True):
            if isinstance(answer, BaseException) or answer[0] != 200:
                log.warning("sibling_metrics_missing", process=index, error=repr(answer)[:200])
                continue
            processes.append(orjson.loads(answer[1]))
        return merge_families(processes)

    async def forward(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> int:
        """Repeats an operator's change on every sibling; returns how many did not take it."""
        answers = await asyncio.gather(
            *(self.request(index, method, path, headers, body) for index in self.others),
            return_exceptions=True,
        )
        failed = 0
        for index, answer in zip(self.others, answers, strict=True):
            if isinstance(answer, BaseException) or answer[0] >= 300:
                failed += 1
                log.error(
                    "sibling_change_failed", process=index, path=path, error=repr(answer)[:300]
                )
        return failed

    async def readings(self) -> dict[str, Shared]:
        """What the reading process found of each worker; nothing while it does not answer
        (restarting), so that the figures age."""
        try:
            status, body = await self.request(READER, "GET", SHARED_READINGS_PATH, timeout_s=1.0)
        except (aiohttp.ClientError, TimeoutError):
            return {}
        if status != 200:
            return {}
        return findings_from_json(body)


class Findings:
    """The reading process's findings for its siblings, as JSON: each worker's part made
    again only when what it shows changed (compared by identity and value), the whole joined
    per fetch."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[Scrape | None, bool, object, str | None, bytes]] = {}

    def body(self, workers: Iterable[Worker]) -> bytes:
        parts: dict[str, tuple[Scrape | None, bool, object, str | None, bytes]] = {}
        for worker in workers:
            part = self._parts.get(worker.url)
            if (
                part is None
                or part[0] is not worker.scrape
                or part[1] != worker.healthy
                or part[2] is not worker.models
                or part[3] != worker.last_error
            ):
                fields = {
                    "reading": None if worker.scrape is None else reading_json(worker.scrape),
                    "healthy": worker.healthy,
                    "models": worker.models,
                    "error": worker.last_error,
                }
                encoded = orjson.dumps(worker.url) + b":" + orjson.dumps(fields)
                part = (worker.scrape, worker.healthy, worker.models, worker.last_error, encoded)
            parts[worker.url] = part
        self._parts = parts
        return b"{" + b",".join(part[4] for part in parts.values()) + b"}"


def findings_from_json(body: bytes) -> dict[str, Shared]:
    found = {}
    for url, fields in orjson.loads(body).items():
        reading = fields["reading"]
        scrape = None if reading is None else reading_from_json(reading)
        found[url] = Shared(scrape, fields["healthy"], fields["models"], fields["error"])
    return found


def reading_json(scrape: Scrape) -> dict[str, float]:
    return {**asdict(scrape.load), "at": scrape.at, IN_FLIGHT_FIELD: scrape.own_in_flight}


def reading_from_json(fields: Mapping[str, float]) -> Scrape:
    """A shared reading, with the gateway's count when it was read."""
    values = {name: value for name, value in fields.items() if name not in ("at", IN_FLIGHT_FIELD)}
    return Scrape(VllmLoad(**values), fields["at"], int(fields[IN_FLIGHT_FIELD]))
