"""Reading a worker's load from vLLM's /metrics text."""

from __future__ import annotations

import pytest

from mineru_gateway.vllm_contract import VllmLoad, parse_vllm_load
from tests.conftest import FIXTURES

pytestmark = pytest.mark.unit


def test_reads_the_recorded_vllm_exposition() -> None:
    text = (FIXTURES / "vllm" / "metrics.txt").read_bytes()
    load = parse_vllm_load(text)
    assert load is not None
    assert (load.waiting, load.running, load.kv_usage) == (0.0, 0.0, 0.0)
    assert load.itl_count > 0
    assert load.itl_sum > 0


def test_sums_engines_and_takes_the_fullest_cache() -> None:
    text = b"""# HELP vllm:num_requests_waiting x
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running_other 99
vllm:time_per_output_token_seconds_sum{engine="0"} 1.5
vllm:time_per_output_token_seconds_count{engine="0"} 30
"""
    assert parse_vllm_load(text) == VllmLoad(5.0, 7.0, 0.75, 1.5, 30.0)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"not metrics at all",
        b"vllm:num_requests_waiting 1\n",
        b"vllm:num_requests_running x\n",
    ],
)
def test_anything_else_is_no_reading(text: bytes) -> None:
    assert parse_vllm_load(text) is None


@pytest.mark.parametrize(
    "text",
    [
        b"vllm:num_requests_waiting 1\nvllm:num_requests_running 2",  # first line, no last newline
        b'# TYPE x gauge\nvllm:num_requests_running{a="b c"} 2\nvllm:num_requests_waiting 1\n',
    ],
)
def test_samples_anywhere_in_the_text_are_read(text: bytes) -> None:
    assert parse_vllm_load(text) == VllmLoad(1.0, 2.0, 0.0, 0.0, 0.0)
