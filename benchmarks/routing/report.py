"""Summaries of a results document: goodput, fixed-rate tables, issue 3's targets, plots.

Works on the JSON alone, so results can be re-rendered:

    python -m benchmarks.routing.report benchmarks/results/routing.json
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .stats import Goodput, RunResult, goodput, passes

CANDIDATE = "queue"
ROUND_ROBIN = "round_robin"
ORDER = (
    "queue",
    "p2c",
    "least_inflight",
    "round_robin",
    "vllm_dp",
    "vllm_router_p2",
    "vllm_router_rr",
)


def _runs(document: dict[str, Any]) -> list[RunResult]:
    return [RunResult(**run) for run in document["runs"]]


def _ms(value: float | None) -> str:
    return "censored" if value is None else f"{value:.0f}"


def _e2e(r: RunResult) -> str:
    if r.wait_for != "done":
        return "-"
    return f"{_ms(r.e2e_ms['p50'])} / {_ms(r.e2e_ms['p99'])}"


def format_run(r: RunResult, slo_ms: float) -> str:
    verdict = "ok  " if passes(r, slo_ms) else "MISS"
    e2e = f" E2E p50/p99 {_e2e(r)} ms" if r.wait_for == "done" else ""
    return (
        f"{r.scenario:16s} {r.router:15s} {r.fraction:4.2f}K {r.rate:6.1f} req/s  "
        f"TTFT p50/p99 {_ms(r.ttft_ms['p50'])}/{_ms(r.ttft_ms['p99'])} ms {verdict}{e2e}  "
        f"done {r.requests_per_s:5.1f}/s  workers {r.worker_requests}  "
        f"lag p99 {r.lag_ms['p99']:.1f} ms  cpu {r.cpu.get('machine_util', 0):.0%} "
        f"(others {r.cpu.get('foreign_cores', 0):.2f} cores)  "
        f"err {r.errors} cens {r.no_first_token}"
    )


def _ordered(names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def summarise_document(document: dict[str, Any]) -> dict[str, Any]:
    plan = document["settings"]["plan"]
    slo = plan["slo_ms"]
    runs = _runs(document)
    out: dict[str, Any] = {"slo_ms": slo, "goodput": {}, "targets": []}
    for scenario in _ordered_scenarios(runs):
        mine = [r for r in runs if r.scenario == scenario]
        table: dict[str, dict[str, Any]] = {}
        for router in _ordered({r.router for r in mine}):
            g = goodput([r for r in mine if r.router == router], slo)
            table[router] = {
                "grid_rps": round(g.grid, 3),
                "rps": round(g.interpolated, 3),
                "bounded": g.bounded,
            }
        out["goodput"][scenario] = table
    out["targets"] = targets(runs, out["goodput"], plan)
    lags = [r.lag_ms["p99"] for r in runs]
    out["loadgen_lag_ms"] = {
        "worst_run_p99": max(lags, default=0.0),
        "median_run_p99": sorted(lags)[len(lags) // 2] if lags else 0.0,
        "worst_max": max((r.lag_ms["max"] for r in runs), default=0.0),
    }
    out["machine_cpu_max"] = max((r.cpu.get("machine_util", 0.0) for r in runs), default=0.0)
    return out


def _ordered_scenarios(runs: Sequence[RunResult]) -> list[str]:
    return sorted({r.scenario for r in runs})


def _gp(table: dict[str, dict[str, Any]], router: str) -> Goodput | None:
    row = table.get(router)
    return None if row is None else Goodput(row["grid_rps"], row["rps"], row["bounded"])


def _p99_at(runs: Sequence[RunResult], scenario: str, router: str, fraction: float) -> float | None:
    for r in runs:
        if r.scenario == scenario and r.router == router and abs(r.fraction - fraction) < 1e-9:
            value = r.ttft_ms["p99"]
            return math.inf if value is None else value
    return None


def targets(
    runs: Sequence[RunResult], goodputs: dict[str, dict[str, Any]], plan: dict[str, Any]
) -> list[dict[str, Any]]:
    """Issue 3's targets for `queue`, each PASS, FAIL or n/a (something needed was not run)."""
    found: list[dict[str, Any]] = []
    for scenario, table in goodputs.items():
        case = Case(runs, scenario, table)
        checks = IDENTICAL_WORKER_CHECKS if scenario.startswith("a") else UNEVEN_WORKER_CHECKS
        found += [check(case) for check in checks]
        found += [_p99_within_best(case, fraction) for fraction in plan["fixed"]]
    return found


@dataclass(frozen=True)
class Case:
    """One scenario's runs and goodput table, as the target checks read them."""

    runs: Sequence[RunResult]
    scenario: str
    table: dict[str, dict[str, Any]]

    @property
    def key(self) -> str:
        return self.scenario.split("_", 1)[0]

    def goodput(self, router: str) -> Goodput | None:
        return _gp(self.table, router)

    def p99_at(self, router: str, fraction: float) -> float | None:
        return _p99_at(self.runs, self.scenario, router, fraction)


def _target(name: str, ok: bool | None, detail: str) -> dict[str, Any]:
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    return {"target": name, "result": verdict, "detail": detail}


def _goodput_at_least_best_baseline(case: Case) -> dict[str, Any]:
    name = "(a) goodput >= best baseline"
    mine = case.goodput(CANDIDATE)
    others = {k: g for k in case.table if k != CANDIDATE and (g := case.goodput(k)) is not None}
    best_name = max(others, key=lambda k: others[k].interpolated, default=None)
    if mine is None or best_name is None:
        return _target(name, None, "queue or baselines not run")
    best = others[best_name].interpolated
    detail = f"queue {mine.interpolated:.1f} req/s vs {best_name} {best:.1f}"
    return _target(name, mine.interpolated >= best, detail)


def _p99_near_round_robin(case: Case) -> dict[str, Any]:
    name = "(a) TTFT p99 at 0.85K <= 1.1x round_robin"
    q85, r85 = case.p99_at(CANDIDATE, 0.85), case.p99_at(ROUND_ROBIN, 0.85)
    if q85 is None or r85 is None:
        return _target(name, None, "not run at 0.85K")
    detail = f"queue {q85:.0f} ms vs round_robin {r85:.0f} ms ({q85 / r85:.2f}x)"
    return _target(name, q85 <= 1.1 * r85, detail)


def _goodput_over(router: str, factor: float, unit: str = "") -> Callable[[Case], dict[str, Any]]:
    """A check: `queue`'s goodput is at least `factor` times `router`'s."""

    def check(case: Case) -> dict[str, Any]:
        name = f"({case.key}) goodput >= {factor:g}x {router}"
        mine, theirs = case.goodput(CANDIDATE), case.goodput(router)
        if mine is None or theirs is None or theirs.interpolated <= 0:
            return _target(name, None, f"queue or {router} not run")
        ratio = mine.interpolated / theirs.interpolated
        detail = f"queue {mine.interpolated:.1f} vs {theirs.interpolated:.1f}{unit} ({ratio:.2f}x)"
        return _target(name, ratio >= factor, detail)

    return check


# Identical workers: `queue` must match the best baseline. A slow worker or direct traffic: it
# must clearly beat round-robin and the routers that see only their own requests.
IDENTICAL_WORKER_CHECKS = (_goodput_at_least_best_baseline, _p99_near_round_robin)
UNEVEN_WORKER_CHECKS = (
    _goodput_over(ROUND_ROBIN, 1.4, " req/s"),
    _goodput_over("least_inflight", 1.2),
    _goodput_over("vllm_router_p2", 1.2),
)


def _p99_within_best(case: Case, fraction: float) -> dict[str, Any]:
    name = f"({case.key}) TTFT p99 at {fraction:g}K <= 1.2x best"
    ours = case.p99_at(CANDIDATE, fraction)
    values = {
        r.router: (math.inf if r.ttft_ms["p99"] is None else r.ttft_ms["p99"])
        for r in case.runs
        if r.scenario == case.scenario and abs(r.fraction - fraction) < 1e-9
    }
    if ours is None or not values:
        return _target(name, None, "queue not run")
    best_router = min(values, key=lambda k: values[k])
    best = values[best_router]
    ok = ours <= 1.2 * best if math.isfinite(best) else True
    return _target(name, ok, f"queue {ours:.0f} ms, best {best_router} {best:.0f} ms")


def markdown(document: dict[str, Any]) -> str:
    summary = document["summary"]
    settings = document["settings"]
    plan = settings["plan"]
    runs = _runs(document)
    scale = plan["time_scale"]
    lines = [
        "## Routing benchmark: simulated workers",
        "",
        f"- Command: `{document['command']}` (commit {document['git_commit']}, "
        f"{document['when']}, {document['wall_time_s'] / 60:.0f} min on "
        f"{document['machine']['cpus']} CPUs)",
        f"- One worker's capacity on the mix: {settings['worker_capacity_rps']:.1f} requests/s; "
        f"SLO: TTFT p99 <= {plan['slo_ms']:.0f} ms. Simulator time scale {scale:g}: every "
        "time and rate here is in engine time (what the 910B it stands for would see)",
        f"- Mix per page: {settings['mix_per_page']['requests_per_page']:.1f} requests, "
        f"{settings['mix_per_page']['output_tokens_per_page']:.0f} output tokens, "
        f"{settings['mix_per_page']['visual_tokens_per_page']:.0f} visual tokens",
        f"- Per run: {plan['warmup_s']:g} s warm-up, {plan['window_s']:g} s measured, "
        f"then a tail at the same rate until the measured p99 is settled (engine seconds)",
        "",
        "### Goodput: requests/s with TTFT p99 within the SLO (x round_robin)",
        "",
    ]
    scenarios = list(summary["goodput"])
    lines.append("| router | " + " | ".join(scenarios) + " |")
    lines.append("|---|" + "---|" * len(scenarios))
    routers = _ordered({r for table in summary["goodput"].values() for r in table})
    for router in routers:
        cells = []
        for scenario in scenarios:
            table = summary["goodput"][scenario]
            row = table.get(router)
            if row is None:
                cells.append("-")
                continue
            rr = table.get(ROUND_ROBIN)
            ratio = f" ({row['rps'] / rr['rps']:.2f}x)" if rr and rr["rps"] > 0 else ""
            bound = "" if row["bounded"] else ">= "
            cells.append(f"{bound}{row['rps']:.1f}{ratio}")
        lines.append(f"| {router} | " + " | ".join(cells) + " |")
    lines += ["", "### At fixed rates (K = the scenario's capacity)", ""]
    for scenario in scenarios:
        lines += [
            f"**{scenario}**",
            "",
            "| router | rate | TTFT p50 / p99 ms | E2E p50 / p99 ms | done req/s | tokens/s "
            "| requests per worker |",
            "|---|---|---|---|---|---|---|",
        ]
        for fraction in plan["fixed"]:
            for router in routers:
                for r in runs:
                    if (
                        r.scenario == scenario
                        and r.router == router
                        and abs(r.fraction - fraction) < 1e-9
                    ):
                        lines.append(
                            f"| {router} | {fraction:g}K = {r.rate:.1f}/s "
                            f"| {_ms(r.ttft_ms['p50'])} / {_ms(r.ttft_ms['p99'])} "
                            f"| {_e2e(r)} "
                            f"| {r.requests_per_s:.1f} | {r.tokens_per_s:.0f} "
                            f"| {r.worker_requests} |"
                        )
        lines.append("")
    lines += ["### Targets (issue 3)", ""]
    for target in summary["targets"]:
        lines.append(f"- {target['result']}: {target['target']} ({target['detail']})")
    lag = summary["loadgen_lag_ms"]
    lines += [
        "",
        f"Load generator lag (actual minus scheduled send): p99 per run {lag['median_run_p99']:.1f}"
        f" ms median, {lag['worst_run_p99']:.1f} ms worst; worst single send "
        f"{lag['worst_max']:.1f} ms. Busiest run used {summary['machine_cpu_max']:.0%} of the "
        "machine's CPU.",
        "",
    ]
    return "\n".join(lines)


def plots(document: dict[str, Any], out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = document["summary"]
    slo = summary["slo_ms"]
    runs = _runs(document)
    written = []
    titles = {s["name"]: s["title"] for s in document["settings"]["scenarios"].values()}
    capacity = document["settings"]["worker_capacity_rps"]
    for scenario in _ordered_scenarios(runs):
        mine = [r for r in runs if r.scenario == scenario]
        figure, axis = plt.subplots(figsize=(7.5, 4.8))
        ceiling = 30 * slo
        for router in _ordered({r.router for r in mine}):
            points = sorted((r for r in mine if r.router == router), key=lambda r: r.rate)
            xs = [r.rate for r in points]
            ys = [min(ceiling, r.ttft_ms["p99"] or ceiling) for r in points]
            style = "-" if router == CANDIDATE else "--"
            line = axis.plot(xs, ys, style, marker="o", label=router, linewidth=1.6)[0]
            censored = [(x, y) for x, y, r in zip(xs, ys, points, strict=True) if y >= ceiling]
            if censored:
                axis.plot(*zip(*censored, strict=True), "x", color=line.get_color(), ms=9)
        axis.axhline(slo, color="black", linewidth=1, linestyle=":", label=f"SLO {slo:.0f} ms")
        axis.set_yscale("log")
        axis.set_xlabel("offered rate through the router (requests/s)")
        axis.set_ylabel("TTFT p99 (ms)")
        scenario_capacity = mine[0].rate / mine[0].fraction if mine[0].fraction else 0
        axis.set_title(
            f"{titles.get(scenario, scenario)}\nK = {scenario_capacity:.1f} req/s, "
            f"one worker {capacity:.1f} req/s; x = no first token before the run ended"
        )
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        path = out_dir / f"{stem}_{scenario.split('_', 1)[0]}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    path = Path(args[0])
    document = json.loads(path.read_text())
    document["summary"] = summarise_document(document)
    path.write_text(json.dumps(document, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(document))
    plots(document, path.parent, path.stem)
    print(markdown(document))


if __name__ == "__main__":
    main()
