"""docker-compose.yml and the images: the committed file is what `mineru-gateway compose` writes,
valid for Compose, and every worker runs the one builder's command with its own NPU, port and
HCCL ports, which the gateway, the NPU exporter and Prometheus all list (issues 4 and 15). No
Docker engine is needed."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry.cli import build_parser, main, settings_from_args
from mineru_gateway.entry.compose import (
    ATLAS_800T_A2_NPUS,
    METRICS_PORT,
    TARGETS_FILE,
    TUNING_DEFAULTS,
    VLLM_ASCEND_IMAGE,
    format_npus,
    parse_npus,
    render_compose,
    rendered_files,
)
from mineru_gateway.workers.launcher import WorkerCommand
from tests.deploy.support import PROMETHEUS_YML, ROOT
from tests.deploy.worker_image import DOCKER_DIR, command_in, image_env, use_worker_image_env

COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
NPUS = ATLAS_800T_A2_NPUS
NPU_CONTROL_DEVICES = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
PASSWORD = {"GRAFANA_ADMIN_PASSWORD": "not-admin"}
_VARIABLE = re.compile(r"\$\{(\w+)")
_SETTING = re.compile(r"^(\w+)=(.*)$", re.M)


def compose_config(path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`docker-compose -f PATH [ARGS] config` with only `env` (and PATH, HOME) set."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed: run `make system-deps` (Debian's docker-compose)"
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")}
    return subprocess.run(
        [tool, "-f", str(path), *args, "config"],
        capture_output=True,
        text=True,
        cwd=path.parent,
        env=base | env,
        timeout=120,
    )


def parsed(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


@pytest.fixture
def worker_image_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return use_worker_image_env(monkeypatch)


def run_in_container(
    service: dict[str, Any], image: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> WorkerCommand:
    """What a worker service runs: the image's environment, then the service's on top."""
    environ = image | service["environment"]
    for name, value in environ.items():
        if name.startswith("MINERU_GATEWAY_"):  # the launcher's own settings come from here
            monkeypatch.setenv(name, value)
    return command_in(service["command"], environ)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """`docker-compose config`: the file as Compose itself reads it, defaults interpolated."""
    return parsed(compose_config(COMPOSE_FILE, PASSWORD))


def test_the_committed_files_are_what_the_generator_writes_for_a_whole_atlas_800t_a2() -> None:
    for path, text in rendered_files(NPUS).items():
        assert (ROOT / path).read_text() == text, f"{path}: run `mineru-gateway compose`"
    assert main(["compose", "--check", "--dir", str(ROOT)]) == 0


def test_compose_has_a_worker_per_npu_and_the_supporting_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    workers = [f"worker-{npu}" for npu in NPUS]
    assert set(services) == {*workers, "gateway", "npu-exporter", "prometheus", "grafana"}
    for name in workers:
        build = services[name]["build"]
        assert build["dockerfile"] == "deploy/docker/Dockerfile.worker"
        assert build["args"]["VLLM_ASCEND_IMAGE"] == VLLM_ASCEND_IMAGE
        assert services[name]["init"] is True
        assert services[name]["shm_size"]
        mounts = {volume.split(":")[1] for volume in services[name]["volumes"]}
        assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/models"} <= mounts
        assert {"/host/usr/local/bin", "/host/usr/local/sbin"} <= mounts  # npu-smi


@pytest.mark.parametrize("npu", NPUS)
def test_each_worker_runs_the_launcher_on_its_own_npu_port_and_hccl_ports(
    compose: dict[str, Any],
    worker_image_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    npu: int,
) -> None:
    service = compose["services"][f"worker-{npu}"]
    command = run_in_container(service, worker_image_env, monkeypatch)
    assert command.argv[0] == "python3"  # the image's Python, where vLLM-Ascend is
    # One NPU per container, seen as device 0; the worker index keeps ports apart.
    assert set(service["devices"]) == {f"/dev/davinci{npu}", *NPU_CONTROL_DEVICES}
    assert command.env["ASCEND_RT_VISIBLE_DEVICES"] == "0"
    assert command.port == 30001 + npu
    assert command.env["HCCL_IF_BASE_PORT"] == str(61000 + 64 * npu)
    assert command.host == "0.0.0.0"
    assert "--logits-processors" in command.argv  # MinerU's model
    environ = command.environ(worker_image_env | service["environment"])
    for name, value in TUNING_DEFAULTS:  # vLLM-Ascend's tuning reaches vLLM
        assert environ[name] == value
    health = " ".join(service["healthcheck"]["test"])
    assert f"http://127.0.0.1:{command.port}/health" in health
    gateway_workers = compose["services"]["gateway"]["environment"]["MINERU_GATEWAY_WORKERS"]
    assert gateway_workers.split(",")[npu] == command.url(f"worker-{npu}")


def test_the_gateway_and_prometheus_list_every_worker(
    compose: dict[str, Any], worker_image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    urls = [
        command_in(services[f"worker-{npu}"]["command"], worker_image_env).url(f"worker-{npu}")
        for npu in NPUS
    ]
    gateway = services["gateway"]
    assert gateway["environment"]["MINERU_GATEWAY_WORKERS"] == ",".join(urls)
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings()  # the environment is valid settings: empty keys included
    assert settings.workers == urls and settings.npu_smi == "off" and not settings.client_keys
    args = build_parser().parse_args(gateway["command"][1:])  # flags the CLI accepts
    assert "--port=30000" in gateway["command"]
    # Without keys (the example's empty API_KEYS) the gateway refuses to serve on 0.0.0.0.
    assert settings_from_args(args).open_access_refusal() is not None
    # /metrics on its own listener, not published on the host, where Prometheus scrapes it.
    assert settings.metrics_port == METRICS_PORT
    assert all(str(METRICS_PORT) not in port for port in gateway["ports"])
    [targets] = yaml.safe_load((PROMETHEUS_YML.parent / "targets/workers.yml").read_text())
    assert ["http://" + target for target in targets["targets"]] == urls
    scraped = yaml.safe_load(PROMETHEUS_YML.read_text())["scrape_configs"]
    vllm = next(job for job in scraped if job["job_name"] == "vllm")
    assert vllm["file_sd_configs"] == [
        {"files": [str(TARGETS_FILE.relative_to("deploy/prometheus"))]}
    ]
    assert f"gateway:{METRICS_PORT}" in PROMETHEUS_YML.read_text()
    assert "npu-exporter:8083" in PROMETHEUS_YML.read_text()


def test_npu_exporter_reads_every_npu_for_its_worker(compose: dict[str, Any]) -> None:
    exporter = compose["services"]["npu-exporter"]
    args = build_parser().parse_args(exporter["command"][1:])
    assert args.command == "npu-exporter" and args.port == 8083 and args.host == "0.0.0.0"
    assert args.npu_smi is None and args.npu_exporter_names is True  # npu-smi found on PATH
    mounts = {volume.split(":")[1] for volume in exporter["volumes"]}
    assert {"/host/usr/local/bin", "/host/usr/local/sbin", "/usr/local/Ascend/driver"} <= mounts
    assert "/host/usr/local/bin" in image_env(DOCKER_DIR / "Dockerfile.gateway")["PATH"]
    assert set(exporter["devices"]) == {f"/dev/davinci{npu}" for npu in NPUS} | NPU_CONTROL_DEVICES
    assert args.devices == ",".join(f"{npu}=http://worker-{npu}:{30001 + npu}" for npu in NPUS)


def test_prometheus_and_grafana_listen_on_localhost_unless_told(
    compose: dict[str, Any], worker_image_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = compose["services"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090/tcp"]
    assert services["grafana"]["ports"] == ["127.0.0.1:3000:3000/tcp"]
    assert services["gateway"]["ports"] == ["0.0.0.0:30000:30000/tcp"]
    env = {**PASSWORD, "PROMETHEUS_BIND": "0.0.0.0", "GRAFANA_PORT": "3300"}
    env |= {"HCCL_BASE_PORT": "62000", "TASK_QUEUE_ENABLE": "1"}
    told = parsed(compose_config(COMPOSE_FILE, env))["services"]
    assert told["prometheus"]["ports"] == ["0.0.0.0:9090:9090/tcp"]
    assert told["grafana"]["ports"] == ["127.0.0.1:3300:3000/tcp"]
    # .env reaches the workers: another HCCL range, less aggressive task queueing.
    command = run_in_container(told["worker-3"], worker_image_env, monkeypatch)
    assert command.env["HCCL_IF_BASE_PORT"] == str(62000 + 64 * 3)
    assert command.env["TASK_QUEUE_ENABLE"] == "1"


def test_grafana_has_no_default_password() -> None:
    result = compose_config(COMPOSE_FILE, {})
    assert result.returncode != 0
    assert "set GRAFANA_ADMIN_PASSWORD in .env" in result.stderr


def test_env_example_lists_every_variable_with_its_default(compose: dict[str, Any]) -> None:
    settings = dict(_SETTING.findall(ENV_EXAMPLE.read_text()))
    used = set(_VARIABLE.findall(COMPOSE_FILE.read_text()))
    assert used == set(settings) - {"NPUS"}  # NPUS is read by `mineru-gateway compose`
    assert settings["NPUS"] == "0-7"
    # With the example's values and a password, Compose reads exactly the defaults.
    example = compose_config(COMPOSE_FILE, PASSWORD, "--env-file", str(ENV_EXAMPLE))
    assert parsed(example) == compose


def test_make_env_writes_a_dot_env_with_generated_keys_that_the_gateway_serves_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copy(ENV_EXAMPLE, tmp_path / ".env.example")
    shutil.copy(COMPOSE_FILE, tmp_path / "docker-compose.yml")
    make_env = [sys.executable, str(ROOT / "scripts" / "make-env.py"), "--dir", str(tmp_path)]
    result = subprocess.run(make_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    written = dict(_SETTING.findall((tmp_path / ".env").read_text()))
    assert (tmp_path / ".env").stat().st_mode & 0o777 == 0o600
    assert result.stdout.endswith(f"client API key {written['API_KEYS']}\n")
    generated = ("API_KEYS", "ADMIN_KEYS", "GRAFANA_ADMIN_PASSWORD")
    secrets = [written.pop(name) for name in generated]
    assert all(len(secret) >= 24 for secret in secrets) and len(set(secrets)) == 3
    example = dict(_SETTING.findall(ENV_EXAMPLE.read_text()))
    assert written == {k: v for k, v in example.items() if k not in generated}  # the rest as is
    written |= dict(zip(generated, secrets, strict=True))
    gateway = parsed(compose_config(tmp_path / "docker-compose.yml", {}))["services"]["gateway"]
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(gateway["command"][1:])
    settings = settings_from_args(args)
    assert settings.client_keys == (written["API_KEYS"],)
    assert settings.open_access_refusal() is None  # serves, with its key
    again = subprocess.run(make_env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "--force" in again.stderr  # never replaces keys silently
    assert dict(_SETTING.findall((tmp_path / ".env").read_text())) == written


def test_the_npu_list_in_env_picks_the_workers(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("GRAFANA_ADMIN_PASSWORD=x\nNPUS=4-5,7 # the free ones\n")
    assert main(["compose", "--dir", str(tmp_path)]) == 0
    config = parsed(compose_config(tmp_path / "docker-compose.yml", {}))
    workers = sorted(name for name in config["services"] if name.startswith("worker-"))
    assert workers == ["worker-4", "worker-5", "worker-7"]
    gateway = config["services"]["gateway"]["environment"]["MINERU_GATEWAY_WORKERS"]
    assert gateway == "http://worker-4:30005,http://worker-5:30006,http://worker-7:30008"
    targets = yaml.safe_load((tmp_path / TARGETS_FILE).read_text())[0]["targets"]
    assert targets == ["worker-4:30005", "worker-5:30006", "worker-7:30008"]
    assert main(["compose", "--check", "--dir", str(tmp_path)]) == 0
    assert main(["compose", "--check", "--npus", "0-3", "--dir", str(tmp_path)]) == 1


@pytest.mark.parametrize(
    ("text", "npus", "short"),
    [("0-7", tuple(range(8)), "0-7"), (" 5, 0-1 ,3", (0, 1, 3, 5), "0-1,3,5"), ("2", (2,), "2")],
)
def test_npu_lists(text: str, npus: tuple[int, ...], short: str) -> None:
    assert parse_npus(text) == npus
    assert format_npus(npus) == short and parse_npus(short) == npus


@pytest.mark.parametrize(
    ("text", "error"),
    [("", "no NPUs"), ("3-1", "empty NPU range"), ("0-3,2", "listed twice"), ("a", "not an NPU")],
)
def test_npu_lists_that_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_npus(text)
    assert main(["compose", "--check", "--npus", text or ",", "--dir", "/nonexistent"]) == 2


def test_four_npus_are_one_flag_away() -> None:
    text = render_compose((0, 1, 2, 3))
    assert text.count("<<: *worker") == 4 and "worker-4" not in text
    assert "--devices=0=http://worker-0:30001,1=http://worker-1:30002,2=" in text


def test_the_images_defaults_agree_with_the_compose_file(compose: dict[str, Any]) -> None:
    dockerfile = (DOCKER_DIR / "Dockerfile.worker").read_text()
    assert f"ARG VLLM_ASCEND_IMAGE={VLLM_ASCEND_IMAGE}\n" in dockerfile
    env = image_env(DOCKER_DIR / "Dockerfile.worker")
    assert [(name, env[name]) for name, _ in TUNING_DEFAULTS] == list(TUNING_DEFAULTS)
    assert 'ARG MINERU_VL_UTILS="mineru-vl-utils>=2.0.5,<3"' in dockerfile  # test_worker_image.py
    for name in ("Dockerfile.worker", "Dockerfile.gateway"):
        text = (DOCKER_DIR / name).read_text()
        assert "ARG PIP_INDEX_URL=" in text
        lines = text.replace("\\\n", " ").splitlines()
        installs = [line for line in lines if "pip install" in line and not line.startswith("#")]
        assert installs and all('--index-url "${PIP_INDEX_URL}"' in line for line in installs)


def test_prometheus_and_grafana_mount_the_repositorys_configuration(
    compose: dict[str, Any],
) -> None:
    prometheus = compose["services"]["prometheus"]
    assert f"{ROOT}/deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    grafana = compose["services"]["grafana"]
    provider = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/dashboards/provider.yml").read_text()
    )
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"{ROOT}/deploy/grafana/dashboards:{dashboards_path}:ro" in grafana["volumes"]
    assert f"{ROOT}/deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile.worker", "Dockerfile.gateway"])
def test_dockerfiles_copy_only_files_that_exist(dockerfile: str) -> None:
    text = (DOCKER_DIR / dockerfile).read_text()
    sources = [
        source
        for line in text.splitlines()
        if line.startswith("COPY ") and not line.startswith("COPY --from=")  # another stage's
        for source in line.split()[1:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".env" in ignored  # secrets stay out of the build context
    assert not any(
        re.fullmatch(pattern.replace("*", ".*"), s) for pattern in ignored for s in sources
    )


def test_worker_entrypoint_runs_its_command_in_the_same_process(tmp_path: Path) -> None:
    entrypoint = DOCKER_DIR / "worker-entrypoint.sh"
    assert os.access(entrypoint, os.X_OK)
    proc = subprocess.Popen(
        [str(entrypoint), "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.strip() == str(proc.pid)  # exec all the way: vLLM will get the signals


# ---------------------------------------------------------------------------------------------
# Operator commands as the docs give them: in the gateway's container, never on the host

COMPOSE_DOCS = (
    ROOT / "docs" / "deploy" / "compose.md",
    ROOT / "docs" / "operate" / "rolling-restarts.md",
)
_FENCED = re.compile(r"```sh\n(.*?)```", re.S)
_VALUED = {"-v", "--volume", "-e", "--env", "-u", "--user", "-w", "--workdir", "--entrypoint"}


def documented_compose_commands(verb: str) -> list[list[str]]:
    """Every `docker compose VERB ...` of the Compose docs' shell blocks, split as sh splits it
    (continuations joined, comments dropped)."""
    found = []
    for path in COMPOSE_DOCS:
        for block in _FENCED.findall(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith(f"docker compose {verb} "):
                    found.append(shlex.split(line, comments=True))
    return found


def split_compose_command(argv: list[str]) -> tuple[list[tuple[str, str]], str, list[str]]:
    """`docker compose VERB [options] SERVICE COMMAND...` -> (options, service, command)."""
    options, rest = [], argv[3:]
    while rest[0].startswith("-"):
        option = rest.pop(0)
        options.append((option, rest.pop(0) if option in _VALUED else ""))
    return options, rest[0], rest[1:]


def compose_v1_options(verb: str) -> str:
    """`docker-compose VERB --help`: Compose v1 takes fewer options than v2, so what it knows
    works with both."""
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is not installed: run `make system-deps`"
    return subprocess.run(
        [tool, verb, "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout


@pytest.mark.parametrize("verb", ["run", "exec"])
def test_documented_commands_run_mineru_gateway_in_the_gateway_service(
    compose: dict[str, Any], verb: str
) -> None:
    commands = documented_compose_commands(verb)
    assert any(command[4:] and "mineru-gateway" in command for command in commands)
    known = compose_v1_options(verb)
    for argv in commands:
        options, service, command = split_compose_command(argv)
        for option, _ in options:
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", known), option
        if command[:1] != ["mineru-gateway"]:
            continue
        assert service == "gateway"
        assert compose["services"][service]["build"]["dockerfile"] == (
            "deploy/docker/Dockerfile.gateway"
        )
        build_parser().parse_args(command[1:])  # the image's own command takes these words


def test_the_documented_compose_run_rewrites_the_mounted_checkout(tmp_path: Path) -> None:
    [argv] = [c for c in documented_compose_commands("run") if "compose" in c[5:]]
    options, _, command = split_compose_command(argv)
    assert ("--rm", "") in options and ("--no-deps", "") in options  # no worker starts
    assert ("--user", "$(id -u):$(id -g)") in options  # files stay the host user's
    [volume] = [value for option, value in options if option == "-v"]
    source, target = volume.split(":")
    assert source == "$PWD"
    args = build_parser().parse_args(command[1:])
    assert (args.command, args.dir) == ("compose", Path(target))
    # The checkout as the container sees it at `target`: here, tmp_path.
    (tmp_path / ".env").write_text("NPUS=0-3\n")
    assert main([*command[1:-1], str(tmp_path)]) == 0
    for path, text in rendered_files((0, 1, 2, 3)).items():
        assert (tmp_path / path).read_text() == text


def test_the_documented_keys_are_the_first_of_dot_env(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("API_KEYS=sk-a,sk-b\nADMIN_KEYS=sk-admin-1,sk-admin-2\n")
    lines = {
        line.split("=", 1)[0]: line.split("#")[0].strip()
        for path in COMPOSE_DOCS
        for block in _FENCED.findall(path.read_text())
        for line in block.splitlines()
        if re.match(r"(ADMIN_)?KEY=\$\(sed ", line)
    }
    assert set(lines) == {"KEY", "ADMIN_KEY"}
    script = "\n".join([*lines.values(), 'echo "$KEY $ADMIN_KEY"'])
    printed = subprocess.run(
        ["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=30, check=True
    )
    assert printed.stdout.split() == ["sk-a", "sk-admin-1"]
