"""Plots of one scenario's results, and `flow.md`: the summary of every `flow_*.json` there is."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import fmt

ISSUE = (
    "The issue's original numbers (pass-through, real fleet): B's TTFT p99 0.71 s alone, 112 s "
    "during A's batch (158x); A's own latency p50 95 s, p99 257 s."
)


# -- plots --------------------------------------------------------------------------------------


def plot(document: dict[str, Any], path: Path) -> Path | None:
    """A PNG for `flood`, `vllm` and `sweep` (None for `single`, or without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    drawers: dict[str, Callable[[Any, dict[str, Any]], None]] = {
        "flood": _flood,
        "vllm": _flood,
        "sweep": _sweep,
    }
    drawer = drawers.get(document["scenario"])
    if drawer is None:
        return None
    drawer(plt, document)
    plt.savefig(path, dpi=110)
    plt.close("all")
    return path


def _flood(plt: Any, document: dict[str, Any]) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True)
    plan = document["plan"]
    colours = {"pass_through": "tab:red", "flow_control": "tab:blue"}
    for mode, result in document["modes"].items():
        points = [(t, v / 1000) for t, v in result["b_series"] if v is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            top.plot(xs, ys, "o-", ms=3, lw=0.8, color=colours[mode], label=f"B, {mode}")
        per_second = result["a_completions_per_s"]
        bottom.plot(range(len(per_second)), per_second, lw=0.8, color=colours[mode], label=mode)
    for axis in (top, bottom):
        axis.axvspan(0, plan["batch_s"], color="0.92", zorder=0)
    top.set_yscale("log")
    top.set_ylabel("B's TTFT (engine s, log)")
    top.set_title(
        f"{document['scenario']}: B's interactive streams before and during A's batch "
        f"({plan['concurrency']} concurrent; shaded: A sending)"
    )
    top.legend(loc="upper left", fontsize=8)
    capacity = document["capacity"]["requests_per_s"]
    bottom.axhline(capacity, color="0.4", ls="--", lw=0.8, label=f"capacity {capacity:.0f}/s")
    bottom.set_ylabel("A's completions per engine s")
    bottom.set_xlabel("engine seconds since A's batch started")
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()


def _sweep(plt: Any, document: dict[str, Any]) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    colours = {"pass_through": "tab:red", "flow_control": "tab:blue"}
    for mode in colours:
        runs = sorted(
            (r for r in document["runs"] if r["mode"] == mode), key=lambda r: r["fraction"]
        )
        if not runs:
            continue
        xs = [r["fraction"] for r in runs]
        axes[0].plot(xs, [r["goodput_over_capacity"] for r in runs], "o-", color=colours[mode])
        p99 = [r["ttft_admitted_lower_bound_ms"]["p99"] for r in runs]
        axes[1].plot(xs, [v / 1000 if v else None for v in p99], "o-", color=colours[mode])
        for x, v, r in zip(xs, p99, runs, strict=True):
            if r["cut_before_first_token"] and v:
                axes[1].annotate("≥", (x, v / 1000), fontsize=9, color=colours[mode])
        axes[2].plot(xs, [r["rejected_share"] for r in runs], "o-", color=colours[mode], label=mode)
    axes[0].set_title("goodput / capacity")
    axes[1].set_title("TTFT p99 of admitted requests (engine s)")
    axes[1].set_yscale("log")
    axes[2].set_title("share rejected (429)")
    axes[2].legend(fontsize=8)
    for axis in axes:
        axis.set_xlabel("offered load / capacity")
        axis.grid(alpha=0.3)
    fig.suptitle(
        f"sweep: {document['plan']['workers']} simulated workers, capacity "
        f"{document['capacity']['requests_per_s']:.0f} requests/s (engine time)"
    )
    fig.tight_layout()


# -- flow.md ------------------------------------------------------------------------------------


def write_summary(results: Path) -> str:
    """Writes `results/flow.md` from every `flow_*.json` there; returns the Markdown."""
    parts = [
        "# Flow control benchmark",
        "",
        "`python -m benchmarks.flow` (package `benchmarks/flow/`): each scenario runs the gateway "
        "with `--flow-control false` (pass-through, the baseline) and `--flow-control true` on "
        "the same workers and the same seeded requests, in the same run. Times and rates are "
        "engine time (simulator wall time / time scale); CPU and `Retry-After` are wall time. "
        "Checks marked MISS missed their target.",
        "",
    ]
    notes = results / "flow_notes.md"  # hand-written findings, kept across regenerations
    if notes.exists():
        parts += [notes.read_text().strip(), ""]
    writers = {"flood": _md_flood, "vllm": _md_flood, "sweep": _md_sweep, "single": _md_single}
    for path in sorted(results.glob("flow_*.json")):
        if path.name.endswith(".partial.json"):
            continue
        document = json.loads(path.read_text())
        writer = writers.get(document.get("scenario", ""))
        if writer is None:
            continue
        parts += [f"## `{document['scenario']}` ({path.name})", ""]
        parts += [
            f"Command: `{document['command']}` — {document['when']}, "
            f"{document['wall_time_s'] / 60:.1f} min, commit {document['git_commit']}.",
            "",
        ]
        parts += writer(document, path)
        parts += _md_checks(document)
    text = "\n".join(parts) + "\n"
    (results / "flow.md").write_text(text)
    return text


def _md_checks(document: dict[str, Any]) -> list[str]:
    checks = document.get("checks", [])
    if not checks:
        return []
    lines = ["| check | target | measured | result |", "|---|---|---|---|"]
    lines += [f"| {c['check']} | {c['target']} | {c['measured']} | {c['result']} |" for c in checks]
    return [*lines, ""]


def _md_flood(document: dict[str, Any], path: Path) -> list[str]:
    plan, cap, fig = document["plan"], document["capacity"], document["figures"]
    lines = [
        f"{plan['workers']} workers (time scale {plan['time_scale']:g}), keys A and B; B sends "
        f"{plan['b_rate']:g} streamed block requests/s, alone for {plan['alone_s']:g} s, then "
        f"for {plan['batch_s']:g} s while A keeps {plan['concurrency']} non-streaming MinerU "
        f"requests in flight (retrying 429s after `Retry-After`); gateway args "
        f"`{' '.join(document['gateway_args'])}`. Capacity (A alone, pass-through): "
        f"{cap['requests_per_s']:.1f} requests/s, {cap['output_tokens_per_s']:.0f} tokens/s.",
        "",
    ]
    modes = document["modes"]
    lines += ["| | " + " | ".join(m.replace("_", "-") for m in modes) + " |"]
    lines += ["|---|" + "---|" * len(modes)]

    def row(label: str, pick: Callable[[dict[str, Any]], str]) -> str:
        return f"| {label} | " + " | ".join(pick(modes[m]) for m in modes) + " |"

    def ttft(key: str, q: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: fmt(r[key]["ttft_ms"][q], " ms") + f" (n={r[key]['ttft_ms']['n']})"

    lines += [
        row("B TTFT p50 alone", ttft("b_alone", "p50")),
        row("B TTFT p99 alone", ttft("b_alone", "p99")),
        row("B TTFT p50 during A's batch", ttft("b_during_batch", "p50")),
        row("B TTFT p99 during A's batch", ttft("b_during_batch", "p99")),
        row("B TTFT p99 during, after A's warm-up", ttft("b_during_batch_after_warmup", "p99")),
        "| B p99 during / alone | "
        + " | ".join(fmt(fig[m]["b_ttft_p99_during_over_alone"], "x", 2) for m in modes)
        + " |",
        "| A goodput / capacity (requests) | "
        + " | ".join(fmt(fig[m]["a_goodput_over_capacity"], "x", 3) for m in modes)
        + " |",
        "| A goodput / capacity (tokens) | "
        + " | ".join(fmt(fig[m]["a_token_goodput_over_capacity"], "x", 3) for m in modes)
        + " |",
        row("A requests (completed)", lambda r: f"{r['a']['requests']} ({r['a']['completed']})"),
        row(
            "A 429s (requests hit)",
            lambda r: f"{r['a']['rejected_429']} ({r['a']['requests_rejected_at_least_once']})",
        ),
        row(
            "Retry-After p50/max (s)",
            lambda r: f"{r['retry_after_s'].get('p50', '-')}/{r['retry_after_s'].get('max', '-')}",
        ),
        row(
            "errors A/B (A lost)",
            lambda r: (
                f"{r['a']['errors']}/"
                f"{r['b_alone']['errors'] + r['b_during_batch']['errors']} ({r['a']['lost']})"
            ),
        ),
        row(
            "A E2E p50/p99",
            lambda r: (
                f"{fmt(_s(r['a']['e2e_ms']['p50']), ' s')}/{fmt(_s(r['a']['e2e_ms']['p99']), ' s')}"
            ),
        ),
        row("gateway peak RSS (VmHWM)", lambda r: f"{r['gateway_peak_rss_mb']} MB"),
        row(
            "cores during batch gw/workers/loadgen/foreign",
            lambda r: "/".join(
                f"{r['cpu_batch'][k]:.2f}"
                for k in ("gateway", "workers", "loadgen", "foreign_cores")
            ),
        ),
        "",
        f"B's TTFT p99 during A's batch, flow control against pass-through: "
        f"{fmt(fig['b_ttft_p99_during_flow_control_over_pass_through'], 'x', 3)}. {ISSUE}",
        "",
    ]
    png = path.with_suffix(".png")
    if png.exists():
        lines += [f"![{document['scenario']}]({png.name})", ""]
    return lines


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _md_sweep(document: dict[str, Any], path: Path) -> list[str]:
    plan = document["plan"]
    lines = [
        f"{plan['workers']} workers (time scale {plan['time_scale']:g}), one tenant, open-loop "
        f"Poisson MinerU mix (streamed), gateway args `{' '.join(document['gateway_args'])}`; "
        f"warm-up {plan['warmup_s']:g} s, window {plan['window_s']:g} s, tail cap "
        f"{plan['tail_cap_s']:g} s. Capacity {document['capacity']['requests_per_s']:.1f} "
        "requests/s (saturating closed loop, pass-through, same run). TTFT of admitted "
        "requests; `>=`: some were still waiting at the cut (a lower bound).",
        "",
        "| offered | mode | goodput / capacity | TTFT p50 | TTFT p99 | rejected | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in sorted(document["runs"], key=lambda r: (r["fraction"], r["mode"] != "pass_through")):
        ttft = run["ttft_admitted_lower_bound_ms"]
        bound = ">= " if run["cut_before_first_token"] else ""
        lines.append(
            f"| {run['fraction']:g}x | {run['mode']} | {fmt(run['goodput_over_capacity'], 'x', 3)} "
            f"| {bound}{fmt(ttft['p50'], ' ms', 0)} | {bound}{fmt(ttft['p99'], ' ms', 0)} "
            f"| {run['rejected_share']:.1%} | {run['errors']} |"
        )
    lines.append("")
    png = path.with_suffix(".png")
    if png.exists():
        lines += [f"![sweep]({png.name})", ""]
    return lines


def _md_single(document: dict[str, Any], path: Path) -> list[str]:
    plan, fig = document["plan"], document["figures"]
    lines = [
        f"{plan['workers']} identical workers (time scale {plan['time_scale']:g}), one tenant. "
        f"Saturation: closed loop of {plan['concurrency']} non-streaming requests. Latency: "
        f"{plan['load']:g}x capacity ({document['capacity_requests_per_s']:.1f} requests/s "
        f"measured here), open loop, streamed, warm-up {plan['warmup_s']:g} s, window "
        f"{plan['window_s']:g} s; repeats {plan['repeats']}.",
        "",
        "| | pass-through | flow control | ratio |",
        "|---|---|---|---|",
    ]
    for label, key, ratio_key in (
        (
            "saturation requests/s",
            "saturation_requests_per_s",
            "saturation_flow_control_over_pass_through",
        ),
        ("TTFT p50 (ms)", "ttft_p50_ms", "ttft_p50_flow_control_over_pass_through"),
        ("TTFT p99 (ms)", "ttft_p99_ms", "ttft_p99_flow_control_over_pass_through"),
    ):
        lines.append(
            f"| {label} | {fig['pass_through'][key]} | {fig['flow_control'][key]} | "
            f"{fmt(fig[ratio_key], 'x', 3)} |"
        )
    lines.append("")
    return lines
