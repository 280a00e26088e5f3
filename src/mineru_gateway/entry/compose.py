"""`mineru-gateway compose`: the Docker Compose deployment of one NPU host, from its NPU list.

Four things on an Atlas 800T A2 must agree: the worker services (one per NPU), the gateway's
MINERU_GATEWAY_WORKERS, the NPU exporter's devices and worker map, and Prometheus' worker targets.
All four are written here from one setting, the NPU list (`--npus`, else NPUS in the .env file
beside the output, else the whole box: 0-7), into docker-compose.yml and
deploy/prometheus/targets/workers.yml. The 8-NPU output is committed, and
tests/deploy/test_compose.py checks that it is what this module writes.

Worker N gets /dev/davinciN as its only NPU (device 0 inside its container) and
`--worker-index=N`, so its port is 30001+N and its HCCL ports start at 61000+64N: distinct on one
host even with host networking (docs/vllm-ascend.md). Everything else (model, ports, keys, image
versions, tuning) is a variable of the generated file, set in .env (.env.example lists them).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mineru_gateway import __version__
from mineru_gateway.config import DEFAULT_HCCL_BASE_PORT, DEFAULT_PORT, DEFAULT_WORKER_BASE_PORT

ATLAS_800T_A2_NPUS = tuple(range(8))  # /dev/davinci0..7 (docs/vllm-ascend.md)
COMPOSE_FILE = Path("docker-compose.yml")
TARGETS_FILE = Path("deploy/prometheus/targets/workers.yml")
ENV_FILE = Path(".env")
EXPORTER_PORT = 8083
# The gateway's /metrics listener (config.py's metrics_port): on the compose network only, where
# Prometheus scrapes it (deploy/prometheus/prometheus.yml names it); tenants on the client port
# cannot read it.
METRICS_PORT = 9464
# The base image MinerU's own NPU Dockerfile uses; what it carries: docs/vllm-ascend.md.
VLLM_ASCEND_IMAGE = "quay.io/ascend/vllm-ascend:v0.23.0"
# docs/vllm-ascend.md: vLLM-Ascend's tuning guide. The worker image sets the same defaults.
TUNING_DEFAULTS = (("TASK_QUEUE_ENABLE", "2"), ("CPU_AFFINITY_CONF", "1"))
NPU_CONTROL_DEVICES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
# npu-smi's libraries in the driver the exporter mounts from the host.
DRIVER_LIBRARY_PATH = ":".join(
    f"/usr/local/Ascend/driver/{part}" for part in ("lib64", "lib64/common", "lib64/driver")
)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_ENV_NPUS = re.compile(r"^\s*NPUS\s*=\s*['\"]?([^'\"#]*)['\"]?\s*(?:#.*)?$", re.M)


def parse_npus(text: str) -> tuple[int, ...]:
    """`0-7` or `0,1,4-5` -> the NPU numbers, sorted; an empty list or a repeat is an error."""
    found: list[int] = []
    for part in filter(None, (part.strip() for part in text.split(","))):
        match = _RANGE.match(part)
        if match is None:
            raise ValueError(f"not an NPU number or range: {part!r}")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high < low:
            raise ValueError(f"empty NPU range: {part!r}")
        found += range(low, high + 1)
    if not found:
        raise ValueError("no NPUs given")
    if len(set(found)) != len(found):
        raise ValueError(f"an NPU is listed twice: {text!r}")
    return tuple(sorted(found))


def format_npus(npus: Sequence[int]) -> str:
    """The shortest list `parse_npus` reads back: (0, 1, 2, 5) -> `0-2,5`."""
    runs: list[list[int]] = []
    for npu in npus:
        if runs and npu == runs[-1][-1] + 1:
            runs[-1].append(npu)
        else:
            runs.append([npu])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def npus_from_env_file(path: Path) -> str | None:
    """NPUS from a Compose .env file, if it has one: the file the user edits for the rest."""
    if not path.is_file():
        return None
    matches = _ENV_NPUS.findall(path.read_text())
    return matches[-1].strip() if matches else None


@dataclass(frozen=True, slots=True)
class Worker:
    """The worker service of one NPU."""

    npu: int

    @property
    def name(self) -> str:
        return f"worker-{self.npu}"

    @property
    def port(self) -> int:
        return DEFAULT_WORKER_BASE_PORT + self.npu

    @property
    def target(self) -> str:
        return f"{self.name}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.target}"


def workers_of(npus: Iterable[int]) -> list[Worker]:
    return [Worker(npu) for npu in npus]


# ---------------------------------------------------------------------------------------------
# docker-compose.yml


def render_compose(npus: Sequence[int]) -> str:
    """The whole docker-compose.yml for these NPUs."""
    workers = workers_of(npus)
    services = [
        *(_worker_service(worker) for worker in workers),
        _gateway_service(workers),
        _exporter_service(workers),
        _MONITORING,
    ]
    anchor = _ANCHORS.format(
        image=VLLM_ASCEND_IMAGE,
        version=__version__,
        tuning=_tuning(),
        hccl=DEFAULT_HCCL_BASE_PORT,
    )
    return f"{_header(npus)}\n{anchor}\nservices:\n" + "\n".join(services)


def _header(npus: Sequence[int]) -> str:
    listed = format_npus(npus)
    return _HEADER.format(
        npus=listed,
        count=len(npus),
        last_port=DEFAULT_WORKER_BASE_PORT + max(npus),
        first_port=DEFAULT_WORKER_BASE_PORT + min(npus),
    )


def _tuning() -> str:
    return "".join(f"    {name}: ${{{name}:-{value}}}\n" for name, value in TUNING_DEFAULTS)


def _worker_service(worker: Worker) -> str:
    devices = ", ".join((f"/dev/davinci{worker.npu}", *NPU_CONTROL_DEVICES))
    return _WORKER.format(
        name=worker.name,
        npu=worker.npu,
        port=worker.port,
        devices=devices,
        health=_health_test("python3", worker.port),
    )


def _health_test(python: str, port: int) -> str:
    check = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/health', timeout=5)"
    return f'["CMD", "{python}", "-c", "{check}"]'


def _gateway_service(workers: Sequence[Worker]) -> str:
    return _GATEWAY.format(
        port=DEFAULT_PORT,
        metrics_port=METRICS_PORT,
        workers=",".join(worker.url for worker in workers),
        depends=", ".join(worker.name for worker in workers),
        health=_health_test("python", DEFAULT_PORT),
    )


def _exporter_service(workers: Sequence[Worker]) -> str:
    mapping = ",".join(f"{worker.npu}={worker.url}" for worker in workers)
    devices = "".join(f"      - /dev/davinci{worker.npu}\n" for worker in workers)
    devices += "".join(f"      - {device}\n" for device in NPU_CONTROL_DEVICES)
    return _EXPORTER.format(
        port=EXPORTER_PORT,
        devices=devices.rstrip("\n"),
        mapping=mapping,
        ld_library_path=DRIVER_LIBRARY_PATH,
    )


# ---------------------------------------------------------------------------------------------
# Prometheus' worker targets


def render_targets(npus: Sequence[int]) -> str:
    """deploy/prometheus/targets/workers.yml: the `vllm` job's targets (file_sd_configs)."""
    targets = "".join(f"    - {worker.target}\n" for worker in workers_of(npus))
    return _TARGETS.format(npus=format_npus(npus), targets=targets.rstrip("\n"))


def rendered_files(npus: Sequence[int]) -> dict[Path, str]:
    """Every file this writes, by its path relative to the repository's root."""
    return {COMPOSE_FILE: render_compose(npus), TARGETS_FILE: render_targets(npus)}


# ---------------------------------------------------------------------------------------------
# The command


def add_compose_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--npus",
        default=None,
        help="the NPUs to run a worker on, e.g. 0-3 or 0,1,4-7 (default: NPUS in DIR/.env, else "
        f"{format_npus(ATLAS_800T_A2_NPUS)}, a whole Atlas 800T A2)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("."),
        help=f"the checkout to write {COMPOSE_FILE} and {TARGETS_FILE} in (default: .)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the files differ from what would be written",
    )


def run_compose(args: argparse.Namespace) -> int:
    spec = args.npus or npus_from_env_file(args.dir / ENV_FILE) or format_npus(ATLAS_800T_A2_NPUS)
    try:
        npus = parse_npus(spec)
    except ValueError as error:
        print(f"mineru-gateway compose: {error}", file=sys.stderr)
        return 2
    files = rendered_files(npus)
    if args.check:
        return _check(args.dir, files)
    for path, text in files.items():
        (args.dir / path).parent.mkdir(parents=True, exist_ok=True)
        (args.dir / path).write_text(text)
    print(f"wrote {', '.join(map(str, files))} for NPUs {format_npus(npus)}")
    return 0


def _check(directory: Path, files: dict[Path, str]) -> int:
    stale = [
        str(path)
        for path, text in files.items()
        if not (directory / path).is_file() or (directory / path).read_text() != text
    ]
    if stale:
        print(f"out of date: {', '.join(stale)} (run mineru-gateway compose)", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Templates: str.format fields in {single} braces, Compose's own ${VARIABLES} in doubled ones.

_HEADER = """\
# mineru-gateway on one NPU host: {count} vLLM-Ascend workers (NPUs {npus}), one per 910B, behind
# the gateway, with an NPU exporter, Prometheus and Grafana.
#
# GENERATED by `mineru-gateway compose` (src/mineru_gateway/entry/compose.py) from one setting,
# the NPU list: set NPUS in .env (e.g. NPUS=0-3) and run it again, inside the gateway's image:
#   docker compose run --rm --no-deps -v "$PWD:/repo" --user "$(id -u):$(id -g)" gateway \\
#     mineru-gateway compose --dir /repo
# It rewrites this file and deploy/prometheus/targets/workers.yml together. Do not edit by hand:
# tests/deploy/ fails.
#
#   scripts/make-env.py                   .env from .env.example, with a generated API key,
#                                         admin key and Grafana password; then set MODEL_DIR
#   docker compose up -d --build          (or docker-compose with Compose v1)
#   KEY=$(sed -n 's/^API_KEYS=\\([^,]*\\).*/\\1/p' .env)
#   curl -H "Authorization: Bearer $KEY" http://HOST:30000/v1/models
#                                         MinerU: MINERU_VL_API_KEY=$KEY, -b vlm-http-client
#                                         -u http://HOST:30000
#   Grafana http://127.0.0.1:3000, Prometheus http://127.0.0.1:9090 (localhost unless .env says)
# docs/deploy/compose.md is the whole guide.
#
# Every worker runs the same command, `mineru-gateway worker` (src/mineru_gateway/workers/
# launcher.py), which sets ASCEND_RT_VISIBLE_DEVICES, the port, HCCL_IF_BASE_PORT and vLLM-Ascend's
# environment, then execs vLLM. Worker N has /dev/davinciN as its only NPU, which it sees as
# device 0; `--worker-index N` gives it port 30001 + N (here {first_port}-{last_port}) and HCCL
# ports of its own. The host's /usr/local/bin and /usr/local/sbin are mounted under /host, on
# the images' PATH, so npu-smi is found wherever the driver put it (docs/deployment.md).
#
# Checked without an engine by tests/deploy/test_compose.py (`docker-compose config`).
"""

_ANCHORS = """\
x-worker: &worker
  build:
    context: .
    dockerfile: deploy/docker/Dockerfile.worker
    args:
      VLLM_ASCEND_IMAGE: ${{VLLM_ASCEND_IMAGE:-{image}}}
      PIP_INDEX_URL: ${{PIP_INDEX_URL:-https://pypi.org/simple}}
  image: mineru-gateway-worker:${{MINERU_GATEWAY_VERSION:-{version}}}
  init: true # tini as PID 1: reaps vLLM's orphans and forwards signals to it
  restart: unless-stopped
  shm_size: ${{WORKER_SHM_SIZE:-32gb}}
  stop_grace_period: 60s
  environment:
    VLLM_NO_USAGE_STATS: "1"
    # Where the weights come from: empty is MODEL as a directory under MODEL_DIR, offline;
    # huggingface or modelscope download MODEL by id into the model-cache volume.
    MINERU_MODEL_SOURCE: ${{MINERU_MODEL_SOURCE:-}}
    # vLLM-Ascend's tuning guide; TASK_QUEUE_ENABLE=2 raises the memory peak: 1 where HBM is tight.
{tuning}\
    # Worker N's HCCL ports start at this + 64 N: move them if another job on the host uses them.
    MINERU_GATEWAY_HCCL_BASE_PORT: ${{HCCL_BASE_PORT:-{hccl}}}
  volumes:
    - ${{MODEL_DIR:-/data/models}}:/models:ro
    - model-cache:/root/.cache # downloads (huggingface, modelscope), kept across restarts
    # The Ascend driver and tools from the host (vLLM-Ascend's mount list, docs/vllm-ascend.md).
    - /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro
    - /usr/local/dcmi:/usr/local/dcmi:ro
    - /etc/ascend_install.info:/etc/ascend_install.info:ro
    - /usr/local/bin:/host/usr/local/bin:ro # npu-smi, where the driver put it
    - /usr/local/sbin:/host/usr/local/sbin:ro
    - /var/log/npu/slog:/var/log/npu/slog

x-gateway-image: &gateway-image # the gateway and the NPU exporter
  build:
    context: .
    dockerfile: deploy/docker/Dockerfile.gateway
    args:
      PIP_INDEX_URL: ${{PIP_INDEX_URL:-https://pypi.org/simple}}
  image: mineru-gateway:${{MINERU_GATEWAY_VERSION:-{version}}}
  init: true
  restart: unless-stopped
"""

_WORKER = """\
  {name}:
    <<: *worker
    command:
      - mineru-gateway
      - worker
      - --device=0
      - --worker-index={npu}
      - --host=0.0.0.0
      - --model=${{MODEL:-/models/MinerU2.5-2509-1.2B}}
    devices: [{devices}]
    healthcheck:
      # vLLM answers /health once the model is loaded: minutes on NPUs (load, graph capture).
      test: {health}
      interval: 15s
      timeout: 10s
      retries: 3
      start_period: 15m
"""

_GATEWAY = """\
  gateway:
    <<: *gateway-image
    # Starts at once and answers 503 until a worker is healthy; takes each worker as it comes up.
    command: [mineru-gateway, serve, --host=0.0.0.0, --port={port}]
    environment:
      MINERU_GATEWAY_WORKERS: {workers}
      # Without a client key the gateway refuses to start (it listens on every interface)
      # unless ALLOW_NO_AUTH=true: scripts/make-env.py writes a generated key into .env.
      MINERU_GATEWAY_API_KEYS: ${{API_KEYS:-}}
      MINERU_GATEWAY_ADMIN_KEYS: ${{ADMIN_KEYS:-}}
      MINERU_GATEWAY_ALLOW_NO_AUTH: ${{ALLOW_NO_AUTH:-false}}
      # /metrics on a port of its own, not published: Prometheus reaches it on this network.
      MINERU_GATEWAY_METRICS_PORT: "{metrics_port}"
      MINERU_GATEWAY_NPU_SMI: "off" # the npu-exporter service reads the NPUs
      MINERU_GATEWAY_LOG_FORMAT: json
    ports:
      - "${{GATEWAY_BIND:-0.0.0.0}}:${{GATEWAY_PORT:-{port}}}:{port}"
    depends_on: [{depends}]
    stop_grace_period: 45s # in-flight requests finish before the gateway exits
    healthcheck:
      test: {health}
      interval: 10s
      timeout: 5s
      retries: 3
"""

_EXPORTER = """\
  npu-exporter:
    <<: *gateway-image # which has `mineru-gateway npu-exporter` too
    user: root # npu-smi talks to the driver's devices
    command:
      - mineru-gateway
      - npu-exporter
      - --host=0.0.0.0
      - --port={port}
      # Ascend npu-exporter's metric names too; false where Ascend's own exporter runs as well.
      - --npu-exporter-names=${{NPU_EXPORTER_NAMES:-true}}
      # which worker serves on which NPU, for the dashboards' per-worker NPU panels
      - --devices={mapping}
    devices:
{devices}
    environment:
      LD_LIBRARY_PATH: {ld_library_path}
    volumes:
      - /usr/local/bin:/host/usr/local/bin:ro # npu-smi: found on PATH under /host
      - /usr/local/sbin:/host/usr/local/sbin:ro
      - /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro
      - /usr/local/dcmi:/usr/local/dcmi:ro
      - /etc/ascend_install.info:/etc/ascend_install.info:ro
"""

_MONITORING = """\
  prometheus:
    image: prom/prometheus:${PROMETHEUS_VERSION:-v2.53.2}
    restart: unless-stopped
    command:
      - --config.file=/etc/prometheus/prometheus.yml
      - --storage.tsdb.path=/prometheus
      - --storage.tsdb.retention.time=${PROMETHEUS_RETENTION:-15d}
    volumes:
      - ./deploy/prometheus:/etc/prometheus:ro # prometheus.yml, rules/ and targets/
      - prometheus-data:/prometheus
    ports:
      # Unauthenticated: on localhost unless PROMETHEUS_BIND says otherwise.
      - "${PROMETHEUS_BIND:-127.0.0.1}:${PROMETHEUS_PORT:-9090}:9090"

  grafana:
    image: grafana/grafana:${GRAFANA_VERSION:-11.2.0}
    restart: unless-stopped
    environment:
      # No default: Grafana's own is admin/admin. .env.example says where to set it.
      GF_SECURITY_ADMIN_PASSWORD: ${GRAFANA_ADMIN_PASSWORD:?set GRAFANA_ADMIN_PASSWORD in .env}
      GF_USERS_ALLOW_SIGN_UP: "false"
    volumes:
      - ./deploy/grafana/provisioning:/etc/grafana/provisioning:ro
      - ./deploy/grafana/dashboards:/var/lib/grafana/dashboards/mineru-gateway:ro
      - grafana-data:/var/lib/grafana
    ports:
      - "${GRAFANA_BIND:-127.0.0.1}:${GRAFANA_PORT:-3000}:3000"
    depends_on: [prometheus]

volumes:
  prometheus-data:
  grafana-data:
  model-cache:
"""

_TARGETS = """\
# The `vllm` job's targets (deploy/prometheus/prometheus.yml, file_sd_configs): the workers of
# docker-compose.yml, NPUs {npus}. GENERATED with it by `mineru-gateway compose`; do not edit.
- targets:
{targets}
"""
