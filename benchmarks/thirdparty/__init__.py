"""A third-party LLM benchmark, run unchanged against the gateway: guidellm
(https://github.com/vllm-project/guidellm) in its own virtualenv (`scripts/install-guidellm.sh`),
pointed at the gateway's URL with its ordinary OpenAI target options: streaming chat completions,
synthetic prompts, a short sweep of fixed request rates.

    python -m benchmarks.thirdparty --out benchmarks/results/thirdparty.json   # about 2 minutes

`__main__.py` starts the simulated workers, the gateway and guidellm; this module holds the pure
parts: guidellm's command line, the summary read from guidellm's own JSON result, and the Markdown.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOL = "guidellm"
# The percentiles the summary keeps of each of guidellm's distributions (its own names).
PERCENTILES = ("p50", "p90", "p99")
LATENCIES = {
    "ttft_ms": "time_to_first_token_ms",
    "itl_ms": "inter_token_latency_ms",
    "tpot_ms": "time_per_output_token_ms",
}


@dataclass(frozen=True)
class Workload:
    """What guidellm sends: synthetic prompts of `prompt_tokens` (counted by `tokenizer`),
    answers of exactly `output_tokens`, at each of `rates` requests/s for `seconds` each, the
    first `warmup_s` of which guidellm leaves out of its statistics."""

    model: str
    tokenizer: str
    prompt_tokens: int
    output_tokens: int
    rates: tuple[float, ...]
    seconds: float
    warmup_s: float
    seed: int = 42


def guidellm_argv(guidellm: str, target: str, workload: Workload, result: Path) -> list[str]:
    """`guidellm run` with its OpenAI HTTP backend aimed at `target`: streaming chat completions
    (guidellm's default `stream=true`), one constant-rate benchmark per rate, its JSON result.
    The warm-up leaves out each benchmark's first seconds, while guidellm itself still starts
    its worker processes and generates prompts (on 2 cores that delayed requests by up to
    0.6 s)."""
    backend = f"kind=openai_http,target={target},model={workload.model}"
    rates = ",".join(f"{rate:g}" for rate in workload.rates)
    data = f"kind=synthetic_text,prompt_tokens={workload.prompt_tokens}"
    return [
        guidellm,
        "run",
        *("--backend", backend + ",request_format=/v1/chat/completions"),
        *("--profile", f"kind=constant,warmup={workload.warmup_s:g}"),
        *("--override", "profile.rate", rates),
        *("--constraint", f"kind=max_duration,seconds={workload.seconds:g}"),
        *("--tokenizer", f"kind=huggingface_auto,model={workload.tokenizer}"),
        *("--data", f"{data},output_tokens={workload.output_tokens}"),
        *("--seed", f"kind=static,value={workload.seed}"),
        *("--output", f"kind=json,path={result}"),
        *("--output", "kind=console"),
        "--disable-progress",
    ]


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(argv)


# -- guidellm's result -> the summary ----------------------------------------------------------


def _distribution(metric: dict[str, Any]) -> dict[str, float]:
    """One guidellm distribution over successful requests: its mean and `PERCENTILES`."""
    successful = metric["successful"]
    out = {"mean": successful["mean"]}
    out |= {name: successful["percentiles"][name] for name in PERCENTILES}
    return {key: round(value, 3) for key, value in out.items()}


def _rate(benchmark: dict[str, Any]) -> float | None:
    rate = benchmark["config"]["strategy"].get("rate")
    return None if rate is None else float(rate)


def summarize_benchmark(benchmark: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own numbers for one of its benchmarks (one rate): requests by outcome,
    achieved request and token throughput (means over the run), and TTFT, ITL, TPOT."""
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]
    row: dict[str, Any] = {
        "strategy": benchmark["config"]["strategy"]["type_"],
        "rate": _rate(benchmark),
        "duration_s": round(benchmark["duration"], 2),
        "completed": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        "requests_per_s": round(metrics["requests_per_second"]["successful"]["mean"], 3),
        "output_tokens_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 1),
        "total_tokens_per_s": round(metrics["tokens_per_second"]["successful"]["mean"], 1),
        "prompt_tokens_median": metrics["prompt_token_count"]["successful"]["median"],
        "output_tokens_median": metrics["output_token_count"]["successful"]["median"],
        "warnings": [warning["message"] for warning in benchmark.get("warnings", [])],
    }
    return row | {name: _distribution(metrics[key]) for name, key in LATENCIES.items()}


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One summary row per benchmark in guidellm's JSON result (`--output kind=json`)."""
    return [summarize_benchmark(benchmark) for benchmark in result["benchmarks"]]


def tool_version(result: dict[str, Any]) -> str:
    return str(result["metadata"]["guidellm_version"])


def problems(rows: Sequence[dict[str, Any]], output_tokens: int) -> list[str]:
    """What would make the run not a clean pass: errored requests, a rate with nothing completed,
    answers of another length than asked. Incomplete requests are not: guidellm cancels those
    still running when a benchmark's time is up."""
    found = []
    for row in rows:
        name = f"rate {row['rate']:g}" if row["rate"] is not None else row["strategy"]
        if row["errored"]:
            found.append(f"{name}: {row['errored']} errored")
        if not row["completed"]:
            found.append(f"{name}: no request completed")
        elif row["output_tokens_median"] != output_tokens:
            found.append(f"{name}: median answer {row['output_tokens_median']} tokens")
    return found


def notes(rows: Sequence[dict[str, Any]], workload: Workload) -> list[str]:
    """What a reader needs to read the table: where guidellm's token counts come from."""
    prompts = sorted({row["prompt_tokens_median"] for row in rows})
    return [
        f"- guidellm builds prompts of {workload.prompt_tokens} tokens with the tokenizer it is "
        "given (the tiny local Qwen2's), but reports the server's `usage` counts "
        "(`prefer_response_metrics`): the simulator counts a prompt as MinerU's tokenizer "
        "roughly would, 4 characters a token, hence a median of "
        f"{'-'.join(f'{p:g}' for p in prompts)} prompt tokens. Answers are exact: guidellm "
        "sends `max_completion_tokens` and `ignore_eos`, both relayed unchanged.",
        "- guidellm asks for `stream_options.continuous_usage_stats`; the simulator (unlike "
        "vLLM) sends usage only in the last chunk, which guidellm accepts.",
        "- At time scale 0.1 a simulated TTFT is a few milliseconds, so guidellm's own delay in "
        "sending a request (about 1 ms, its warning below) is a fifth of it: these latencies "
        "show that the gateway streams token by token, not what a 910B would take.",
        "- Incomplete requests are those still running when a benchmark's time was up: guidellm "
        "cancels them, and counts them apart from errors.",
    ]


# -- the Markdown ------------------------------------------------------------------------------


def _p(distribution: dict[str, float], key: str) -> str:
    return f"{distribution[key]:.1f}"


def table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = [
        "| rate (req/s) | completed / errored / incomplete | req/s | output tok/s "
        "| TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | tokens per request in / out |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ttft, itl, tpot = row["ttft_ms"], row["itl_ms"], row["tpot_ms"]
        lines.append(
            f"| {row['rate']:g} | {row['completed']} / {row['errored']} / {row['incomplete']} "
            f"| {row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.0f} "
            f"| {_p(ttft, 'p50')} / {_p(ttft, 'p99')} | {_p(itl, 'p50')} / {_p(itl, 'p99')} "
            f"| {_p(tpot, 'p50')} | {row['prompt_tokens_median']:g} / "
            f"{row['output_tokens_median']:g} |"
        )
    return lines


def warning_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """guidellm's own warnings about each benchmark, as it printed them."""
    return [
        f"- guidellm warned at rate {row['rate']:g}: {message}"
        for row in rows
        for message in row["warnings"]
    ]


def cpu_lines(cpu: dict[str, float] | None) -> list[str]:
    if cpu is None:
        return []
    return [
        f"- CPU over the whole run, in cores: gateway {cpu['gateway']:.2f}, workers "
        f"{cpu['workers']:.2f}, guidellm and everything else {cpu['foreign_cores']:.2f}; "
        f"machine {cpu['machine_util']:.0%} busy."
    ]


def markdown(document: dict[str, Any]) -> str:
    tool, settings = document["tool"], document["settings"]
    found = document["problems"]
    lines = [
        f"# {tool['name']} {tool['version']} against the gateway",
        "",
        f"Run {document['when']} at commit {document['git_commit']}, "
        f"{document['wall_time_s']:.0f} s: `{document['command']}`.",
        f"The gateway (`serve`, default settings) over {settings['workers']} simulated workers "
        f"(time scale {settings['time_scale']:g}, served name `{settings['model']}`); "
        f"{tool['name']} from its own virtualenv, unchanged, with this command (ports are free "
        "ports picked for the run):",
        "",
        "```sh",
        tool["command"],
        "```",
        "",
        f"{tool['name']}'s own summary ({settings['seconds']:g} s per rate; means over the run, "
        "latencies over completed requests):",
        "",
        *table(document["summary"]),
        "",
        *document.get("notes", []),
        *cpu_lines(document.get("cpu")),
        *warning_lines(document["summary"]),
        "",
        "Problems: " + ("; ".join(found) if found else "none: no errored request."),
        "",
    ]
    return "\n".join(lines)


def write(document: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(document))
