"""Repeated runs near the knee: TTFT p99 per router over several seeds, with their spread.

    python -m benchmarks.routing.knee RESULT.json ... [--out FILE.md]

Each RESULT is a suite result made with `--fractions F --extra 0 --seed N` (any scenarios, routers
and fractions of capacity). Runs are grouped by scenario, fraction and router across seeds. Single
runs at the knee vary by about 25%, so one run cannot tell two load-aware routers apart: this gives
each router's mean p99 with a 95% confidence interval (Student's t over seeds) and, per seed, its
p99 over the best router's in the same run (the same arrivals), which cancels much of the
seed-to-seed variation.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Two-sided 95% quantiles of Student's t, by degrees of freedom.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    t = T95.get(len(values) - 1, 1.96)
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


def seed_of(document: dict[str, Any]) -> int:
    """The run's seed: in its settings, or (results made before it was recorded there) in its
    command; 1, the suite's default, when neither names it."""
    if "seed" in document["settings"]:
        return int(document["settings"]["seed"])
    found = re.search(r"--seed[= ](\d+)", document["command"])
    return int(found.group(1)) if found else 1


Case = tuple[str, float]  # scenario, fraction of capacity


def p99_by_seed(documents: Sequence[dict[str, Any]]) -> dict[Case, dict[str, dict[int, float]]]:
    """(scenario, fraction) -> router -> seed -> TTFT p99 (ms); unsettled runs are left out."""
    table: dict[Case, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for document in documents:
        seed = seed_of(document)
        for run in document["runs"]:
            p99 = run["ttft_ms"]["p99"]
            if p99 is not None:
                by_seed = table[run["scenario"], run["fraction"]][run["router"]]
                if seed in by_seed:
                    raise SystemExit(
                        f"{run['scenario']} at {run['fraction']} K / {run['router']} / seed {seed}"
                        " is in two results"
                    )
                by_seed[seed] = float(p99)
    return table


def summarise(documents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (scenario, fraction), routers in sorted(p99_by_seed(documents).items()):
        seeds = sorted(set.intersection(*(set(by_seed) for by_seed in routers.values())))
        best = {seed: min(by_seed[seed] for by_seed in routers.values()) for seed in seeds}
        for router, by_seed in sorted(routers.items()):
            values = [by_seed[seed] for seed in seeds]
            ratios = [by_seed[seed] / best[seed] for seed in seeds]
            mean, half = mean_interval(values)
            ratio_mean, ratio_half = mean_interval(ratios)
            rows.append(
                {
                    "scenario": scenario,
                    "fraction": fraction,
                    "router": router,
                    "seeds": seeds,
                    "p99_ms": values,
                    "p99_mean_ms": round(mean, 1),
                    "p99_ci95_ms": round(half, 1),
                    "over_best": [round(r, 2) for r in ratios],
                    "over_best_mean": round(ratio_mean, 2),
                    "over_best_ci95": round(ratio_half, 2),
                    "best_in": sum(r == 1.0 for r in ratios),
                }
            )
    return rows


def plan_text(documents: Sequence[dict[str, Any]]) -> str:
    """The runs' time scale, warm-up and window, e.g. '0.8, 40 s warm-up, 8 s measured'."""

    def values(key: str) -> str:
        found = sorted({float(d["settings"]["plan"][key]) for d in documents})
        return " or ".join(f"{v:g}" for v in found)

    return (
        f"simulator time scale {values('time_scale')}, {values('warmup_s')} s warm-up, "
        f"{values('window_s')} s measured"
    )


def commits_text(documents: Sequence[dict[str, Any]]) -> str:
    """Which commit made which loads, e.g. 'commit cbfcfc0 (1 K), commit c5c2849 (0.95 K)'."""
    loads: dict[str, set[float]] = defaultdict(set)
    for document in documents:
        commit = str(document.get("git_commit") or "unknown")[:7]
        loads[commit].update(run["fraction"] for run in document["runs"])
    return ", ".join(
        f"commit {commit} ({', '.join(f'{f:g} K' for f in sorted(fractions))})"
        for commit, fractions in loads.items()
    )


def markdown(
    rows: Sequence[dict[str, Any]],
    commands: Sequence[str],
    summary: str,
    plan: str,
    commits: str = "",
) -> str:
    lines = [
        "## TTFT p99 near the knee, repeated over seeds",
        "",
        f"Engine milliseconds ({plan}). K is the fleet's capacity. 'Over the best router' divides "
        "a router's p99 by the lowest p99 of the same seed's run (the same arrivals). Confidence "
        "intervals are Student's t over the seeds." + (f" Made at {commits}." if commits else ""),
        "",
        "| scenario | load | router | TTFT p99 per seed (ms) | mean +/- 95% CI (ms) "
        "| over the best router, per seed | mean +/- 95% CI | best in |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['scenario']} | {row['fraction']:g} K | {row['router']} "
            f"| {', '.join(f'{v:.0f}' for v in row['p99_ms'])} "
            f"| {row['p99_mean_ms']:.0f} +/- {row['p99_ci95_ms']:.0f} "
            f"| {', '.join(f'{r:.2f}' for r in row['over_best'])} "
            f"| {row['over_best_mean']:.2f} +/- {row['over_best_ci95']:.2f} "
            f"| {row['best_in']} of {len(row['seeds'])} |"
        )
    lines += ["", "Commands (from the repository root), then this table:", ""]
    lines += [f"    {command}" for command in commands]
    lines += [f"    {summary}"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routing.knee")
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="markdown table (default: print it)")
    args = parser.parse_args(argv)
    documents = [json.loads(path.read_text()) for path in args.results]
    commands = [document["command"] for document in documents]
    rows = summarise(documents)
    summary = "python -m benchmarks.routing.knee " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = markdown(rows, commands, summary, plan_text(documents), commits_text(documents))
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
