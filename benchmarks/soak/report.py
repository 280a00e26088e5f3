"""`soak.md`: the soak's figures in a few tables, written next to its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write(result: dict[str, Any], path: Path) -> None:
    path.write_text("\n".join(lines(result)) + "\n")


def lines(result: dict[str, Any]) -> list[str]:
    plan, start, end = result["plan"], result["start"], result["end"]
    ratios = result["end_over_start"]
    out = [
        "# Soak: mixed load with faults on a schedule",
        "",
        f"`python -m benchmarks.soak` (`make bench-soak`), commit {result['commit']}: "
        f"{result['soak_s'] / 60:.1f} minutes, {plan['workers']} simulated workers "
        f"(time scale {plan['time_scale']:g}), {plan['clients']} closed-loop clients sending "
        f"MinerU's mix (every other request streamed), one {plan['window_s']:g} s fault window "
        f"every {plan['period_s']:g} s.",
        "",
        "| | requests | completed | explicit errors | lost |",
        "|---|---|---|---|---|",
        _totals("all", result["kinds"]),
        *(_totals(name, kinds) for name, kinds in result["by_fault"].items()),
        "",
        f"Before it, a warm-up went through every fault once ({plan['warmup_window_s']:g} s "
        f"windows): {sum(result['warmup_kinds'].values())} requests, "
        f"{sum(result['warmup_lost'].values())} lost. The start is read after it, idle.",
        "",
        "| gateway (idle, after the warm-up / after the soak) | start | end | end / start |",
        "|---|---|---|---|",
        f"| RSS (MB) | {start['rss_mb']} | {end['rss_mb']} | {ratios['rss_mb']} |",
        f"| descriptors | {start['fds']} | {end['fds']} | {ratios['fds']} |",
        f"| of which idle connections to workers | {start['pool']} | {end['pool']} | |",
        f"| of which the rest | {start['other_fds']} | {end['other_fds']} "
        f"| {ratios['other_fds']} |",
        "",
        f"Flat within 5% (RSS, and descriptors but the idle connections to workers): "
        f"**{_yes(result['flat_within_5_percent'])}**. The idle connections are aiohttp's pool: "
        "it keeps as many as its health probes and load scrapes go on reusing, oldest first, so "
        f"their number drifts without a leak; within the {result['pool_limit']} that the "
        f"clients and probes can have opened at once: **{_yes(result['pool_within_limit'])}**. "
        f"In-flight and queue counters back to zero at the end: "
        f"**{_yes(result['counters_zero_at_end'])}**. Peak during the soak: "
        f"{result['peak_rss_mb']} MB RSS, {result['peak_fds']} descriptors (the idle-connections "
        "fault holds 1,000 at once).",
        "",
        "Errors by kind (`error:<status>:<code>` is an OpenAI-shaped JSON error, "
        "`stream_error:<code>` an SSE error event before `data: [DONE]`):",
        "",
        "| kind | count |",
        "|---|---|",
        *(f"| `{kind}` | {count} |" for kind, count in result["kinds"].items() if kind != "ok"),
        "",
        "Faults, in order:",
        "",
        "| at (s) | fault | details |",
        "|---|---|---|",
        *(_fault(entry) for entry in result["faults"]),
    ]
    return out


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _totals(name: str, kinds: dict[str, int]) -> str:
    total = sum(kinds.values())
    lost = sum(n for kind, n in kinds.items() if kind.startswith("lost"))
    ok = kinds.get("ok", 0)
    return f"| {name} | {total} | {ok} | {total - ok - lost} | {lost} |"


def _fault(entry: dict[str, Any]) -> str:
    details = ", ".join(f"{k}={v}" for k, v in entry.items() if k not in ("fault", "at_s"))
    return f"| {entry['at_s']} | {entry['fault']} | {details} |"
