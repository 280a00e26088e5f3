"""Documents through one API key: MinerU's own client, first come first served against flows.

Two scenarios, each run with fresh simulated workers and a fresh gateway per run, every run of a
scenario in the same invocation (ratios within one run of this command):

- `small` (measure 1): a 40-page document, then four 3-page documents 2 s later, all through one
  key, with the workers' batches full. Runs: each small document alone; the four at once
  without the big one (what they cost each other); first come, first
  served (`--order-steps false`, no document ids: the gateway before documents); document ids
  sent (`X-Document-Id` through `MinerUClient(server_headers=...)`); no ids (steps ordered only).
  Each small document's completion against its time alone, the big one's against first come,
  first served.
- `pages` (measure 2): one 100-page document, steps ordered against first come, first served:
  pages in flight (a page whose layout is answered and whose blocks are not all answered holds
  its crops in the client) and page latency (layout answered to page done; page sent to done).

    python -m benchmarks.mineru_client.documents --out benchmarks/results/flow_documents.json

Answer lengths are drawn from each request's content with one seed on every worker, so a page
costs the same in every run whichever worker serves it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import client_venv
from .run import Stand, git_commit, start_stand

DRIVER = Path(__file__).resolve().with_name("documents_driver.py")
BIG = {"name": "big-40", "pages": 40, "start_s": 0.0, "seed": 1}
SMALL = [{"name": f"small-{i}", "pages": 3, "start_s": 2.0, "seed": 2 + i} for i in range(4)]
HUNDRED = {"name": "doc-100", "pages": 100, "start_s": 0.0, "seed": 7}


@dataclass(frozen=True)
class Run:
    name: str
    what: str
    plan: tuple[dict[str, Any], ...]
    ids: bool
    gateway: tuple[str, ...] = ()


FCFS = ("--order-steps", "false", "--batch-reserve", "0")


def runs(scenario: str) -> list[Run]:
    if scenario == "small":
        mixed = (BIG, *SMALL)
        alone = [
            Run(f"alone_{s['name']}", "the small document alone", ({**s, "start_s": 0.0},), True)
            for s in SMALL
        ]
        together = tuple({**s, "start_s": 0.0} for s in SMALL)
        return [
            *alone,
            Run("smalls_together", "the four small documents at once, no big one", together, True),
            Run("fcfs", "first come, first served: no ids, steps not ordered", mixed, False, FCFS),
            Run("ids", "document ids sent, steps ordered (the default)", mixed, True),
            Run("no_ids", "no document ids, steps ordered (the default)", mixed, False),
        ]
    return [
        Run("pages_fcfs", "100 pages, steps not ordered", (HUNDRED,), True, FCFS),
        Run(
            "pages_ordered", "100 pages, block requests ahead of layout (default)", (HUNDRED,), True
        ),
    ]


def execute(run: Run, args: argparse.Namespace, python: Path, log_root: Path) -> dict[str, Any]:
    log_dir = log_root / run.name
    log_dir.mkdir(parents=True, exist_ok=True)
    stand = Stand(log_dir)
    try:
        gateway_argv = [
            *("--batch-limit", str(args.max_num_seqs)),
            *(args.gateway_arg if run.gateway != FCFS else ()),
            *run.gateway,
        ]
        gateway, _ = start_stand(stand, args, gateway_argv, seeds=[0] * args.workers)
        argv = [
            *("--url", gateway, "--plan", json.dumps(list(run.plan))),
            *(("--ids",) if run.ids else ()),
        ]
        env = os.environ | {"MINERU_VL_API_KEY": ""}
        env.pop("MINERU_VL_MODEL_NAME", None)
        with (log_dir / "driver.stderr").open("wb") as stderr:
            done = subprocess.run(
                [str(python), str(DRIVER), *argv],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=args.run_timeout_s,
                check=False,
                cwd=DRIVER.parent,
            )
        if done.returncode != 0:
            tail = (log_dir / "driver.stderr").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"driver failed ({done.returncode}) in {run.name}:\n{tail}")
    finally:
        stand.stop()
    result = json.loads(done.stdout)
    return {
        "name": run.name,
        "what": run.what,
        "gateway_args": gateway_argv[2:],
        "ids": run.ids,
        **result,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def page_figures(document: dict[str, Any]) -> dict[str, Any]:
    """Pages in flight (layout answered, blocks not all answered) over the document's time, and
    page latencies."""
    pages = [p for p in document["page_times"] if p["layout_s"] is not None]
    events = sorted([(p["layout_s"], 1) for p in pages] + [(p["end_s"], -1) for p in pages])
    start, end = document["start_s"], document["end_s"]
    level = peak = 0
    area = 0.0
    last = start
    for at, step in events:
        area += level * (at - last)
        last = at
        level += step
        peak = max(peak, level)
    after_layout = [p["end_s"] - p["layout_s"] for p in pages]
    sent_to_done = [p["end_s"] - p["start_s"] for p in pages]
    return {
        "pages_in_flight_mean": round(area / max(end - start, 1e-9), 2),
        "pages_in_flight_max": peak,
        "layout_to_done_p50_s": round(percentile(after_layout, 0.5), 3),
        "layout_to_done_p99_s": round(percentile(after_layout, 0.99), 3),
        "page_done_p50_s": round(percentile(sent_to_done, 0.5), 3),
        "page_done_p99_s": round(percentile(sent_to_done, 0.99), 3),
        "completion_s": document["completion_s"],
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    by_name = {r["name"]: r for r in results}
    out: dict[str, Any] = {}
    if "fcfs" in by_name:
        alone = {
            r["documents"][0]["name"]: r["documents"][0]["completion_s"]
            for r in results
            if r["name"].startswith("alone_")
        }
        fcfs_big = next(d for d in by_name["fcfs"]["documents"] if d["name"] == BIG["name"])
        together = {
            d["name"]: d["completion_s"]
            for d in by_name.get("smalls_together", {"documents": []})["documents"]
        }
        for name in ("fcfs", "ids", "no_ids"):
            if name not in by_name:
                continue
            docs = {d["name"]: d for d in by_name[name]["documents"]}
            small = {n: round(docs[n]["completion_s"] / alone[n], 2) for n in alone if n in docs}
            out[name] = {
                "small_vs_alone": small,
                "small_vs_alone_max": max(small.values()) if small else None,
                "small_vs_alone_mean": round(statistics.fmean(small.values()), 2)
                if small
                else None,
                # Against the four at once without the big one: what the big one costs them.
                "small_vs_together_mean": round(
                    statistics.fmean(docs[n]["completion_s"] / together[n] for n in together), 2
                )
                if together
                else None,
                "big_completion_s": docs[BIG["name"]]["completion_s"],
                "big_vs_fcfs": round(
                    docs[BIG["name"]]["completion_s"] / fcfs_big["completion_s"], 3
                ),
                "failed_pages": sum(d["pages_failed"] for d in docs.values()),
            }
        out["alone_s"] = alone
        out["together_s"] = together
    for name in ("pages_fcfs", "pages_ordered"):
        if name in by_name:
            out[name] = page_figures(by_name[name]["documents"][0])
    return out


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(document: dict[str, Any]) -> str:
    s = document["summary"]
    lines = [
        "# Documents through one key: MinerU's own client, flows and steps",
        "",
        f"Command: `{document['command']}` (commit `{document['git_commit']}`, "
        f"{document['date']}, {document['machine']['cpus']} CPUs).",
        "",
        f"mineru-vl-utils {client_venv.VERSION} (its own virtualenv, unmodified) against "
        f"{document['setup']['workers']} simulated workers (`--max-num-seqs "
        f"{document['setup']['max_num_seqs']}`, `--time-scale {document['setup']['time_scale']}`, "
        "one seed), gateway `--batch-limit` the same; fresh workers and gateway per run. One "
        "`MinerUClient` per document; with ids each sends `X-Document-Id` through "
        "`server_headers`. The simulator's layout answers list distinct blocks, one per ~22 "
        "answer tokens (a median page: ~22 block requests; real pages have about 10-30).",
        "",
    ]
    if "fcfs" in s:
        lines += [
            "## 1. A 40-page document, then four 3-page documents 2 s later",
            "",
            "| run | small docs: completion / alone (each) | max | mean | mean / the four "
            "together | big doc completion | big / FCFS | failed pages |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in ("fcfs", "ids", "no_ids"):
            if name in s:
                r = s[name]
                each = ", ".join(f"{v:.2f}x" for v in r["small_vs_alone"].values())
                lines.append(
                    f"| `{name}` | {each} | {r['small_vs_alone_max']:.2f}x | "
                    f"{r['small_vs_alone_mean']:.2f}x | "
                    f"{_ratio(r.get('small_vs_together_mean'))} | "
                    f"{r['big_completion_s']:.1f} s | "
                    f"{r['big_vs_fcfs']:.3f}x | {r['failed_pages']} |"
                )
        alone = ", ".join(f"{k} {v:.1f} s" for k, v in s["alone_s"].items())
        lines += ["", f"Alone: {alone}."]
        if s.get("together_s"):
            together = ", ".join(f"{k} {v:.1f} s" for k, v in s["together_s"].items())
            lines.append(f"The four together, no big one: {together}.")
        lines.append("")
        for run in document["runs"]:
            lines.append(
                f"- `{run['name']}`: {run['what']} (gateway `{' '.join(run['gateway_args'])}`)"
            )
        lines.append("")
    if "pages_fcfs" in s:
        lines += [
            "## 2. One 100-page document: steps ordered against first come, first served",
            "",
            "| run | pages in flight, mean | max | layout answered to page done p50 / p99 "
            "| page sent to done p50 / p99 | completion |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("pages_fcfs", "pages_ordered"):
            if name in s:
                r = s[name]
                lines.append(
                    f"| `{name}` | {r['pages_in_flight_mean']} | {r['pages_in_flight_max']} | "
                    f"{r['layout_to_done_p50_s']:.2f} s / {r['layout_to_done_p99_s']:.2f} s | "
                    f"{r['page_done_p50_s']:.2f} s / {r['page_done_p99_s']:.2f} s | "
                    f"{r['completion_s']:.1f} s |"
                )
        lines += [
            "",
            "A page is in flight from its layout answer to its last block answer: the client "
            "holds its crops meanwhile.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--scenarios", default="small,pages")
    parser.add_argument("--only", default="", help="comma-separated run names (default all)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--venv", type=Path, default=client_venv.DEFAULT_VENV)
    parser.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="passed to the gateway of every run but first come, first served's",
    )
    args = parser.parse_args(argv)
    python = client_venv.ensure(args.venv)
    log_root = Path(tempfile.mkdtemp(prefix="mineru-documents-bench-"))
    print(f"logs in {log_root}", flush=True)
    only = {n for n in args.only.split(",") if n}
    results = []
    for scenario in args.scenarios.split(","):
        for run in runs(scenario):
            if only and run.name not in only:
                continue
            started = time.perf_counter()
            result = execute(run, args, python, log_root)
            results.append(result)
            times = ", ".join(f"{d['name']} {d['completion_s']:.1f} s" for d in result["documents"])
            print(f"{run.name}: {times} ({time.perf_counter() - started:.0f} s)", flush=True)
    document = {
        "benchmark": "flow_documents",
        "command": "python -m benchmarks.mineru_client.documents " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "setup": {
            "workers": args.workers,
            "max_num_seqs": args.max_num_seqs,
            "time_scale": args.time_scale,
        },
        "summary": summary(results),
        "runs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(document))
    print(json.dumps(document["summary"], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
