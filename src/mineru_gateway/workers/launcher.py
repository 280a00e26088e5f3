"""The one builder of worker commands: a device in, an environment, a port and flags out.

`mineru-gateway worker`, the `up` supervisor, `docker-compose.yml` and the Kubernetes manifests all
start a worker through `build_vllm_command` (or `build_sim_command` for a simulated one), so a
worker starts the same way everywhere (docs/architecture.md).

What one vLLM(-Ascend) server per NPU needs (docs/vllm-ascend.md):

- `ASCEND_RT_VISIBLE_DEVICES=<device>`: the device id as the container sees it (0 when a single
  NPU is mounted, as Kubernetes' device plugin and our compose services do).
- Its own HTTP port, `base_port + index`, and its own HCCL port range: several HCCL users on one
  host otherwise all bind HCCL's default 60000+. `index` is the worker's slot on the host and
  defaults to the device id; set it apart from the device when device ids are container-local.
- HCCL ports: CANN reserves 16 ports from `HCCL_IF_BASE_PORT` (CANN 8.0-8.2) or 32 (CANN 8.3+).
  Worker `index` gets `hccl_base_port + 64 * index`: twice the widest reservation, so ranges never
  overlap even if a later CANN doubles it again. The default base 61000 lies above Linux's default
  ephemeral range (32768-60999), so outgoing connections cannot take these ports, and clear of
  HCCL's own default 60000-60031; 16 workers end at 62023, far below HCCL's limit of 65520.
- vLLM-Ascend's recommended environment (expandable segments, task queue, spawn, a bounded
  OpenMP pool so several workers do not oversubscribe the host's cores). These are defaults: the
  environment the worker starts in may set them differently. The device and port variables are not
  defaults: they are what makes the worker this worker.
- MinerU's logits processor (`no_repeat_ngram_size`, which MinerU's client sends) when the model
  is MinerU, as `mineru-vllm-server` does (docs/mineru-client.md).
- Where the weights come from (`model_source`, MinerU's MINERU_MODEL_SOURCE values): a local
  directory, checked before vLLM starts (a wrong path otherwise shows only once vLLM has loaded,
  minutes later) and served offline (HF_HUB_OFFLINE=1); the Hugging Face hub (online); or
  ModelScope (vLLM's VLLM_USE_MODELSCOPE).

On `cpu` (real vLLM's CPU build, used by the tests here) the device becomes a core list for
`VLLM_CPU_OMP_THREADS_BIND`, the CPU analogue of `ASCEND_RT_VISIBLE_DEVICES`
(docs/running-locally.md).

vLLM flags given by the user follow ours and win: a default is dropped when the user passes the
same flag (`--flag value`, `--flag=value`, `--flag_name`, or its `--no-flag` negation).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import NoReturn

from mineru_gateway.config import (
    DEFAULT_HCCL_BASE_PORT,
    DEFAULT_WORKER_BASE_PORT,
    HCCL_MAX_BASE_PORT,
    HCCL_PORT_STRIDE,
    LauncherSettings,
    ModelSource,
    Platform,
)

PLATFORMS: tuple[Platform, ...] = ("ascend", "cpu")


VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # the `vllm` script fails on vllm-cpu
MINERU_LOGITS_PROCESSOR = "mineru_vl_utils:MinerULogitsProcessor"

# docs/vllm-ascend.md: typical VLM serve flags on Atlas A2; the batch is vLLM's own default (256):
# MinerU2.5 is a 1.2B model whose KV cache per sequence is small on a 64 GB 910B.
ASCEND_DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype",
    "bfloat16",
    "--max-num-seqs",
    "256",
    "--max-model-len",
    "32768",
    "--max-num-batched-tokens",
    "16384",
    "--gpu-memory-utilization",
    "0.9",
)
# Small and quick on a CPU (mineru_gateway/testing.py measured them): float32 beats bfloat16
# for a tiny model there, and --enforce-eager more than halves the start.
CPU_DEFAULT_ARGS: tuple[str, ...] = (
    "--dtype",
    "float32",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "16",
    "--enforce-eager",
)
DEFAULT_ARGS: Mapping[Platform, tuple[str, ...]] = MappingProxyType(
    {"ascend": ASCEND_DEFAULT_ARGS, "cpu": CPU_DEFAULT_ARGS}
)

ASCEND_DEFAULT_ENV: Mapping[str, str] = MappingProxyType(
    {
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        # vLLM-Ascend's tuning guide (docs/deployment.md): 2 raises the memory peak; set 1 where
        # HBM is tight. CPU_AFFINITY_CONF=1 binds the host threads of each NPU.
        "TASK_QUEUE_ENABLE": "2",
        "CPU_AFFINITY_CONF": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        # torch starts one thread per core in every process: bound it, or four workers on one
        # host run four times as many threads as there are cores.
        "OMP_NUM_THREADS": "8",
    }
)
CPU_DEFAULT_ENV: Mapping[str, str] = MappingProxyType(
    {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache, allocated up front
)

# The builder sets these itself; a user flag for them would break the port/device layout.
RESERVED_FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "model": "--model",
        "served-model-name": "--served-model-name",
        "host": "--host",
        "port": "--base-port (the port is base port + worker index)",
    }
)

# What each source of weights sets (huggingface_hub and vLLM read these).
SOURCE_ENV: Mapping[ModelSource, Mapping[str, str]] = MappingProxyType(
    {
        "local": MappingProxyType({"HF_HUB_OFFLINE": "1"}),
        "huggingface": MappingProxyType({"HF_HUB_OFFLINE": "0"}),
        "modelscope": MappingProxyType({"VLLM_USE_MODELSCOPE": "True", "HF_HUB_OFFLINE": "0"}),
    }
)

# The launcher's own interpreter: never passed on to vLLM's (another virtualenv or image Python).
LAUNCHER_ONLY_ENV = ("PYTHONHOME", "VIRTUAL_ENV")

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class WorkerCommand:
    """One worker's command line, the variables it sets, and where it listens."""

    argv: tuple[str, ...]
    env: Mapping[str, str]  # set on top of the environment the worker starts in
    host: str
    port: int

    def url(self, host: str | None = None) -> str:
        """The worker's base URL, through `host` or its bind address (loopback for a wildcard)."""
        if host is None:
            host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """The worker's complete environment when started from an environment `base`."""
        kept = {k: v for k, v in base.items() if k not in LAUNCHER_ONLY_ENV}
        return kept | dict(self.env)

    def render(self) -> str:
        """A shell command that runs exactly this (on top of the current environment)."""
        lines = ["env " + " ".join(f"-u {name}" for name in LAUNCHER_ONLY_ENV)]
        lines += [shlex.quote(f"{name}={value}") for name, value in sorted(self.env.items())]
        groups: list[list[str]] = []
        for token in self.argv:  # one line per flag and its values
            if not groups or token.startswith("--"):
                groups.append([])
            groups[-1].append(token)
        lines += [shlex.join(group) for group in groups]
        return " \\\n  ".join(lines)


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What every vLLM worker of a group shares; `build_vllm_command` adds the device."""

    model: str
    vllm_python: str = sys.executable
    platform: Platform = "ascend"
    served_model_name: str | None = None  # None: the model directory's name, or the hub id
    host: str = "127.0.0.1"
    base_port: int = DEFAULT_WORKER_BASE_PORT
    hccl_base_port: int = DEFAULT_HCCL_BASE_PORT
    extra_args: tuple[str, ...] = ()
    mineru_logits_processor: bool | None = None  # None: on when the model looks like MinerU
    model_source: ModelSource | None = None  # None: local for a path, huggingface for an id

    @property
    def is_path(self) -> bool:
        return self.model.startswith(("/", ".", "~"))

    @property
    def source(self) -> ModelSource:
        if self.model_source is not None:
            return self.model_source
        return "local" if self.is_path else "huggingface"

    @property
    def served_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.is_path:
            return PurePosixPath(self.model.rstrip("/")).name or self.model
        return self.model

    @property
    def wants_logits_processor(self) -> bool:
        if self.mineru_logits_processor is not None:
            return self.mineru_logits_processor
        # The model's own name only: a directory such as ~/.cache/mineru-gateway/ says nothing.
        model_name = PurePosixPath(self.model.rstrip("/")).name
        return "mineru" in f"{model_name} {self.served_name}".lower()


def flag_name(token: str) -> str | None:
    """`--max-num-seqs=8`, `--max_num_seqs` and `--no-max-num-seqs` all name `max-num-seqs`."""
    if not token.startswith("--") or token == "--":
        return None
    name = token[2:].split("=", 1)[0].replace("_", "-")
    return name.removeprefix("no-")


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value the last `--name V` or `--name=V` in `args` gives (as vLLM's parser reads);
    `name` with or without its dashes, in snake or kebab case."""
    name = name.removeprefix("--").replace("_", "-")
    value = None
    for index, token in enumerate(args):
        if flag_name(token) != name or token.startswith("--no-"):
            continue
        if "=" in token:
            value = token.split("=", 1)[1]
        elif index + 1 < len(args):
            value = args[index + 1]
    return value


def batch_size(options: VllmOptions) -> int | None:
    """The workers' `--max-num-seqs`: the user's flag, else the platform's default flags."""
    value = flag_value([*DEFAULT_ARGS[options.platform], *options.extra_args], "max-num-seqs")
    return int(value) if value is not None and value.isdigit() else None


def _flags_in(args: Sequence[str]) -> set[str]:
    return {name for token in args if (name := flag_name(token)) is not None}


def _defaults_not_given(defaults: Sequence[str], given: set[str]) -> list[str]:
    """`defaults` (flags, each followed by its values) less the flags the user gave."""
    kept: list[str] = []
    keep = True
    for token in defaults:
        name = flag_name(token)
        if name is not None:
            keep = name not in given
        if keep:
            kept.append(token)
    return kept


def _check_extra_args(extra_args: Sequence[str]) -> None:
    for name in sorted(_flags_in(extra_args) & RESERVED_FLAGS.keys()):
        raise ValueError(
            f"--{name} is set by mineru-gateway for each worker; use {RESERVED_FLAGS[name]} instead"
        )


def _check_ports(index: int, options: VllmOptions) -> int:
    if index < 0:
        raise ValueError(f"worker index must not be negative: {index}")
    port = options.base_port + index
    if not 1 <= port <= 65535:
        raise ValueError(f"worker port {port} (base {options.base_port} + {index}) is not a port")
    return port


def hccl_base_port(index: int, base: int = DEFAULT_HCCL_BASE_PORT) -> int:
    """The first of worker `index`'s HCCL ports; ranges of different workers never overlap."""
    port = base + HCCL_PORT_STRIDE * index
    if not 1024 <= port <= HCCL_MAX_BASE_PORT:
        raise ValueError(
            f"HCCL base port {port} for worker {index} is outside [1024, {HCCL_MAX_BASE_PORT}]; "
            "lower --hccl-base-port"
        )
    return port


def build_vllm_command(
    device: int,
    options: VllmOptions,
    *,
    index: int | None = None,
    cpu_bind: str | None = None,
    environ: Mapping[str, str] = _EMPTY,
) -> WorkerCommand:
    """The command for the vLLM worker on `device` (worker `index`, by default the device).

    `environ` is the environment the worker will start in: a default variable it already sets is
    kept. `cpu_bind` (platform `cpu`) is the core list, by default the device number.
    """
    if device < 0:
        raise ValueError(f"device must not be negative: {device}")
    index = device if index is None else index
    port = _check_ports(index, options)
    _check_extra_args(options.extra_args)

    env = _worker_env(device, index, options, cpu_bind, environ)
    given = _flags_in(options.extra_args)
    argv = [
        options.vllm_python,
        "-m",
        VLLM_SERVER_MODULE,
        "--model",
        options.model,
        "--served-model-name",
        options.served_name,
        "--host",
        options.host,
        "--port",
        str(port),
        *_defaults_not_given(DEFAULT_ARGS[options.platform], given),
    ]
    if options.wants_logits_processor and "logits-processors" not in given:
        argv += ["--logits-processors", MINERU_LOGITS_PROCESSOR]
    argv += options.extra_args
    return WorkerCommand(tuple(argv), MappingProxyType(env), options.host, port)


def _worker_env(
    device: int,
    index: int,
    options: VllmOptions,
    cpu_bind: str | None,
    environ: Mapping[str, str],
) -> dict[str, str]:
    if options.platform == "ascend":
        defaults, pinned = (
            ASCEND_DEFAULT_ENV,
            {
                "ASCEND_RT_VISIBLE_DEVICES": str(device),
                "HCCL_IF_BASE_PORT": str(hccl_base_port(index, options.hccl_base_port)),
            },
        )
    else:
        defaults, pinned = (
            CPU_DEFAULT_ENV,
            {
                "VLLM_CPU_OMP_THREADS_BIND": cpu_bind if cpu_bind is not None else str(device),
            },
        )
    pinned |= SOURCE_ENV[options.source]
    return {name: environ.get(name, value) for name, value in defaults.items()} | pinned


def check_model(options: VllmOptions | None) -> None:
    """ValueError, naming the path, when a local model is not a model directory: refused before
    vLLM starts, not minutes into its start."""
    if options is None or options.source != "local":
        return
    directory = Path(options.model).expanduser()
    if not directory.is_dir():
        raise ValueError(f"model directory {options.model} does not exist (model source local)")
    if not (directory / "config.json").is_file():
        raise ValueError(
            f"model directory {options.model} has no config.json: not a downloaded model "
            "(set --model-source huggingface or modelscope to download by id)"
        )


def build_sim_command(
    index: int,
    *,
    base_port: int = DEFAULT_WORKER_BASE_PORT,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
) -> WorkerCommand:
    """The command for simulated worker `index` (`mineru-gateway sim`), on `base_port + index`."""
    if index < 0:
        raise ValueError(f"worker index must not be negative: {index}")
    port = base_port + index
    argv = (python, "-m", "mineru_gateway", "sim", "--host", host, "--port", str(port))
    return WorkerCommand((*argv, *extra_args), MappingProxyType({}), host, port)


def cpu_binds(count: int, cpus: Sequence[int]) -> list[str]:
    """`VLLM_CPU_OMP_THREADS_BIND` for `count` CPU workers running at once: disjoint core groups
    (round-robin single cores when there are more workers than cores)."""
    if count < 1 or not cpus:
        raise ValueError("need at least one worker and one CPU")
    ordered = sorted(cpus)
    if count >= len(ordered):
        return [str(ordered[i % len(ordered)]) for i in range(count)]
    per = len(ordered) // count
    return [",".join(str(cpu) for cpu in ordered[i * per : (i + 1) * per]) for i in range(count)]


# -- `mineru-gateway worker` -------------------------------------------------------------------


def vllm_options(
    settings: LauncherSettings, extra_args: Sequence[str], host: str | None = None
) -> VllmOptions:
    """What every vLLM worker of a group shares, from the launcher's settings and flags."""
    if not settings.model:
        raise ValueError("a model is needed: --model PATH (or MINERU_GATEWAY_MODEL)")
    return VllmOptions(
        model=settings.model,
        vllm_python=settings.vllm_python,
        platform=settings.platform,
        served_model_name=settings.served_model_name,
        host=host or settings.worker_host,
        base_port=settings.worker_base_port,
        hccl_base_port=settings.hccl_base_port,
        extra_args=tuple(extra_args),
        mineru_logits_processor=settings.mineru_logits_processor,
        model_source=settings.model_source,
    )


def _help(name: str) -> str:
    field = LauncherSettings.model_fields[name]
    default = field.default if field.default is not None else "none"
    return f"{field.description} [env MINERU_GATEWAY_{name.upper()}; default {default}]"


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every vLLM worker of a group shares (`worker` and `up --engine vllm`)."""
    group = parser.add_argument_group("vLLM workers")
    group.add_argument("--model", help=_help("model"))
    group.add_argument(
        "--model-source",
        choices=("local", "huggingface", "modelscope"),
        help=_help("model_source").replace(
            "[env MINERU_GATEWAY_MODEL_SOURCE",
            "[env MINERU_GATEWAY_MODEL_SOURCE or MINERU_MODEL_SOURCE",
        ),
    )
    group.add_argument("--served-model-name", help=_help("served_model_name"))
    group.add_argument("--vllm-python", metavar="PYTHON", help=_help("vllm_python"))
    group.add_argument("--platform", choices=PLATFORMS, help=_help("platform"))
    group.add_argument("--hccl-base-port", type=int, metavar="PORT", help=_help("hccl_base_port"))
    group.add_argument(
        "--mineru-logits-processor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=_help("mineru_logits_processor"),
    )


WORKER_DESCRIPTION = """\
Runs one vLLM(-Ascend) OpenAI server pinned to one device: ASCEND_RT_VISIBLE_DEVICES=DEVICE,
port base + index, its own HCCL_IF_BASE_PORT, vLLM-Ascend's recommended environment and, for MinerU,
MinerU's logits processor. vLLM replaces this process (exec), so in a container vLLM receives the
container's signals itself and its exit status is the container's.

Arguments after `--` go to vLLM unchanged and win over the defaults, e.g.
  mineru-gateway worker --device 1 --model /models/MinerU2.5-2509-1.2B -- --max-num-seqs 64
`--dry-run` prints the exact environment and command instead of running them.
"""


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `mineru-gateway worker`."""
    parser.add_argument("--device", type=int, required=True, help="NPU id (or CPU core on cpu)")
    parser.add_argument(
        "--worker-index",
        type=int,
        metavar="N",
        help="this worker's slot on the host: port base + N and its HCCL port range (default: "
        "the device; set it when one NPU per container makes every device id 0)",
    )
    parser.add_argument("--host", dest="worker_host", help=_help("worker_host"))
    parser.add_argument(
        "--base-port", dest="worker_base_port", type=int, help=_help("worker_base_port")
    )
    parser.add_argument(
        "--cpu-bind", metavar="CORES", help="cpu only: VLLM_CPU_OMP_THREADS_BIND (default: DEVICE)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the environment and command, run nothing"
    )
    add_vllm_arguments(parser)
    parser.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_ARGS", help="passed to vLLM"
    )


def worker_command_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = _EMPTY
) -> WorkerCommand:
    """What `mineru-gateway worker ARGS` runs, in an environment `environ`."""
    extra = list(args.vllm_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    settings = LauncherSettings.from_args(args)
    return build_vllm_command(
        args.device,
        vllm_options(settings, extra),
        index=args.worker_index,
        cpu_bind=args.cpu_bind,
        environ=environ,
    )


def run_worker(args: argparse.Namespace) -> int:
    """`mineru-gateway worker`: print the command (`--dry-run`), or become vLLM."""
    environ = dict(os.environ)
    try:
        command = worker_command_from_args(args, environ)
        if not args.dry_run:
            check_model(vllm_options(LauncherSettings.from_args(args), ()))
    except ValueError as error:
        print(f"mineru-gateway worker: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(command.render())
        return 0
    _exec(command, environ)


def _exec(command: WorkerCommand, environ: Mapping[str, str]) -> NoReturn:
    env = command.environ(environ)
    if shutil.which(command.argv[0], path=env.get("PATH")) is None:
        print(
            f"mineru-gateway worker: vLLM's Python {command.argv[0]!r} was not found; set "
            "--vllm-python or MINERU_GATEWAY_VLLM_PYTHON",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.stdout.flush()
    sys.stderr.flush()
    # exec, not a child: vLLM gets the container's signals directly, its exit status is the
    # container's, and no launcher process lingers beside it.
    os.execvpe(command.argv[0], list(command.argv), env)
