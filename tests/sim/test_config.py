import argparse
import dataclasses

import pytest

from mineru_gateway.sim import SimConfig, add_sim_arguments, sim_config_from_args

pytestmark = pytest.mark.unit


def parse(*argv: str) -> SimConfig:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return sim_config_from_args(parser.parse_args(argv))


def test_no_flags_keep_the_defaults() -> None:
    assert parse() == SimConfig()


def test_flags_fill_the_config() -> None:
    config = parse(
        "--model-name",
        "m",
        "--max-num-seqs",
        "8",
        "--time-scale",
        "10",
        "--speed",
        "0.5",
        "--seed",
        "3",
        "--scheduling-policy",
        "priority",
        "--enable-server-load-tracking",
    )
    expected = SimConfig(
        model_name="m",
        max_num_seqs=8,
        time_scale=10.0,
        speed=0.5,
        seed=3,
        scheduling_policy="priority",
        enable_server_load_tracking=True,
    )
    assert config == expected


def test_every_field_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    destinations = {action.dest for action in parser._actions}
    assert {field.name for field in dataclasses.fields(SimConfig)} <= destinations


def test_defaults_describe_a_910b_serving_mineru() -> None:
    config = SimConfig()
    assert config.model_name == "opendatalab/MinerU2.5-2509-1.2B"
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (128, 16384)
    assert config.kv_cache_blocks * config.block_size == config.kv_cache_tokens
    assert (config.time_scale, config.speed) == (1.0, 1.0)


@pytest.mark.parametrize(
    "changes",
    [
        {"time_scale": 0},
        {"speed": -1.0},
        {"max_num_seqs": 0},
        {"step_base_s": -0.1},
        {"kv_cache_tokens": 100, "max_model_len": 2048},
        {"kv_cache_tokens": 1000, "max_model_len": 1000, "block_size": 128},
        {"scheduling_policy": "lifo"},
    ],
)
def test_invalid_configs_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**changes)  # type: ignore[arg-type]
