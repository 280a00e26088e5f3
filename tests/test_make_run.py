"""`make run` and the Python it builds on: ARGS reach `mineru-gateway up`, the run installs the
runtime dependencies only (the tests' install keeps the dev extras), and a Python older than
pyproject.toml's requires-python is refused with a message naming the requirement."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert MAKE is not None, "make is not installed"
    return subprocess.run(
        [MAKE, "--no-print-directory", "-C", str(ROOT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def fresh_venv(tmp_path: Path, stamp: str) -> Path:
    """A virtualenv directory whose install stamp is newer than pyproject.toml."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / stamp).touch()
    return venv


def test_make_run_passes_args_to_up(tmp_path: Path) -> None:
    venv = fresh_venv(tmp_path, ".runtime")
    result = make("-n", "run", f"VENV={venv}", "ARGS=--port 30100 --workers 2")
    assert result.returncode == 0, result.stderr
    command = result.stdout.splitlines()[-1]
    up = f"{venv}/bin/mineru-gateway up --engine sim --log-format console"
    assert command == f"{up} --port 30100 --workers 2"  # later flags win: ARGS over defaults


def test_make_run_installs_the_runtime_only_and_make_install_the_dev_extras(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    run = make("-n", "run", f"VENV={venv}").stdout
    assert f"{venv}/bin/pip install --quiet --constraint constraints.txt -e .\n" in run
    assert "[dev" not in run
    install = make("-n", "install", f"VENV={venv}").stdout
    assert "--constraint constraints.txt -e '.[dev,bench]'" in install


def stub_python(directory: Path, name: str, new_enough: bool) -> None:
    """A `python` that answers find-python's version check as a real one would."""
    stub = directory / name
    stub.write_text(f"#!/bin/sh\nexit {0 if new_enough else 1}\n")
    stub.chmod(0o755)


@pytest.mark.parametrize(
    ("stubs", "found"),
    [
        ({"python3": False, "python3.10": False}, None),
        ({"python3": False, "python3.12": True}, "python3.12"),
        ({"python3": True, "python3.13": True}, "python3.13"),  # a versioned name first
        ({"python3.11": True, "python3.12": True}, "python3.11"),  # the tested one first
        ({"python3": True}, "python3"),
    ],
)
def test_find_python_picks_the_first_python_new_enough(
    tmp_path: Path, stubs: dict[str, bool], found: str | None
) -> None:
    for name, new_enough in stubs.items():
        stub_python(tmp_path, name, new_enough)
    result = subprocess.run(
        ["/bin/sh", str(ROOT / "scripts" / "find-python")],
        capture_output=True,
        text=True,
        env={"PATH": str(tmp_path)},
        timeout=30,
    )
    if found is None:
        assert (result.returncode, result.stdout) == (1, "")
    else:
        assert (result.returncode, result.stdout) == (0, f"{tmp_path / found}\n")


def test_make_refuses_a_python_too_old_naming_the_requirement(tmp_path: Path) -> None:
    stub_python(tmp_path, "python3.10", new_enough=False)
    env = dict(os.environ)
    result = make("run", f"VENV={tmp_path / 'venv'}", f"PYTHON={tmp_path / 'python3.10'}", env=env)
    assert result.returncode != 0
    assert "mineru-gateway needs Python >= 3.11 (pyproject.toml's requires-python)" in (
        result.stderr
    )
    assert not (tmp_path / "venv").exists()  # stopped before making a virtualenv
