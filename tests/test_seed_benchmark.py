"""The seed benchmark's pure parts (`benchmarks/seed/`): its prompts, its `vllm bench serve`
arguments, and the rows, ratios and Markdown made from vllm bench's recorded results
(`tests/fixtures/seed/`)."""

from __future__ import annotations

import copy
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from benchmarks.seed import dataset, report
from benchmarks.seed.bench import Dataset, bench_argv, parse_args, prompt_count, prompts_for

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "seed"


def recorded(name: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((FIXTURES / f"{name}-c4.json").read_text())
    return result


def run(setup: str, result: dict[str, Any], problems: list[str] | None = None) -> dict[str, Any]:
    return {
        "setup": setup,
        "concurrency": result["max_concurrency"],
        "prompts": result["num_prompts"],
        "command": "vllm bench serve ...",
        "cpu": {"foreign_cores": 0.25},
        "problems": problems or [],
        "result": result,
    }


def document(runs: list[dict[str, Any]], output_len: int = 32) -> dict[str, Any]:
    return {
        "command": "python -m benchmarks.seed --quick",
        "git_commit": "abc",
        "when": "2026-12-02T18:11:00Z",
        "wall_time_s": 90.0,
        "machine": {"cpus": 2},
        "settings": {
            "sim": {
                "workers": 4,
                "time_scale": 1.0,
                "vllm_version": "0.32.0",
                "min_prompts": 2,
                "prompts_per_client": 1,
                "input_len": 512,
                "output_len": output_len,
            }
        },
        "runs": runs,
    }


# -- prompts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [9, 10, 100, 512, 2048])
def test_a_prompt_weighs_exactly_the_tokens_asked_for_in_the_simulator(tokens: int) -> None:
    text = dataset.prompt_text(tokens, random.Random(tokens))
    assert dataset.counted_tokens(text) == tokens
    assert len(text) == 4 * (tokens - dataset.counted_tokens(""))


def test_a_prompt_smaller_than_the_chat_template_is_refused() -> None:
    with pytest.raises(ValueError, match="chat template"):
        dataset.prompt_text(dataset.counted_tokens(""), random.Random(0))


def test_the_prompts_file_is_sharegpt_shaped_distinct_and_seeded(tmp_path: Path) -> None:
    path = dataset.write_prompts(tmp_path / "prompts.json", 5, 512, seed=3)
    entries = json.loads(path.read_text())
    prompts = [entry["conversations"][0]["value"] for entry in entries]
    assert len(set(prompts)) == 5
    assert {dataset.counted_tokens(prompt) for prompt in prompts} == {512}
    # vllm bench's ShareGPT loader keeps entries with a human turn and an answer turn.
    assert all([turn["from"] for turn in e["conversations"]] == ["human", "gpt"] for e in entries)
    again = dataset.write_prompts(tmp_path / "again.json", 5, 512, seed=3)
    assert again.read_text() == path.read_text()


# -- vllm bench's arguments ---------------------------------------------------------------------


def test_the_simulated_part_sends_the_prompts_file_with_answers_of_the_asked_length(
    tmp_path: Path,
) -> None:
    data = Dataset(512, 1024, tmp_path / "prompts.json")
    argv = bench_argv(
        data,
        base_url="http://127.0.0.1:9",
        model="m",
        tokenizer="/tok",
        concurrency=8,
        prompts=32,
        seed=0,
        result_dir=tmp_path,
        filename="gateway-c8.json",
    )
    flags = dict(itertools.pairwise(argv))
    assert flags["--dataset-name"] == "sharegpt"
    assert flags["--sharegpt-output-len"] == "1024"
    assert flags["--max-concurrency"] == "8"
    assert flags["--num-prompts"] == "32"
    assert flags["--metric-percentiles"] == "50,90,99"
    assert flags["--percentile-metrics"] == "ttft,tpot,itl,e2el"
    assert flags["--backend"] == "openai-chat"
    assert {"--ignore-eos", "--save-result"} <= set(argv)
    assert data.input_tokens == 512  # the simulator reports exactly what the file holds


def test_the_real_vllm_check_uses_vllms_random_prompts_and_leaves_their_count_unchecked() -> None:
    data = Dataset(512, 1024)
    assert data.flags == (
        *("--dataset-name", "random", "--random-input-len", "512"),
        *("--random-output-len", "1024"),
    )
    assert data.input_tokens is None


def test_requests_per_run_are_four_per_client_and_at_least_sixteen() -> None:
    assert [prompts_for(c, 16, 4) for c in (1, 8, 16, 32)] == [16, 32, 64, 128]


def test_the_defaults_are_the_seeds_shape_and_quick_is_small() -> None:
    full = parse_args([])
    assert full.concurrency == [1, 8, 16, 32]
    assert (full.input_len, full.output_len) == (512, 1024)
    assert full.real_concurrency == [1, 8]
    assert full.out.name == "seed.json"
    assert prompt_count(full) == 128
    quick = parse_args(["--quick", "--real-concurrency", ""])
    assert quick.real_concurrency == []
    assert quick.output_len == 32
    assert quick.out.name == "seed_quick.json"


# -- rows, checks and ratios --------------------------------------------------------------------


def test_a_recorded_result_becomes_a_row() -> None:
    result = recorded("gateway")
    row = report.row_from_result("gateway", result)
    assert (row.setup, row.concurrency, row.prompts, row.completed, row.failed) == (
        "gateway",
        4,
        4,
        4,
        0,
    )
    assert row.qps == result["request_throughput"]
    assert row.output_tokens_per_s == result["output_throughput"]
    assert row.ttft == {
        "mean": result["mean_ttft_ms"],
        "p50": result["p50_ttft_ms"],
        "p90": result["p90_ttft_ms"],
        "p99": result["p99_ttft_ms"],
    }
    assert row.tpot["p99"] == result["p99_tpot_ms"]
    assert row.e2el["p90"] == result["p90_e2el_ms"]
    assert (row.input_tokens_per_request, row.output_tokens_per_request) == (512, 32)
    # Little's law: 4 clients kept 4 requests in flight, less the closed loop's ramp and tail.
    in_flight = result["request_throughput"] * result["mean_e2el_ms"] / 1000
    assert row.in_flight == pytest.approx(in_flight)
    assert 3.5 < row.in_flight <= 4.0


def test_token_problems_name_what_differs_from_what_was_asked() -> None:
    row = report.row_from_result("gateway", recorded("gateway"))
    assert report.token_problems(row, 512, 32) == []
    assert report.token_problems(row, None, 32) == []
    assert report.token_problems(row, 512, 1024) == ["32 output tokens a request"]
    assert report.token_problems(row, 224, 32) == ["512 prompt tokens a request"]
    failed = recorded("gateway") | {"completed": 3, "failed": 1, "total_output_tokens": 96}
    problems = report.token_problems(report.row_from_result("gateway", failed), 512, 32)
    assert problems[0] == "3 of 4 completed, 1 failed"


def test_ratios_are_the_gateways_figures_over_the_dp_balancers_per_concurrency() -> None:
    gateway, dp = recorded("gateway"), recorded("vllm_dp")
    rows = report.rows_of([run("gateway", gateway), run("vllm_dp", dp)])
    [entry] = report.ratios(rows, report.GATEWAY, report.VLLM_DP)
    assert entry["concurrency"] == 4
    ratio = gateway["request_throughput"] / dp["request_throughput"]
    assert entry["qps"] == pytest.approx(ratio, abs=1e-4)
    assert entry["ttft"]["p99"] == pytest.approx(
        gateway["p99_ttft_ms"] / dp["p99_ttft_ms"], abs=1e-4
    )
    assert set(entry) == {"concurrency", "qps", "output_tokens_per_s", "ttft", "tpot", "e2el"}
    assert set(entry["e2el"]) == {"p50", "p90", "p99"}


def test_ratios_skip_a_concurrency_one_setup_lacks_and_a_zero_reference() -> None:
    gateway, dp = recorded("gateway"), recorded("vllm_dp")
    alone = gateway | {"max_concurrency": 8}
    zero = copy.deepcopy(dp) | {"p50_tpot_ms": 0.0}
    rows = report.rows_of([run("gateway", gateway), run("gateway", alone), run("vllm_dp", zero)])
    [entry] = report.ratios(rows, report.GATEWAY, report.VLLM_DP)
    assert entry["concurrency"] == 4
    assert entry["tpot"]["p50"] is None


# -- Markdown -----------------------------------------------------------------------------------


def test_the_markdown_tables_show_every_run_and_the_ratios() -> None:
    gateway, dp = recorded("gateway"), recorded("vllm_dp")
    text = report.markdown(document([run("gateway", gateway), run("vllm_dp", dp)]))
    lines = text.splitlines()
    [measured] = [line for line in lines if line.startswith("| gateway over 4 workers | 4 |")]
    cells = [cell.strip() for cell in measured.split("|")[1:-1]]
    assert cells[2:4] == ["4", f"{gateway['request_throughput']:.3f}"]
    assert cells[4] == " / ".join(f"{gateway[f'{p}_ttft_ms']:.1f}" for p in ("p50", "p90", "p99"))
    assert cells[6].startswith(f"{gateway['p50_e2el_ms'] / 1000:.2f} / ")
    assert cells[-1] == "0.25"  # other processes' cores
    [ratio] = [line for line in lines if line.startswith("| 4 | ")]
    qps = gateway["request_throughput"] / dp["request_throughput"]
    assert ratio.startswith(f"| 4 | {qps:.3f} | ")
    assert "Every request of every run completed" in text
    assert "Beside the seed's published table" in text
    assert "Real vLLM" not in text


def test_the_markdown_lists_runs_with_problems_and_a_skipped_real_vllm_check() -> None:
    runs = [run("gateway", recorded("gateway"), ["32 output tokens a request"])]
    doc = document(runs, output_len=1024) | {"real_vllm": {"skipped": "not asked for"}}
    text = report.markdown(doc)
    assert "- gateway over 4 workers at 4: 32 output tokens a request" in text
    assert "Not run: not asked for." in text


def test_runs_disturbed_by_other_processes_are_flagged_and_notes_are_rendered() -> None:
    busy = run("gateway", recorded("gateway")) | {"cpu": {"foreign_cores": 1.19}}
    doc = document([busy, run("vllm_dp", recorded("vllm_dp"))]) | {"notes": ["A finding."]}
    text = report.markdown(doc)
    assert text.count("| 1.19 (!) |") == 1
    assert "| 0.25 |" in text
    assert "(!) Other processes took more than 0.5 cores during the run so marked" in text
    assert text.endswith("### Notes (written after the run)\n\n- A finding.\n")


def test_the_published_98_ms_p50_is_shown_to_be_no_e2e_latency() -> None:
    row = report.row_from_result("gateway", recorded("gateway"))
    [title, _, text] = report.shape_lines([row], output_len=1024)
    assert title == "### Beside the seed's published table"
    assert "under 0.096 ms" in text  # 98 ms / 1023 tokens
    assert "10.2 QPS from each client, 10,449 output tokens/s" in text
    assert report.shape_lines([], 1024) == []


def test_the_document_is_written_with_its_markdown_and_plot(tmp_path: Path) -> None:
    runs = [run("gateway", recorded("gateway")), run("vllm_dp", recorded("vllm_dp"))]
    out = tmp_path / "seed.json"
    report.write(document(runs), out)
    assert json.loads(out.read_text())["runs"][0]["setup"] == "gateway"
    assert out.with_suffix(".md").read_text().startswith("## The seed deployment's benchmark")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
