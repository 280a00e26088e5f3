"""What the worker image runs: its environment and the launcher's command for given arguments."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mineru_gateway.entry.cli import build_parser
from mineru_gateway.workers.launcher import WorkerCommand, worker_command_from_args
from tests.deploy.support import ROOT

DOCKER_DIR = ROOT / "deploy" / "docker"


def image_env(dockerfile: Path) -> dict[str, str]:
    """The `ENV KEY=value ...` settings of a Dockerfile (continuation lines joined)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env |= dict(item.split("=", 1) for item in line.split()[1:])
    return env


def use_worker_image_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Makes this process's MINERU_GATEWAY_* variables those of the worker image; returns them."""
    env = image_env(DOCKER_DIR / "Dockerfile.worker")
    for name in list(os.environ):
        if name.startswith("MINERU_GATEWAY_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("MINERU_GATEWAY_"):  # not PATH, which the image extends
            monkeypatch.setenv(name, value)
    return env


def command_in(args: list[str], environ: dict[str, str]) -> WorkerCommand:
    """What `mineru-gateway worker ARGS` runs in a container whose environment is `environ`."""
    assert args[:2] == ["mineru-gateway", "worker"], args
    return worker_command_from_args(build_parser().parse_args(args[1:]), environ)
