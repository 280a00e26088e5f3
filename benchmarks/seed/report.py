"""The seed benchmark's tables: `vllm bench serve` results in, rows, ratios and Markdown out.
Pure: works on the results document alone, so results can be re-rendered:

    python -m benchmarks.seed.report benchmarks/results/seed.json
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.routing.runs import FOREIGN_CPU_LIMIT

METRICS = ("ttft", "tpot", "e2el")  # what the tables show, in `vllm bench serve`'s names
PERCENTILES = ("p50", "p90", "p99")
GATEWAY, VLLM_DP = "gateway", "vllm_dp"
REAL_GATEWAY, REAL_VLLM_DP = "gateway_vllm", "vllm_dp_real"
TITLES = {
    GATEWAY: "gateway over 4 workers",
    VLLM_DP: "vLLM DP balancer (emulated) over 4 workers",
    REAL_GATEWAY: "gateway over 2 vLLM servers",
    REAL_VLLM_DP: "vLLM `--data-parallel-size 2`",
}


@dataclass(frozen=True)
class Row:
    """One `vllm bench serve` run as the tables show it. Latencies in ms."""

    setup: str
    concurrency: int
    prompts: int
    completed: int
    failed: int
    qps: float
    output_tokens_per_s: float
    ttft: dict[str, float]
    tpot: dict[str, float]
    e2el: dict[str, float]
    input_tokens_per_request: float
    output_tokens_per_request: float
    duration_s: float

    @property
    def in_flight(self) -> float:
        """QPS x mean E2E: by Little's law the concurrency actually held (a little under the
        clients' number, for the ramp at the start and the tail at the end of a closed loop)."""
        return self.qps * self.e2el["mean"] / 1000


def row_from_result(setup: str, result: dict[str, Any]) -> Row:
    """A row from the JSON `vllm bench serve --save-result` wrote (its percentiles must include
    50, 90 and 99 of ttft, tpot and e2el: `--percentile-metrics`, `--metric-percentiles`)."""
    completed = int(result["completed"])
    per_request = max(1, completed)
    return Row(
        setup=setup,
        concurrency=int(result["max_concurrency"]),
        prompts=int(result["num_prompts"]),
        completed=completed,
        failed=int(result["failed"]),
        qps=float(result["request_throughput"]),
        output_tokens_per_s=float(result["output_throughput"]),
        ttft=_latencies(result, "ttft"),
        tpot=_latencies(result, "tpot"),
        e2el=_latencies(result, "e2el"),
        input_tokens_per_request=result["total_input_tokens"] / per_request,
        output_tokens_per_request=result["total_output_tokens"] / per_request,
        duration_s=float(result["duration"]),
    )


def _latencies(result: dict[str, Any], metric: str) -> dict[str, float]:
    return {name: float(result[f"{name}_{metric}_ms"]) for name in ("mean", *PERCENTILES)}


def token_problems(row: Row, input_tokens: int | None, output_tokens: int) -> list[str]:
    """What is off in a run: failed requests, answers or prompts of another length than asked
    (vllm bench counts both from the server's usage chunk). `input_tokens` None: not checked."""
    problems = []
    if row.failed or row.completed != row.prompts:
        problems.append(f"{row.completed} of {row.prompts} completed, {row.failed} failed")
    if row.output_tokens_per_request != output_tokens:
        problems.append(f"{row.output_tokens_per_request:g} output tokens a request")
    if input_tokens is not None and row.input_tokens_per_request != input_tokens:
        problems.append(f"{row.input_tokens_per_request:g} prompt tokens a request")
    return problems


def ratios(rows: Sequence[Row], candidate: str, reference: str) -> list[dict[str, Any]]:
    """`candidate`'s figures over `reference`'s, per concurrency both were run at: above 1 is
    more for QPS and tokens/s (better), longer for latencies (worse)."""
    by_key = {(row.setup, row.concurrency): row for row in rows}
    out = []
    for concurrency in sorted({row.concurrency for row in rows}):
        mine, theirs = by_key.get((candidate, concurrency)), by_key.get((reference, concurrency))
        if mine is None or theirs is None:
            continue
        entry: dict[str, Any] = {
            "concurrency": concurrency,
            "qps": _ratio(mine.qps, theirs.qps),
            "output_tokens_per_s": _ratio(mine.output_tokens_per_s, theirs.output_tokens_per_s),
        }
        for metric in METRICS:
            ours, base = getattr(mine, metric), getattr(theirs, metric)
            entry[metric] = {p: _ratio(ours[p], base[p]) for p in PERCENTILES}
        out.append(entry)
    return out


def _ratio(value: float, reference: float) -> float | None:
    return round(value / reference, 4) if reference > 0 else None


def rows_of(runs: Sequence[dict[str, Any]]) -> list[Row]:
    return [row_from_result(run["setup"], run["result"]) for run in runs]


# -- Markdown ---------------------------------------------------------------------------------


def markdown(document: dict[str, Any]) -> str:
    settings = document["settings"]
    lines = [
        "## The seed deployment's benchmark, in shape: the gateway against vLLM's DP balancer",
        "",
        f"- Command: `{document['command']}` (commit {document['git_commit']}, "
        f"{document['when']}, {document['wall_time_s'] / 60:.1f} min on "
        f"{document['machine']['cpus']} CPUs, shared with other work).",
        *_sim_setting_lines(settings["sim"]),
        "",
        "### Measured (simulated 910B workers)",
        "",
        *results_table(rows_of(document["runs"]), document["runs"]),
        "",
        "### The gateway over vLLM's DP balancer, same run (above 1: more QPS, longer latency)",
        "",
        *ratio_table(ratios(rows_of(document["runs"]), GATEWAY, VLLM_DP)),
        "",
        *_check_lines(document["runs"]),
        "",
        *shape_lines(rows_of(document["runs"]), settings["sim"]["output_len"]),
    ]
    real = document.get("real_vllm")
    if real is not None:
        lines += ["", *_real_vllm_lines(real)]
    if notes := document.get("notes"):
        lines += ["", "### Notes (written after the run)", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def _sim_setting_lines(sim: dict[str, Any]) -> list[str]:
    scale = sim["time_scale"]
    pace = (
        "each engine step as long as on a 910B, so figures are 910B-like"
        if scale == 1
        else f"every simulated duration {scale:g}x a 910B's: divide latencies by {scale:g} "
        f"and multiply QPS and tokens/s by {scale:g} for 910B-like figures"
    )
    return [
        f"- Workers: {sim['workers']} simulated vLLM-Ascend 910B workers (`mineru-gateway sim`, "
        f"time scale {scale:g}: {pace}). In front of them, both up for the whole run and "
        "measured in turn (the order alternating from one concurrency to the next): the "
        "gateway (`mineru-gateway serve`, default settings) and vLLM's own data-parallel "
        "balancer, emulated (`benchmarks/routing/dp_balancer.py`), as the seed ran it on 4 NPUs.",
        f"- Load: `vllm bench serve` (vLLM {sim['vllm_version']}, `openai-chat`, streaming), "
        f"closed loop: C clients send max({sim['min_prompts']}, {sim['prompts_per_client']} x C) "
        f"requests; prompts of {sim['input_len']} tokens as the simulator counts them (a "
        f"ShareGPT-shaped file: see `benchmarks/seed/dataset.py`), answers of exactly "
        f"{sim['output_len']} tokens (`--ignore-eos`). Each run's own `vllm bench serve` "
        "command is in the JSON.",
        "- vllm bench's definitions: TTFT to the first streamed token; TPOT = (E2E - TTFT) / "
        "(output tokens - 1); E2E to the last token; QPS = completed requests / run time. "
        "`in flight` = QPS x mean E2E, the concurrency actually held (Little's law). "
        "`others` = cores other processes on the machine took during the run.",
    ]


def results_table(rows: Sequence[Row], runs: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| setup | concurrency | requests | QPS | TTFT p50 / p90 / p99 (ms) "
        "| TPOT p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (s) | output tokens/s | in flight "
        "| others |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    disturbed = False
    for row, run in zip(rows, runs, strict=True):
        e2e_s = {p: row.e2el[p] / 1000 for p in PERCENTILES}
        others = run.get("cpu", {}).get("foreign_cores")
        flag = " (!)" if others is not None and others > FOREIGN_CPU_LIMIT else ""
        disturbed = disturbed or bool(flag)
        lines.append(
            f"| {TITLES.get(row.setup, row.setup)} | {row.concurrency} | {row.completed} "
            f"| {row.qps:.3f} | {_triple(row.ttft, 1)} | {_triple(row.tpot, 2)} "
            f"| {_triple(e2e_s, 2)} | {row.output_tokens_per_s:.0f} | {row.in_flight:.1f} "
            f"| {_cores(others)}{flag} |"
        )
    if disturbed:
        lines += [
            "",
            f"(!) Other processes took more than {FOREIGN_CPU_LIMIT:g} cores during the run so "
            "marked: its latencies are stretched by CPU contention, not by the router.",
        ]
    return lines


def ratio_table(entries: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| concurrency | QPS | TTFT p50 / p90 / p99 | TPOT p50 / p90 / p99 | E2E p50 / p90 / p99 "
        "| output tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for entry in entries:
        cells = [_triple(entry[metric], 3) for metric in METRICS]
        lines.append(
            f"| {entry['concurrency']} | {_number(entry['qps'], 3)} | {' | '.join(cells)} "
            f"| {_number(entry['output_tokens_per_s'], 3)} |"
        )
    return lines


def _check_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    bad = [
        f"- {TITLES.get(run['setup'], run['setup'])} at {run['concurrency']}: "
        + "; ".join(run["problems"])
        for run in runs
        if run["problems"]
    ]
    if not bad:
        return [
            "Every request of every run completed, with exactly the prompt and answer lengths "
            "asked for, as vllm bench counted them from the server's usage chunk."
        ]
    return ["Runs with problems:", "", *bad]


SEED_P50_MS = 98.0  # the published P50 that cannot be an E2E latency (docs/seed-deployment.md)


def shape_lines(rows: Sequence[Row], output_len: int) -> list[str]:
    """What the measured rows say about the published table: the identities that tie its
    columns together, and what they make of a 98 ms P50 for answers of `output_len` tokens."""
    mine = sorted((r for r in rows if r.setup == GATEWAY), key=lambda r: r.concurrency)
    if not mine or output_len < 2:
        return []
    first = mine[0]
    ttft, tpot, e2e = first.ttft["p50"], first.tpot["p50"], first.e2el["p50"]
    needed = SEED_P50_MS / (output_len - 1)
    ttfts = [r.ttft["p50"] for r in mine]
    return [
        "### Beside the seed's published table",
        "",
        "The seed published QPS and P50/P90/P99 latency for this load; only its shape is "
        "known here (docs/seed-deployment.md). Two identities tie such a table's columns "
        "together: a request's E2E = TTFT + (answer tokens - 1) x TPOT (vllm bench's "
        "definition of TPOT), and QPS x mean E2E = the concurrency held (Little's law; column "
        f"`in flight` above). At concurrency {first.concurrency} with {output_len}-token "
        f"answers, E2E p50 here is {e2e / 1000:.2f} s, about {ttft:.0f} ms + "
        f"{output_len - 1} x {tpot:.2f} ms. "
        f"So a P50 of {SEED_P50_MS:.0f} ms for {output_len} output tokens cannot be an E2E "
        f"latency: it takes a TPOT under {needed:.3f} ms ({tpot / needed:.0f}x faster than the "
        "simulated decode step) and, by Little's law, "
        f"{1000 / SEED_P50_MS:.1f} QPS from each client, {output_len * 1000 / SEED_P50_MS:,.0f} "
        "output tokens/s from one sequence. It is the size of a TTFT (here "
        f"{min(ttfts):.0f}-{max(ttfts):.0f} ms at p50), and a table whose QPS and E2E columns "
        "both hold must show QPS close to concurrency / E2E.",
    ]


def _real_vllm_lines(real: dict[str, Any]) -> list[str]:
    if "skipped" in real:
        return ["### Real vLLM on CPU (check)", "", f"Not run: {real['skipped']}."]
    settings = real["settings"]
    rows = rows_of(real["runs"])
    return [
        "### Real vLLM on CPU (check)",
        "",
        f"- vLLM {settings['vllm_version']} CPU build, the tiny local model "
        f"({settings['model_note']}), `--max-num-seqs {settings['max_num_seqs']}`: one server "
        "with `--data-parallel-size 2` (its engines on cores 0 and 1), then two single "
        "servers (one per core) behind the gateway; one after the other, on the same 2 "
        "cores as the load generator and everything else. vllm bench's `random` dataset, "
        f"{settings['input_len']}-token prompts and {settings['output_len']}-token answers "
        "(the tiny model's tokenizer is the server's, so the lengths are exact).",
        "- A check that the same command runs against real vLLM and the gateway, not a "
        "performance figure: on 2 cores the API servers, engines and load generator compete.",
        "",
        *results_table(rows, real["runs"]),
        "",
        "Gateway over vLLM's own DP, same run:",
        "",
        *ratio_table(ratios(rows, REAL_GATEWAY, REAL_VLLM_DP)),
        "",
        *_check_lines(real["runs"]),
    ]


def _triple(values: dict[str, float | None], digits: int) -> str:
    return " / ".join(_number(values[p], digits) for p in PERCENTILES)


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _cores(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# -- plot -------------------------------------------------------------------------------------


def plot(document: dict[str, Any], path: Path) -> Path:
    """QPS and TTFT, TPOT and E2E (p50 solid, p99 dashed) against concurrency, per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(document["runs"])
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (("qps", "QPS (requests/s)"), *((m, f"{m.upper()} (ms)") for m in METRICS))
    for axis, (name, label) in zip(axes.flat, panels, strict=True):
        for setup, short in ((GATEWAY, "gateway"), (VLLM_DP, "vLLM DP")):
            mine = sorted((r for r in rows if r.setup == setup), key=lambda r: r.concurrency)
            xs = [r.concurrency for r in mine]
            if name == "qps":
                axis.plot(xs, [r.qps for r in mine], marker="o", label=short)
                continue
            values = [getattr(r, name) for r in mine]
            p50 = axis.plot(xs, [v["p50"] for v in values], marker="o", label=f"{short} p50")[0]
            p99 = [v["p99"] for v in values]
            axis.plot(xs, p99, "--", marker="x", color=p50.get_color(), label=f"{short} p99")
        axis.set_xlabel("concurrency (clients)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    sim = document["settings"]["sim"]
    figure.suptitle(
        f"{sim['input_len']}-token prompts, {sim['output_len']}-token answers, "
        f"{sim['workers']} simulated 910B workers (time scale {sim['time_scale']:g})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write(document: dict[str, Any], path: Path, *, plots: bool = True) -> None:
    """The document as JSON at `path`, its Markdown and plot beside it (no plot without
    matplotlib)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    text = markdown(document)
    path.with_suffix(".md").write_text(text)
    if plots and document["runs"]:
        try:
            plot(document, path.with_suffix(".png"))
        except ImportError:
            print("matplotlib is not installed: no plot")
    print(text)


def main(argv: Sequence[str] | None = None) -> None:
    path = Path((sys.argv[1:] if argv is None else argv)[0])
    write(json.loads(path.read_text()), path)


if __name__ == "__main__":
    main()
