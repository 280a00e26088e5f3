"""The documents benchmark's pure parts: each run's figures against the small documents' times
alone, against the four of them at once, and the big one's against first come, first served
(benchmarks/mineru_client/documents.py)."""

from __future__ import annotations

from typing import Any

import pytest
from benchmarks.mineru_client.documents import BIG, SMALL, markdown, runs, summary

pytestmark = pytest.mark.unit


def run(name: str, completions: dict[str, float]) -> dict[str, Any]:
    documents = [
        {"name": doc, "completion_s": seconds, "pages_failed": 0, "page_times": []}
        for doc, seconds in completions.items()
    ]
    return {"name": name, "what": name, "gateway_args": [], "ids": True, "documents": documents}


def small_runs() -> list[dict[str, Any]]:
    names = [s["name"] for s in SMALL]
    alone = [run(f"alone_{n}", {n: 10.0}) for n in names]
    together = run("smalls_together", dict.fromkeys(names, 16.0))
    fcfs = run("fcfs", {BIG["name"]: 60.0} | dict.fromkeys(names, 33.0))
    ids = run("ids", {BIG["name"]: 63.0} | dict.fromkeys(names, 20.0))
    return [*alone, together, fcfs, ids]


def test_small_documents_are_read_against_alone_together_and_first_come() -> None:
    figures = summary(small_runs())
    assert figures["ids"]["small_vs_alone_mean"] == 2.0
    assert figures["ids"]["small_vs_together_mean"] == 1.25  # 20 s against 16 s together
    assert figures["ids"]["big_vs_fcfs"] == 1.05
    assert figures["fcfs"]["small_vs_alone_max"] == 3.3
    assert figures["together_s"] == dict.fromkeys([s["name"] for s in SMALL], 16.0)


def test_the_markdown_shows_each_run_and_the_together_baseline() -> None:
    results = small_runs()
    document = {
        "command": "python -m benchmarks.mineru_client.documents --out x.json",
        "git_commit": "abc",
        "date": "2026-12-07",
        "machine": {"cpus": 2},
        "setup": {"workers": 2, "max_num_seqs": 8, "time_scale": 1.0},
        "summary": summary(results),
        "runs": results,
    }
    text = markdown(document)
    assert "| `ids` | 2.00x, 2.00x, 2.00x, 2.00x | 2.00x | 2.00x | 1.25x | 63.0 s |" in text
    assert "The four together, no big one: small-0 16.0 s" in text


def test_the_small_scenario_runs_the_four_together_with_ids() -> None:
    together = next(r for r in runs("small") if r.name == "smalls_together")
    assert together.ids
    assert [d["name"] for d in together.plan] == [s["name"] for s in SMALL]
    assert all(d["start_s"] == 0.0 for d in together.plan)
