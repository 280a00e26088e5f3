"""Every runtime dependency of the gateway installs from a binary wheel on both architectures the
images are built for (Atlas hosts are Kunpeng 920, aarch64), at the versions in constraints.txt:
the gateway and worker images install with `--only-binary=:all:`, so nothing is compiled there
and nothing x86-only slips in. Asks the package index (pip download), as the image builds do."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.support import ROOT

PLATFORMS = ("manylinux2014_aarch64", "manylinux2014_x86_64")
# The images' Pythons: the gateway image's python:3.11-slim (constraints.txt was resolved with a
# current 3.11), and the worker image's, where the launcher's virtualenv uses vLLM-Ascend's
# Python: 3.12 on v0.23.0 (docs/facts/worker-image.md).
PYTHONS = ("3.11", "3.12")
TARGET = default_environment() | {
    "python_version": "3.11",
    "python_full_version": "3.11.7",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==(\S+)$", re.M)


def pins() -> dict[str, str]:
    text = (ROOT / "constraints.txt").read_text()
    return {canonicalize_name(name): version for name, version in _PIN.findall(text)}


def target(python: str = "3.11") -> dict[str, str]:
    return TARGET | {"python_version": python, "python_full_version": f"{python}.0"}


def applies(requirement: Requirement, extras: set[str], python: str = "3.11") -> bool:
    """Whether `requirement` is needed on the images' Linux with these extras of its parent."""
    marker = requirement.marker
    env = target(python)
    return marker is None or any(marker.evaluate(env | {"extra": e}) for e in {"", *extras})


def runtime_closure(python: str = "3.11") -> dict[str, str]:
    """pyproject's [project.dependencies] and what they need on Linux, with their pins: the
    installed environment's metadata gives each one's own requirements."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [r for r in map(Requirement, project["dependencies"]) if applies(r, set(), python)]
    seen: dict[str, set[str]] = {}
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in seen and requirement.extras <= seen[name]:
            continue
        extras = seen.setdefault(name, set())
        extras |= requirement.extras
        requires = map(Requirement, metadata.requires(name) or ())
        todo += [r for r in requires if applies(r, extras, python)]
    pinned = pins()
    missing = sorted(set(seen) - set(pinned))
    assert not missing, f"runtime dependencies without a pin in constraints.txt: {missing}"
    return {name: pinned[name] for name in sorted(seen)}


def test_the_closure_holds_the_declared_dependencies_and_theirs() -> None:
    closure = runtime_closure()
    assert {"fastapi", "uvloop", "httptools", "pydantic-core", "starlette"} <= set(closure)
    assert "pytest" not in closure and "mypy" not in closure  # the dev extras are not runtime


@pytest.mark.timeout(600)
@pytest.mark.parametrize("python", PYTHONS)
@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_runtime_dependency_has_a_binary_wheel(
    tmp_path: Path, platform: str, python: str
) -> None:
    closure = runtime_closure(python)
    result = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"),
            *("--only-binary=:all:", "--no-deps", "--platform", platform),
            *("--python-version", python, "--implementation", "cp", "-d", str(tmp_path)),
            *(f"{name}=={version}" for name, version in closure.items()),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    wheels = [path.name for path in tmp_path.iterdir()]
    assert len(wheels) == len(closure) and all(name.endswith(".whl") for name in wheels), wheels
    arch = platform.split("_", 1)[1]
    compiled = [name for name in wheels if not name.endswith("-none-any.whl")]
    assert compiled and all(arch in name for name in compiled), compiled
