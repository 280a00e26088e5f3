"""The one worker-command builder: devices, ports, HCCL ports, environment and flag pass-through."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mineru_gateway.config import Platform
from mineru_gateway.entry.cli import build_parser
from mineru_gateway.workers.launcher import (
    HCCL_MAX_BASE_PORT,
    MINERU_LOGITS_PROCESSOR,
    VLLM_SERVER_MODULE,
    VllmOptions,
    WorkerCommand,
    batch_size,
    build_sim_command,
    build_vllm_command,
    cpu_binds,
    flag_name,
    flag_value,
    hccl_base_port,
    worker_command_from_args,
)

MINERU = "/models/MinerU2.5-2509-1.2B"
ASCEND = VllmOptions(model=MINERU, vllm_python="python3")
CPU = VllmOptions(model="/cache/tiny-qwen2", vllm_python="/venv/bin/python", platform="cpu")


def count_flag(argv: tuple[str, ...], name: str) -> int:
    return sum(flag_name(token) == name for token in argv)


@pytest.mark.parametrize(
    ("device", "port", "hccl"),
    [(0, 30001, 61000), (1, 30002, 61064), (2, 30003, 61128), (3, 30004, 61192), (7, 30008, 61448)],
)
def test_each_ascend_device_gets_its_device_port_and_hccl_port(
    device: int, port: int, hccl: int
) -> None:
    command = build_vllm_command(device, ASCEND)
    assert command.env["ASCEND_RT_VISIBLE_DEVICES"] == str(device)
    assert command.env["HCCL_IF_BASE_PORT"] == str(hccl)
    assert command.port == port
    assert flag_value(command.argv, "port") == str(port)
    assert command.argv[:3] == ("python3", "-m", VLLM_SERVER_MODULE)
    assert command.url() == f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("device", "index", "visible", "port", "hccl"),
    [
        (0, 0, "0", 30001, 61000),  # Kubernetes: one NPU per pod is device 0
        (0, 3, "0", 30004, 61192),  # compose: one NPU per container, slot 3 on the host
        (5, 1, "5", 30002, 61064),
    ],
)
def test_worker_index_sets_ports_apart_from_the_device(
    device: int, index: int, visible: str, port: int, hccl: int
) -> None:
    command = build_vllm_command(device, ASCEND, index=index)
    assert (command.env["ASCEND_RT_VISIBLE_DEVICES"], command.port) == (visible, port)
    assert command.env["HCCL_IF_BASE_PORT"] == str(hccl)


def test_hccl_port_ranges_of_sixteen_workers_never_overlap_even_at_32_ports_each() -> None:
    ranges = [range(hccl_base_port(i), hccl_base_port(i) + 32) for i in range(16)]
    ports = [port for each in ranges for port in each]
    assert len(ports) == len(set(ports))
    assert max(ports) < HCCL_MAX_BASE_PORT
    assert min(ports) > 60999  # above Linux's default ephemeral range and HCCL's 60000-60031


@pytest.mark.parametrize(("index", "base"), [(0, 65530), (100, 61000), (0, 80)])
def test_hccl_ports_out_of_range_are_refused(index: int, base: int) -> None:
    with pytest.raises(ValueError, match="HCCL base port"):
        hccl_base_port(index, base)


@pytest.mark.parametrize(
    ("device", "options", "message"),
    [
        (-1, ASCEND, "device must not be negative"),
        (0, VllmOptions(model="m", base_port=65535 + 1), "is not a port"),
    ],
)
def test_bad_devices_and_ports_are_refused(device: int, options: VllmOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_vllm_command(device, options)


@pytest.mark.parametrize(
    ("extra", "flag", "value", "defaults_of_flag"),
    [
        (("--max-num-seqs", "64"), "--max-num-seqs", "64", 1),
        (("--max-num-seqs=64",), "--max-num-seqs", "64", 1),
        (("--max_num_seqs", "64"), "--max_num_seqs", "64", 1),
        (("--gpu-memory-utilization", "0.85"), "--gpu-memory-utilization", "0.85", 1),
        (("--dtype", "float16"), "--dtype", "float16", 1),
        (("--trust-remote-code",), "--max-num-seqs", "256", 1),  # defaults kept
    ],
)
def test_user_flags_pass_through_and_win_over_defaults(
    extra: tuple[str, ...], flag: str, value: str, defaults_of_flag: int
) -> None:
    options = VllmOptions(model=MINERU, extra_args=extra)
    argv = build_vllm_command(0, options).argv
    assert argv[-len(extra) :] == extra  # passed through last, unchanged
    assert flag_value(argv, flag) == value
    assert count_flag(argv, flag_name(flag) or "") == defaults_of_flag


def test_every_ascend_default_flag_is_there_when_the_user_gives_none() -> None:
    argv = build_vllm_command(0, ASCEND).argv
    expected = {
        "--dtype": "bfloat16",
        "--max-num-seqs": "256",
        "--max-model-len": "32768",
        "--max-num-batched-tokens": "16384",
        "--gpu-memory-utilization": "0.9",
        "--model": MINERU,
        "--served-model-name": "MinerU2.5-2509-1.2B",
        "--host": "127.0.0.1",
        "--logits-processors": MINERU_LOGITS_PROCESSOR,
    }
    assert {flag: flag_value(argv, flag) for flag in expected} == expected


def test_a_negated_boolean_flag_replaces_its_default() -> None:
    argv = build_vllm_command(0, VllmOptions(model="m", platform="cpu")).argv
    assert "--enforce-eager" in argv
    options = VllmOptions(model="m", platform="cpu", extra_args=("--no-enforce-eager",))
    argv = build_vllm_command(0, options).argv
    assert "--enforce-eager" not in argv
    assert argv[-1] == "--no-enforce-eager"


@pytest.mark.parametrize(
    "extra",
    [
        ("--port", "9000"),
        ("--port=9000",),
        ("--host", "0.0.0.0"),
        ("--model", "other"),
        ("--served-model-name", "x"),
        ("--served_model_name=x",),
    ],
)
def test_flags_the_builder_owns_are_refused_with_the_way_to_set_them(
    extra: tuple[str, ...],
) -> None:
    with pytest.raises(ValueError, match="is set by mineru-gateway for each worker; use --"):
        build_vllm_command(0, VllmOptions(model="m", extra_args=extra))


@pytest.mark.parametrize(
    ("model", "served", "choice", "expected"),
    [
        (MINERU, None, None, True),
        ("opendatalab/MinerU2.5-2509-1.2B", None, None, True),
        ("/models/some-vlm", "mineru", None, True),
        ("/cache/tiny-qwen2", None, None, False),
        ("/root/.cache/mineru-gateway/tiny-qwen2", None, None, False),
        (MINERU, None, False, False),
        ("/cache/tiny-qwen2", None, True, True),
    ],
)
def test_mineru_logits_processor_is_added_for_mineru_models(
    model: str, served: str | None, choice: bool | None, expected: bool
) -> None:
    options = VllmOptions(model=model, served_model_name=served, mineru_logits_processor=choice)
    argv = build_vllm_command(0, options).argv
    assert (flag_value(argv, "logits-processors") == MINERU_LOGITS_PROCESSOR) is expected


def test_a_users_logits_processors_replace_minerus() -> None:
    options = VllmOptions(model=MINERU, extra_args=("--logits-processors", "my:Proc"))
    argv = build_vllm_command(0, options).argv
    assert count_flag(argv, "logits-processors") == 1
    assert flag_value(argv, "logits-processors") == "my:Proc"


@pytest.mark.parametrize(
    ("model", "served", "expected"),
    [
        ("/models/MinerU2.5-2509-1.2B/", None, "MinerU2.5-2509-1.2B"),
        ("./tiny", None, "tiny"),
        ("opendatalab/MinerU2.5-2509-1.2B", None, "opendatalab/MinerU2.5-2509-1.2B"),
        ("/models/x", "mineru", "mineru"),
    ],
)
def test_served_model_name(model: str, served: str | None, expected: str) -> None:
    options = VllmOptions(model=model, served_model_name=served)
    assert flag_value(build_vllm_command(0, options).argv, "--served-model-name") == expected


def test_recommended_environment_defers_to_the_callers_but_device_and_ports_do_not() -> None:
    environ = {"OMP_NUM_THREADS": "32", "ASCEND_RT_VISIBLE_DEVICES": "7", "HCCL_IF_BASE_PORT": "1"}
    command = build_vllm_command(1, ASCEND, environ=environ)
    assert command.env == {
        "ASCEND_RT_VISIBLE_DEVICES": "1",
        "HCCL_IF_BASE_PORT": "61064",
        "OMP_NUM_THREADS": "32",
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "TASK_QUEUE_ENABLE": "2",
        "CPU_AFFINITY_CONF": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "HF_HUB_OFFLINE": "1",  # a local model: no network
    }


def test_the_launchers_interpreter_variables_do_not_reach_vllm() -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/cann/python", "VIRTUAL_ENV": "/v", "PYTHONHOME": "/h"}
    environ = build_vllm_command(0, ASCEND).environ(base)
    assert environ["PATH"] == "/bin"
    assert environ["PYTHONPATH"] == "/cann/python"  # CANN's set_env.sh puts its packages there
    assert "VIRTUAL_ENV" not in environ
    assert "PYTHONHOME" not in environ
    assert environ["ASCEND_RT_VISIBLE_DEVICES"] == "0"


@pytest.mark.parametrize(
    ("device", "bind", "expected"), [(0, None, "0"), (1, None, "1"), (0, "2-3", "2-3")]
)
def test_cpu_workers_bind_their_own_cores_instead_of_a_device(
    device: int, bind: str | None, expected: str
) -> None:
    command = build_vllm_command(device, CPU, cpu_bind=bind)
    assert command.env == {
        "VLLM_CPU_OMP_THREADS_BIND": expected,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    argv = command.argv
    assert flag_value(argv, "dtype") == "float32"
    assert flag_value(argv, "max-model-len") == "2048"
    assert "--enforce-eager" in argv
    assert flag_value(argv, "logits-processors") is None


@pytest.mark.parametrize(
    ("count", "cpus", "expected"),
    [
        (2, [0, 1], ["0", "1"]),
        (1, [0, 1], ["0,1"]),
        (3, [1, 0], ["0", "1", "0"]),
        (2, [0, 1, 2, 3], ["0,1", "2,3"]),
        (2, [4, 5, 6], ["4", "5"]),
    ],
)
def test_cpu_binds_split_the_cores(count: int, cpus: list[int], expected: list[str]) -> None:
    assert cpu_binds(count, cpus) == expected


def test_render_is_a_shell_command_that_runs_exactly_the_command() -> None:
    options = VllmOptions(model="/m/a b", extra_args=("--chat-template", "{{ x }}'s"))
    command = build_vllm_command(2, options)
    tokens = shlex.split(command.render().replace("\\\n", ""))
    variables = [f"{name}={value}" for name, value in sorted(command.env.items())]
    assert tokens == ["env", "-u", "PYTHONHOME", "-u", "VIRTUAL_ENV", *variables, *command.argv]


def test_sim_command() -> None:
    command = build_sim_command(2, base_port=40000, extra_args=("--time-scale", "0.1"))
    assert command == WorkerCommand(
        (
            sys.executable,
            "-m",
            "mineru_gateway",
            "sim",
            "--host",
            "127.0.0.1",
            "--port",
            "40002",
            "--time-scale",
            "0.1",
        ),
        {},
        "127.0.0.1",
        40002,
    )
    assert command.url("worker-2") == "http://worker-2:40002"


def test_worker_flags_reach_the_builder() -> None:
    args = build_parser().parse_args(
        [
            "worker",
            "--device",
            "0",
            "--worker-index",
            "2",
            "--host",
            "0.0.0.0",
            "--model",
            MINERU,
            "--vllm-python",
            "python3",
            "--hccl-base-port",
            "50000",
            "--no-mineru-logits-processor",
            "--",
            "--max-num-seqs",
            "8",
        ]
    )
    command = worker_command_from_args(args)
    options = VllmOptions(
        model=MINERU,
        vllm_python="python3",
        host="0.0.0.0",
        hccl_base_port=50000,
        extra_args=("--max-num-seqs", "8"),
        mineru_logits_processor=False,
    )
    assert command == build_vllm_command(0, options, index=2)
    assert command.url() == "http://127.0.0.1:30003"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MINERU_GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "mineru_gateway", *args],
        capture_output=True,
        text=True,
        env=full_env | (env or {}),
        timeout=60,
    )


def test_dry_run_prints_the_exact_command_and_settings_come_from_the_environment() -> None:
    env = {"MINERU_GATEWAY_VLLM_PYTHON": "/opt/vllm/bin/python", "MINERU_GATEWAY_MODEL": MINERU}
    result = run_cli("worker", "--device", "3", "--dry-run", "--", "--max-num-seqs", "8", env=env)
    assert result.returncode == 0, result.stderr
    options = VllmOptions(
        model=MINERU, vllm_python="/opt/vllm/bin/python", extra_args=("--max-num-seqs", "8")
    )
    assert result.stdout == build_vllm_command(3, options).render() + "\n"


def test_flags_win_over_the_environment() -> None:
    env = {"MINERU_GATEWAY_MODEL": "/env/model", "MINERU_GATEWAY_WORKER_BASE_PORT": "40000"}
    result = run_cli("worker", "--device", "1", "--model", "/flag/model", "--dry-run", env=env)
    assert "--model /flag/model" in result.stdout
    assert "--port 40001" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--device", "0", "--dry-run"), "a model is needed"),
        (("--device", "0", "--model", "m", "--dry-run", "--", "--port", "1"), "--port is set by"),
        (("--device", "0", "--model", "m", "--vllm-python", "/nonexistent/python"), "not found"),
    ],
)
def test_worker_errors_exit_2_with_a_message(args: tuple[str, ...], message: str) -> None:
    result = run_cli("worker", *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_worker_becomes_vllm_with_its_arguments_and_environment(tmp_path: Path) -> None:
    """Without --dry-run the launcher execs vLLM's Python: same process, exact argv and env."""
    fake_python = tmp_path / "python"
    fake_python.write_text(
        '#!/bin/sh\necho "pid=$$"\nfor arg in "$@"; do echo "arg=$arg"; done\n'
        'echo "bind=$VLLM_CPU_OMP_THREADS_BIND venv=${VIRTUAL_ENV-unset}"\nexit 7\n'
    )
    fake_python.chmod(fake_python.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = [sys.executable, "-m", "mineru_gateway", "worker", "--device", "1", "--platform"]
    argv += ["cpu", "--model", str(model), "--vllm-python", str(fake_python), "--", "--seed", "3"]
    env = dict(os.environ, VIRTUAL_ENV="/somewhere")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7  # vLLM's exit status is the launcher's
    lines = out.splitlines()
    assert lines[0] == f"pid={proc.pid}"  # exec: vLLM is the launched process itself
    args = tuple(line.removeprefix("arg=") for line in lines if line.startswith("arg="))
    expected = build_vllm_command(
        1, VllmOptions(str(model), str(fake_python), "cpu", extra_args=("--seed", "3"))
    )
    assert (str(fake_python), *args) == expected.argv
    assert lines[-1] == "bind=1 venv=unset"


@pytest.mark.parametrize(
    ("model", "source", "env"),
    [
        (MINERU, None, {"HF_HUB_OFFLINE": "1"}),  # a path: local, offline
        ("opendatalab/MinerU2.5-2509-1.2B", None, {"HF_HUB_OFFLINE": "0"}),  # an id: the hub
        (MINERU, "huggingface", {"HF_HUB_OFFLINE": "0"}),
        ("OpenDataLab/MinerU2.5-2509-1.2B", "modelscope", {"VLLM_USE_MODELSCOPE": "True"}),
    ],
)
def test_the_model_source_sets_where_vllm_takes_the_weights_from(
    model: str, source: str | None, env: dict[str, str]
) -> None:
    environ = {"HF_HUB_OFFLINE": "1"}  # as an image or a compose file might set it
    options = VllmOptions(model, "python3", model_source=source)  # type: ignore[arg-type]
    command = build_vllm_command(0, options, environ=environ)
    assert env.items() <= command.env.items()
    assert flag_value(command.argv, "model") == model


@pytest.mark.parametrize("variable", ["MINERU_MODEL_SOURCE", "MINERU_GATEWAY_MODEL_SOURCE"])
def test_the_model_source_is_read_from_minerus_variable_too(variable: str) -> None:
    env = {variable: "modelscope", "MINERU_GATEWAY_MODEL": "OpenDataLab/MinerU2.5-2509-1.2B"}
    result = run_cli("worker", "--device", "0", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert "VLLM_USE_MODELSCOPE=True" in result.stdout


def test_a_local_model_that_is_not_there_is_refused_at_once_naming_the_path(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "MinerU2.5-2509-1.2B"
    result = run_cli("worker", "--device", "0", "--model", str(missing))
    assert result.returncode == 2
    assert result.stderr == (
        f"mineru-gateway worker: model directory {missing} does not exist (model source local)\n"
    )
    missing.mkdir()  # a directory, but no model in it
    result = run_cli("worker", "--device", "0", "--model", str(missing))
    assert result.returncode == 2
    assert f"model directory {missing} has no config.json" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (["--max-num-seqs", "64"], "64"),
        (["--max-num-seqs=32", "--dtype", "float16"], "32"),
        (["--max-num-seqs", "8", "--max_num_seqs", "16"], "16"),  # the last one wins
        (["--dtype", "float16"], None),
        (["--max-num-seqs"], None),
    ],
)
def test_flag_value(args: list[str], value: str | None) -> None:
    assert flag_value(args, "max-num-seqs") == value


@pytest.mark.parametrize(
    ("platform", "extra", "batch"),
    [("ascend", (), 256), ("cpu", (), 16), ("ascend", ("--max-num-seqs", "64"), 64)],
)
def test_the_batch_size_workers_start_with(
    platform: Platform, extra: tuple[str, ...], batch: int
) -> None:
    assert batch_size(VllmOptions(model="/m", platform=platform, extra_args=extra)) == batch
