"""benchmarks/results/fleet.md from fleet.json (bench.py writes both)."""

from __future__ import annotations

from typing import Any

TARGETS = (
    ("CPU per request at the largest fleet, vs W=8", "cpu_per_request_vs_w8_at_largest", 1.3, "x"),
    ("Idle CPU at the largest fleet (cores, one replica)", "idle_cores_at_largest", 0.1, ""),
    (
        "GETs/s each worker answers replicas sharing fleet state (the smallest fleet)",
        "gets_per_worker_per_s_replicas_sharing",
        6.0,
        "",
    ),
    ("/metrics at the largest fleet (bytes)", "metrics_bytes_at_largest", 1_000_000, ""),
)

WHY = """\
## Reading the results

- **A decision** draws a few workers with room (docs/operate/fleet-scale.md), so its time does
  not follow W; at W=8 the index costs a few microseconds more than a walk of eight workers.
- **CPU per request** does not grow with W. The gateway keeps a connection to a worker alive
  for 4 s after its last request there; among equally loaded
  drawn workers it takes one it holds a connection to (docs/operate/fleet-scale.md), so a
  request rarely opens a connection first, however large the fleet (the connections the fleet
  accepted during the requests, less those the reads and probes open at rest, per request).
  On this 2-core machine, shared with other jobs, the gateway, the fleet and the client
  contend for the cores: the rounds of one run differ by up to a third.
- **Idle CPU** is mostly the reads and probes: `MAX_FLEET_GETS_PER_S` GETs per second at most,
  a worker's probe and read on one connection (usually made afresh: a worker's turn comes
  after its keep-alive lapsed), whatever W.
- **GETs per worker**: one replica reads and probes each worker. Replicas sharing fleet state
  split each worker's budget (`MAX_WORKER_GETS_PER_S`), measured with the replicas running;
  without fleet state each replica takes the whole budget (the runs above, one replica). The
  model listing (every 30 s, maybe outside the measured window) is counted in.
- **/metrics** past 64 workers holds per worker only the gauges operators watch per worker
  (health, in flight, queue, KV cache, figures' age) and the ejections. A scrape's CPU grows
  with those gauges; a render that costs
  10 ms or more is served again for up to 1 s.
"""


def _value(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}x"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def _connections(run: dict[str, Any]) -> str:
    opened = run.get("connections_per_request")
    return "-" if opened is None else f"{opened:.3f}"


def render(result: dict[str, Any]) -> str:
    summary, runs = result["summary"], result["runs"]
    lines = [
        "# A fleet of W workers: what one gateway replica costs at rest and per request",
        "",
        "`" + result["command"] + "` (`make bench-fleet`): a fake fleet of W real listening "
        "ports in one process, `mineru-gateway serve` with its default settings, CPU from /proc "
        f"({result['machine']['cpus']} CPUs shared with other jobs, Python "
        f"{result['machine']['python']}). Method: benchmarks/fleet/bench.py.",
        "",
        "## Targets",
        "",
        "| Target | Measured | Limit | |",
        "| --- | ---: | ---: | --- |",
    ]
    for label, key, limit, unit in TARGETS:
        value = summary[key]
        verdict = "met" if value < limit else f"missed by {(value / limit - 1) * 100:.0f}%"
        lines.append(f"| {label} | {_value(value, unit)} | {_value(limit, unit)} | {verdict} |")
    lines += [
        "",
        "## Runs",
        "",
        "| W | idle cores | GETs/s per worker (mean / max) | RSS MiB | /metrics "
        "bytes | scrape CPU ms | CPU us per request | vs W=8 | connections per request "
        "| p50 ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        gets = run["gets_per_worker_per_s"]
        lines.append(
            f"| {run['workers']} | {run['idle_cores']:.3f} "
            f"| {gets['mean']:.2f} / {gets['max']:.2f} | {run['rss_mib']:.0f} "
            f"| {run['metrics_bytes']:,} | {run['scrape_cpu_ms']:.1f} "
            f"| {run['cpu_us_per_request']:.0f} | {run['cpu_per_request_vs_w8']:.2f}x "
            f"| {_connections(run)} | {run['latency_ms_p50']:.1f} |"
        )
    lines += [
        "",
        "## Replicas: the GETs each worker answers them all",
        "",
        "| W | replicas | fleet state | GETs/s per worker (mean / max) |",
        "| ---: | ---: | --- | ---: |",
    ]
    for run in result.get("replica_runs", []):
        gets = run["gets_per_worker_per_s"]
        lines.append(
            f"| {run['workers']} | {run['replicas']} | Redis, shared "
            f"| {gets['mean']:.2f} / {gets['max']:.2f} |"
        )
    alone = summary["gets_per_worker_per_s_4_replicas_alone"]
    lines.append(f"| any | 4 | off (one replica's worst, x 4) | - / {alone:.2f} |")
    lines += [
        "",
        "## One routing decision and lease (a quarter of the workers full)",
        "",
        "| W | p50 us | p99 us | walking the fleet: p50 us | p99 us |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, times in summary["decisions"].items():
        this, base = times["this"], times.get("baseline")
        walk = f"{base['p50_us']:.0f} | {base['p99_us']:.0f}" if base else "- | -"
        lines.append(f"| {size} | {this['p50_us']:.0f} | {this['p99_us']:.0f} | {walk} |")
    lines += [
        "",
        "The last two columns are the same decisions by a checkout whose routing walks every "
        "worker (`--baseline-src`), when given.",
        "",
        WHY,
    ]
    return "\n".join(lines)
