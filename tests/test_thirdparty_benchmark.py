"""The third-party benchmark's pure parts (`benchmarks/thirdparty/`): guidellm's command line,
the summary read from guidellm's recorded JSON result (`tests/fixtures/thirdparty/`), and the
results document's Markdown."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from benchmarks import thirdparty
from benchmarks.thirdparty import Workload, guidellm_argv, problems, summarize
from benchmarks.thirdparty.__main__ import TOOL_ENV, parse_args, tool_command

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "thirdparty" / "guidellm-0.8.1.json"
WORKLOAD = Workload(
    model="tiny",
    tokenizer="/models/tiny-qwen2",
    prompt_tokens=256,
    output_tokens=128,
    rates=(2.0, 4.0, 8.0),
    seconds=20.0,
    warmup_s=5.0,
)


def recorded() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(FIXTURE.read_text())
    return result


def option(argv: list[str], name: str) -> list[str]:
    """Every value given to a repeatable option."""
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


def kv(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split(","))


# -- guidellm's command line --------------------------------------------------------------------


def test_guidellm_targets_the_gateway_with_its_ordinary_openai_backend(tmp_path: Path) -> None:
    argv = guidellm_argv("/venv/bin/guidellm", "http://127.0.0.1:9", WORKLOAD, tmp_path / "r.json")
    assert argv[:2] == ["/venv/bin/guidellm", "run"]
    backend = kv(option(argv, "--backend")[0])
    assert backend == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:9",
        "model": "tiny",
        "request_format": "/v1/chat/completions",
    }  # no `stream=`: streaming is guidellm's default
    assert kv(option(argv, "--tokenizer")[0]) == {
        "kind": "huggingface_auto",
        "model": "/models/tiny-qwen2",
    }
    data = kv(option(argv, "--data")[0])
    assert data == {"kind": "synthetic_text", "prompt_tokens": "256", "output_tokens": "128"}


def test_each_rate_is_one_constant_rate_benchmark_of_the_given_length(tmp_path: Path) -> None:
    argv = guidellm_argv("guidellm", "http://h", WORKLOAD, tmp_path / "r.json")
    assert kv(option(argv, "--profile")[0]) == {"kind": "constant", "warmup": "5"}
    index = argv.index("--override")
    assert argv[index + 1 : index + 3] == ["profile.rate", "2,4,8"]
    assert option(argv, "--constraint") == ["kind=max_duration,seconds=20"]
    assert option(argv, "--seed") == ["kind=static,value=42"]


def test_guidellm_writes_its_json_result_where_asked_and_prints_its_tables(tmp_path: Path) -> None:
    argv = guidellm_argv("guidellm", "http://h", WORKLOAD, tmp_path / "r.json")
    assert option(argv, "--output") == [f"kind=json,path={tmp_path / 'r.json'}", "kind=console"]
    assert argv[-1] == "--disable-progress"


def test_the_recorded_command_carries_guidellms_environment() -> None:
    command = tool_command(["guidellm", "run", "--profile", "kind=constant,warmup=5"])
    assert command == (
        "HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GUIDELLM__MAX_WORKER_PROCESSES=2 "
        "guidellm run --profile kind=constant,warmup=5"
    )
    # Our interpreter's variables are blanked for guidellm's (empty means unset to Python).
    assert {TOOL_ENV[name] for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")} == {""}


def test_the_defaults_are_a_sweep_of_about_a_minute_over_two_fast_workers() -> None:
    args = parse_args([])
    assert (args.rates, args.seconds, args.warmup) == ([2.0, 4.0, 8.0], 20.0, 5.0)
    assert (args.workers, args.time_scale) == (2, 0.1)
    assert (args.prompt_tokens, args.output_tokens) == (256, 128)
    assert args.out.name == "thirdparty.json"
    assert parse_args(["--rates", "1,3"]).rates == [1.0, 3.0]


# -- guidellm's result -> the summary ----------------------------------------------------------


def test_the_summary_holds_guidellms_own_numbers() -> None:
    (row,) = summarize(recorded())
    assert row["strategy"] == "constant"
    assert row["rate"] == 8.0
    assert (row["completed"], row["errored"], row["incomplete"]) == (121, 0, 1)
    assert row["requests_per_s"] == pytest.approx(8.0, abs=0.01)
    assert row["output_tokens_per_s"] == pytest.approx(1017.0)
    assert (row["prompt_tokens_median"], row["output_tokens_median"]) == (104, 128)
    assert row["ttft_ms"] == {"mean": 5.251, "p50": 4.538, "p90": 7.447, "p99": 15.359}
    assert row["itl_ms"]["p50"] == pytest.approx(1.051)
    assert row["tpot_ms"]["p99"] == pytest.approx(1.22)
    assert row["warnings"][0].startswith("mean generation delay was 21%")


def test_one_row_per_benchmark_in_guidellms_order() -> None:
    result = recorded()
    slower = copy.deepcopy(result["benchmarks"][0])
    slower["config"]["strategy"]["rate"] = 2.0
    result["benchmarks"].insert(0, slower)
    assert [row["rate"] for row in summarize(result)] == [2.0, 8.0]
    assert thirdparty.tool_version(result) == "0.8.1"


def test_a_clean_run_has_no_problems_even_with_requests_cut_at_the_end() -> None:
    rows = summarize(recorded())
    assert rows[0]["incomplete"] == 1
    assert problems(rows, output_tokens=128) == []


@pytest.mark.parametrize(
    ("change", "output_tokens", "expected"),
    [
        ({"errored": 3}, 128, ["rate 8: 3 errored"]),
        ({}, 64, ["rate 8: median answer 128.0 tokens"]),
        ({"completed": 0}, 128, ["rate 8: no request completed"]),
    ],
)
def test_errors_short_answers_and_empty_rates_are_problems(
    change: dict[str, int], output_tokens: int, expected: list[str]
) -> None:
    rows = [summarize(recorded())[0] | change]
    assert problems(rows, output_tokens) == expected


# -- the document -------------------------------------------------------------------------------


def document() -> dict[str, Any]:
    rows = summarize(recorded())
    return {
        "command": "python -m benchmarks.thirdparty",
        "git_commit": "abc",
        "when": "2026-12-02T18:45:54Z",
        "wall_time_s": 91.0,
        "tool": {"name": "guidellm", "version": "0.8.1", "command": "guidellm run ..."},
        "settings": {"workers": 2, "time_scale": 0.1, "model": "tiny", "seconds": 20.0},
        "summary": rows,
        "cpu": {"gateway": 0.05, "workers": 0.09, "foreign_cores": 1.67, "machine_util": 0.91},
        "problems": problems(rows, 128),
        "notes": thirdparty.notes(rows, WORKLOAD),
    }


def test_the_markdown_has_the_command_the_table_and_guidellms_warnings() -> None:
    text = thirdparty.markdown(document())
    assert text.startswith("# guidellm 0.8.1 against the gateway\n")
    assert "```sh\nguidellm run ...\n```" in text
    assert "| 8 | 121 / 0 / 1 | 8.00 | 1017 | 4.5 / 15.4 | 1.1 / 1.2 | 1.1 | 104 / 128 |" in text
    assert "a median of 104 prompt tokens" in text
    assert "- guidellm warned at rate 8: mean generation delay was 21%" in text
    assert "gateway 0.05, workers 0.09, guidellm and everything else 1.67; machine 91%" in text
    assert text.rstrip().endswith("Problems: none: no errored request.")


def test_write_puts_the_markdown_beside_the_json(tmp_path: Path) -> None:
    out = tmp_path / "results" / "thirdparty.json"
    thirdparty.write(document(), out)
    assert json.loads(out.read_text())["summary"][0]["completed"] == 121
    assert out.with_suffix(".md").read_text() == thirdparty.markdown(document())
