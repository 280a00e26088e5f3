"""Helpers of the routing benchmark: the repeated-knee summary (`python -m benchmarks.routing.knee`)
on hand-made suite results, and the real-vLLM check's calibration size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks.routing import knee, vllm_real

P99 = dict[tuple[float, str], float]  # (fraction of capacity, router) -> TTFT p99 in ms


def result(seed: int, p99: P99, window_s: float = 24.0) -> dict[str, Any]:
    """A suite result of scenario (c) with the given TTFT p99s."""
    runs = [
        {
            "scenario": "c_direct_traffic",
            "fraction": fraction,
            "router": router,
            "ttft_ms": {"p50": 1.0, "p99": value},
        }
        for (fraction, router), value in p99.items()
    ]
    plan = {"time_scale": 0.8, "warmup_s": 40.0, "window_s": window_s, "seed": seed}
    settings = {"plan": plan, "seed": seed}
    command = f"suite --seed {seed}"
    return {"command": command, "git_commit": "abcdef123", "settings": settings, "runs": runs}


def test_runs_are_grouped_by_scenario_and_load_and_compared_within_a_seed() -> None:
    documents = [
        result(3, {(1.0, "queue"): 200, (1.0, "vllm_dp"): 100, (0.95, "queue"): 90,
                   (0.95, "vllm_dp"): 100}),
        result(4, {(1.0, "queue"): 300, (1.0, "vllm_dp"): 300, (0.95, "queue"): 110,
                   (0.95, "vllm_dp"): 99}),
    ]  # fmt: skip
    rows = {(row["fraction"], row["router"]): row for row in knee.summarise(documents)}
    assert set(rows) == {(0.95, "queue"), (0.95, "vllm_dp"), (1.0, "queue"), (1.0, "vllm_dp")}
    at_knee = rows[1.0, "queue"]
    assert at_knee["seeds"] == [3, 4]
    assert at_knee["p99_ms"] == [200, 300]
    assert at_knee["over_best"] == [2.0, 1.0]
    assert at_knee["over_best_mean"] == 1.5
    assert at_knee["best_in"] == 1
    assert rows[1.0, "vllm_dp"]["best_in"] == 2  # a tie is best for both
    assert rows[0.95, "queue"]["over_best"] == [1.0, 1.11]
    # Two seeds: the interval is t(1) = 12.71 times the standard error.
    assert rows[1.0, "queue"]["p99_ci95_ms"] == pytest.approx(12.71 * 50, abs=0.1)


def test_seeds_missing_for_some_router_are_left_out_of_the_comparison() -> None:
    documents = [
        result(3, {(1.0, "queue"): 200, (1.0, "vllm_dp"): 100}),
        result(4, {(1.0, "queue"): 300}),
    ]
    rows = {row["router"]: row for row in knee.summarise(documents)}
    assert rows["queue"]["seeds"] == [3] and rows["queue"]["p99_ms"] == [200]


def test_the_same_case_twice_is_refused() -> None:
    documents = [result(3, {(1.0, "queue"): 200}), result(3, {(1.0, "queue"): 210})]
    with pytest.raises(SystemExit, match="seed 3 is in two results"):
        knee.summarise(documents)


def test_the_table_names_the_plan_and_the_commands(tmp_path: Path) -> None:
    paths = []
    for seed, window in ((3, 8.0), (4, 24.0)):
        path = tmp_path / f"c_seed{seed}.json"
        path.write_text(json.dumps(result(seed, {(1.0, "queue"): 100.0}, window)))
        paths.append(str(path))
    out = tmp_path / "knee.md"
    assert knee.main([*paths, "--out", str(out)]) == 0
    text = out.read_text()
    assert "40 s warm-up, 8 or 24 s measured" in text
    assert "Made at commit abcdef1 (1 K)." in text
    assert "| c_direct_traffic | 1 K | queue | 100, 100 | 100 +/- 0 |" in text
    assert "suite --seed 3" in text and "suite --seed 4" in text
    assert json.loads(out.with_suffix(".json").read_text())[0]["router"] == "queue"


@pytest.mark.parametrize(
    ("server_args", "clients"),
    [
        ([], 24),  # vLLM's default batch of 16 on CPU, and a queue of 8
        (["--max-num-seqs=4"], 24),
        (["--max-num-seqs", "32"], 48),
        (["--enforce-eager", "--max-num-seqs=33"], 50),
    ],
)
def test_calibration_keeps_more_clients_per_worker_than_its_batch_holds(
    server_args: list[str], clients: int
) -> None:
    assert vllm_real.calibration_clients(server_args) == clients
