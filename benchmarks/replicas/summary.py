"""The replicas benchmark's summary and Markdown: each configuration against one gateway, per
scenario. Pure:
works on the results document alone, so results can be re-rendered:

    python -m benchmarks.replicas.summary benchmarks/results/replicas.json
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.routing import report
from benchmarks.routing.stats import RunResult, goodput

ONE, TWO = "one_gateway", "two_gateways"
LABELS = {ONE: "one gateway", TWO: "two gateways"}
GOODPUT_RATIO = 0.95  # a configuration keeps at least this share of one gateway's goodput
P99_RATIO = 1.2  # and its TTFT p99 within this factor of one gateway's, where both met the SLO


def _runs(document: dict[str, Any]) -> list[RunResult]:
    return [RunResult(**run) for run in document["runs"]]


def _run_at(runs: Sequence[RunResult], scenario: str, router: str, fraction: float) -> RunResult:
    for run in runs:
        if (
            run.scenario == scenario
            and run.router == router
            and abs(run.fraction - fraction) < 1e-9
        ):
            return run
    raise LookupError(f"{scenario} / {router} not run at {fraction:g} K")


def candidates(document: dict[str, Any]) -> list[str]:
    """The configurations compared with one gateway, in the order they were run."""
    return [name for name in document["settings"]["configurations"] if name != ONE]


def summarise(document: dict[str, Any]) -> dict[str, Any]:
    """Goodput per scenario and configuration, the fixed rates side by side, and the checks of
    each configuration against one gateway."""
    plan = document["settings"]["plan"]
    slo = plan["slo_ms"]
    runs = _runs(document)
    compared = candidates(document)
    out: dict[str, Any] = {
        "slo_ms": slo,
        "candidates": compared,
        "goodput": {},
        "fixed": [],
        "checks": [],
    }
    for scenario in sorted({run.scenario for run in runs}):
        table = {}
        for router in (ONE, *compared):
            found = goodput([r for r in runs if r.scenario == scenario and r.router == router], slo)
            table[router] = {"rps": round(found.interpolated, 2), "bounded": found.bounded}
        out["goodput"][scenario] = table
        out["checks"] += [_goodput_check(scenario, table, name) for name in compared]
        for fraction in plan["fixed"]:
            row = _fixed_row(runs, scenario, fraction, compared)
            out["fixed"].append(row)
            out["checks"] += [_p99_check(row, slo, name) for name in compared]
    return out


def _fixed_row(
    runs: Sequence[RunResult], scenario: str, fraction: float, compared: Sequence[str]
) -> dict[str, Any]:
    one = _run_at(runs, scenario, ONE, fraction)
    row: dict[str, Any] = {"scenario": scenario, "fraction": fraction, "rate": round(one.rate, 2)}
    for name in (ONE, *compared):
        run = one if name == ONE else _run_at(runs, scenario, name, fraction)
        row[name] = {
            "ttft_ms": run.ttft_ms,
            "workers": run.worker_requests,
            "gateways": run.extra.get("requests_per_gateway", []),
            "others": _others(run),
        }
    return row


def _others(run: RunResult) -> float | None:
    """Cores other processes on the machine took during the run (`runs.cpu_share`)."""
    return run.cpu.get("foreign_cores")


def _check(name: str, ok: bool | None, detail: str) -> dict[str, Any]:
    """PASS, FAIL, or n/a where the reference itself measured nothing to compare with."""
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    return {"check": name, "result": verdict, "detail": detail}


def _label(name: str) -> str:
    return LABELS.get(name, name)


def _goodput_check(scenario: str, table: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    one, other = table[ONE]["rps"], table[name]["rps"]
    check = f"{scenario}: {_label(name)}: goodput >= {GOODPUT_RATIO:g}x one gateway's"
    if one <= 0:  # one gateway met the SLO at no rate swept
        detail = f"one gateway met the SLO at no rate; {_label(name)} {other:.1f}"
        return _check(check, None, detail)
    ratio = other / one
    detail = f"{other:.1f} vs one gateway's {one:.1f} requests/s ({ratio:.3f}x)"
    return _check(check, ratio >= GOODPUT_RATIO, detail)


def _p99_check(row: dict[str, Any], slo: float, name: str) -> dict[str, Any]:
    one, other = _p99(row[ONE]["ttft_ms"]), _p99(row[name]["ttft_ms"])
    check = (
        f"{row['scenario']} at {row['fraction']:g} K: {_label(name)}: "
        f"TTFT p99 <= {P99_RATIO:g}x one gateway's"
    )
    detail = f"{_ms(other)} vs one gateway's {_ms(one)} ms (SLO {slo:.0f})"
    if math.isinf(one) and math.isinf(other):  # neither answered in time: nothing to compare
        return _check(check, None, detail)
    return _check(check, other <= P99_RATIO * one, detail)


def _p99(ttft: dict[str, float | None]) -> float:
    value = ttft["p99"]
    return math.inf if value is None else value


def _ms(value: float | None) -> str:
    return "censored" if value is None or math.isinf(value) else f"{value:.0f}"


def _describe(name: str) -> str:
    if name == TWO:
        return (
            "two gateways: two `mineru-gateway serve` processes with the default settings "
            "(`queue` routing, flow control), each sent every other request"
        )
    return name


def markdown(document: dict[str, Any]) -> str:
    summary = document["summary"]
    settings = document["settings"]
    plan = settings["plan"]
    compared = summary.get("candidates", [TWO])
    title = ", ".join(_label(name) for name in compared)
    lines = [
        f"## Gateway configurations against one gateway ({title}): 4 simulated workers",
        "",
        f"- Command: `{document['command']}` (commit {document['git_commit']}, "
        f"{document['when']}, {document['wall_time_s'] / 60:.0f} min on "
        f"{document['machine']['cpus']} CPUs)",
        "- One gateway: one `mineru-gateway serve` process with the default settings (`queue` "
        "routing, flow control), sent all the requests. Against it: "
        + "; ".join(_describe(name) for name in compared)
        + ". The same seeded MinerU mix and the same workers (`benchmarks/routing/` protocol).",
        f"- One worker's capacity on the mix: {settings['worker_capacity_rps']:.1f} requests/s; "
        f"SLO: TTFT p99 <= {plan['slo_ms']:.0f} ms; {plan['warmup_s']:g} s warm-up, "
        f"{plan['window_s']:g} s measured, simulator time scale {plan['time_scale']:g} (engine "
        "time throughout).",
        "- The machine is shared: a run during which other processes took more than 0.5 cores "
        "is made again (3 times at most) and the least disturbed one kept; the last column of "
        "the second table says how much they took all the same. Compare the configurations "
        "within a row; the rows' absolute p99s are higher than on a quiet machine.",
        "",
        "### Goodput: requests/s with TTFT p99 within the SLO",
        "",
        "| scenario | one gateway | "
        + " | ".join(f"{_label(name)} | against one" for name in compared)
        + " |",
        "|---|---|" + "---|---|" * len(compared),
    ]
    for scenario, table in summary["goodput"].items():
        one = table[ONE]
        cells = [f"{_bound(one)}{one['rps']:.1f}"]
        for name in compared:
            other = table[name]
            cells += [
                f"{_bound(other)}{other['rps']:.1f}",
                _ratio(other["rps"], one["rps"], digits=3),
            ]
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    for name in compared:
        label = _label(name)
        lines += [
            "",
            f"### TTFT at fixed rates, {label} against one (K = the scenario's capacity)",
            "",
            f"| scenario | rate | one: p50 / p99 ms | {label}: p50 / p99 ms | p99 against one "
            f"| requests per gateway ({label}) | requests per worker: one / {label} "
            f"| other processes' cores: one / {label} |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in summary["fixed"]:
            one, other = row[ONE], row[name]
            ratio = _ratio(_p99(other["ttft_ms"]), _p99(one["ttft_ms"]))
            lines.append(
                f"| {row['scenario']} | {row['fraction']:g} K = {row['rate']:.1f}/s "
                f"| {_ms(one['ttft_ms']['p50'])} / {_ms(one['ttft_ms']['p99'])} "
                f"| {_ms(other['ttft_ms']['p50'])} / {_ms(other['ttft_ms']['p99'])} | {ratio} "
                f"| {other['gateways'] or '-'} | {one['workers']} / {other['workers']} "
                f"| {_cores(one['others'])} / {_cores(other['others'])} |"
            )
    lines += ["", "### Checks", ""]
    lines += [f"- {c['result']}: {c['check']} ({c['detail']})" for c in summary["checks"]]
    return "\n".join(lines) + "\n"


def _ratio(value: float, reference: float, digits: int = 2) -> str:
    """`value / reference`, or `-` where the reference is zero or censored."""
    if reference <= 0 or math.isinf(reference):
        return "-"
    return f"{value / reference:.{digits}f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _bound(row: dict[str, Any]) -> str:
    return "" if row["bounded"] else ">= "


def write(document: dict[str, Any], path: Path, *, plots: bool = True) -> None:
    """The document as JSON at `path`, its Markdown beside it, and the routing suite's TTFT
    against offered rate plots (`report.plots`, one per scenario; skipped without matplotlib)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    text = markdown(document)
    path.with_suffix(".md").write_text(text)
    if plots:
        with contextlib.suppress(ImportError):
            report.plots(document, path.parent, path.stem)
    print(text)


def main(argv: Sequence[str] | None = None) -> None:
    path = Path((sys.argv[1:] if argv is None else argv)[0])
    document = json.loads(path.read_text())
    document["summary"] = summarise(document)
    write(document, path)


if __name__ == "__main__":
    main()
