"""The markdown summary of cache.json, written from the document alone."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

NOTES = """\
## How to read these figures

- Every server is its own process (`mineru-gateway sim`, `mineru-gateway serve`,
  `redis-server`); the client is the benchmark's own raw HTTP/1.1 connections
  (benchmarks/cache/raw.py), so its cost stays small next to the gateway's.
- CPU is the gateway process's user + system time from /proc, so other jobs on the machine
  change it less than they change wall times; latency and wall times on a shared machine are
  noisy, p99 most of all (load average at the end of the run above).
- Small requests: every request is distinct, so every cacheable one is a miss: the cost of
  coalescing (on by default) and of each store when it does not help. Each round sends the same
  number of requests to each gateway, in an order rotated each round; the ratio is the median
  over rounds of the gateway's CPU per request against cache_off's in the same round.
- A hit's latency is from the request's first byte written to the answer's last byte read, one
  request at a time on one keep-alive connection; "in process" splits the gateway's part of it.
- Memory bound: distinct answers of about 1.2 kB each through the memory cache, many times its
  bound, one tenant given the whole cache; the overhead is the peak RSS minus the RSS before
  the first answer minus the bound. The bound counts each answer's body and what the entry
  costs beyond it (`OVERHEAD_BYTES`, cache/answers.py).
- MinerU's client: the wall time of a pass is the client's own work (resizing and encoding each
  page and block, on the same shared cores) plus waiting for answers; its CPU is the client
  process's own. A second pass answered from the cache leaves the first of the two.

## What a miss and a hit cost, and where

- **A miss** (a request neither cache nor flight can answer) pays for the key (a sorted dump
  of the body, its BLAKE3 hash and the tenant-scoped hash), the look for a flight, the
  `X-Cache` header and, for the leader, holding the answer on its own exchange until it is
  whole. A store adds its lookup, and for a complete answer a write: in place in memory, a GET
  and a SET on the store's one pipelined connection for Redis (its client's cost per command:
  [redis_clients.md](redis_clients.md)). Instruction counts per request, the same on every run
  of the same code, are in cache.inprocess.json
  (`python -m benchmarks.cache.inprocess`, callgrind).
- **A hit** of a page request costs the gateway the admission parse, the key over the page's
  bytes ("in process" above), reading the body and writing the answer; its p99 on a shared
  machine is the scheduler's as much as the gateway's (load average above).
"""


def markdown(document: dict[str, Any]) -> str:
    r = document["results"]
    machine = document["machine"]
    lines = [
        "# Coalescing and the result cache (`make bench-cache`)",
        "",
        f"Command: `{document['command']}`. Simulated workers (time scale "
        f"{document['settings']['time_scale']}; 1.0 for the worker answers of the hit latency). "
        f"Machine: {machine['cpus']} CPUs shared with other jobs, load average at the end "
        f"{machine['loadavg_end']}; Python {machine['python']}. Raw figures: cache.json.",
        "",
    ]
    lines += _small(r["small_requests"])
    lines += _hits(r["hit_latency"])
    lines += _passes(r["second_pass"])
    lines += _duplicates(r["duplicates"])
    lines += _shared(r["shared_redis"])
    lines += _memory(r["memory_bound"])
    if "mineru_client" in r:
        lines += _mineru(r["mineru_client"])
    lines += ["", NOTES]
    return "\n".join(lines)


def _table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A section: its heading, then a table of `rows` under `columns`."""
    lines = [f"## {title}", "", _row(columns), "|" + "---|" * len(columns)]
    return [*lines, *(_row(row) for row in rows), ""]


def _row(cells: Sequence[object]) -> str:
    return "|" + "|".join(f" {cell} " if cell != "" else " " for cell in cells) + "|"


def _small(small: dict[str, Any]) -> list[str]:
    return _table(
        "Small requests: the cost of coalescing and of a store that misses (same run)",
        ("gateway", "requests", "CPU us per request", "CPU against cache_off", "p50 ms", "p99 ms"),
        (
            (
                name,
                c["requests"],
                c["cpu_us_per_request"],
                c["cpu_ratio_to_off"],
                c["latency"]["p50_ms"],
                c["latency"]["p99_ms"],
            )
            for name, c in small.items()
        ),
    )


def _hits(hits: dict[str, Any]) -> list[str]:
    rows: list[Sequence[object]] = [
        (f"{name} hit", h["samples"], h["p50_ms"], h["p99_ms"], h["gateway_cpu_ms"])
        for name, h in ((name, hits[name]) for name in ("memory", "redis"))
    ]
    w = hits["worker_answer"]
    rows.append(("worker (300 tokens)", w["samples"], w["p50_ms"], w["p99_ms"], ""))
    parts = ", ".join(f"{name} {ms} ms" for name, ms in hits["in_process_ms"].items())
    return [
        *_table(
            f"A hit's latency, {hits['request_bytes']:,}-byte page request",
            ("answered by", "samples", "p50 ms", "p99 ms", "gateway CPU ms per request"),
            rows,
        ),
        f"In process, on the same body (best of 30): {parts}.",
        "",
    ]


def _passes(passes: dict[str, Any]) -> list[str]:
    return _table(
        "A batch of pages sent twice",
        ("store", "pass", "worker requests", "hits", "wall s", "gateway CPU s"),
        (
            (store, name, p["worker_requests"], p["hits"], p["wall_s"], p["gateway_cpu_s"])
            for store, result in passes.items()
            for name, p in ((name, result[name]) for name in ("first", "second"))
        ),
    )


def _duplicates(duplicates: dict[str, Any]) -> list[str]:
    rows = []
    for name, d in duplicates.items():
        mixed, burst = d["twenty_percent_duplicates"], d["hundred_identical"]
        mixed_counts = (mixed["sent"], mixed["distinct"], mixed["worker_requests"])
        burst_counts = (burst["sent"], 1, burst["worker_requests"])
        rows += [
            (name, "20% duplicates", *mixed_counts, mixed["coalesced"]),
            (name, "100 identical at once", *burst_counts, burst["coalesced"]),
        ]
    return _table(
        "Duplicates: coalescing alone (the defaults), and with the memory cache",
        ("gateway", "batch", "requests sent", "distinct", "worker requests", "coalesced"),
        rows,
    )


def _shared(shared: dict[str, Any]) -> list[str]:
    replicas = shared["two_replicas_redis"]
    rows: list[Sequence[object]] = [
        (
            "two replicas, computed through one, asked through the other",
            replicas["pages"],
            replicas["first_through_one"]["worker_requests"],
            replicas["then_through_two"]["worker_requests"],
            replicas["then_through_two"]["hits"],
        )
    ]
    return _table(
        "One Redis behind several gateways",
        ("setup", "pages", "first pass: worker requests", "second pass: worker requests", "hits"),
        rows,
    )


def _memory(memory: dict[str, Any]) -> list[str]:
    columns = {
        "distinct answers": "distinct_answers",
        "stored MiB": "stored_mib",
        "bound MiB": "cache_max_mib",
        "held at end MiB": "held_mib_at_end",
        "evictions": "evictions",
        "RSS before MiB": "rss_mib_before",
        "peak RSS MiB": "rss_mib_peak",
        "overhead MiB": "overhead_mib",
    }
    return [
        *_table(
            "The memory cache stays within its bound",
            tuple(columns),
            [tuple(memory[key] for key in columns.values())],
        ),
        f"RSS every tenth of the way (MiB): {memory['rss_mib_samples']}.",
        "",
    ]


def _mineru(mineru: dict[str, Any]) -> list[str]:
    return _table(
        f"MinerU's own client ({mineru['client']}), the same {mineru['pages']} pages twice,"
        f" memory cache (simulated workers at time scale {mineru['sim_time_scale']})",
        ("pass", "pages completed", "worker requests", "wall s", "client CPU s"),
        (
            (number, p["pages_completed"], p["worker_requests"], p["wall_s"], p["client_cpu_s"])
            for number, p in enumerate(mineru["passes"], 1)
        ),
    )
