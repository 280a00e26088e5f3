"""A fake `npu-smi` for tests: an executable that prints recorded outputs by its arguments.

`install_npu_smi(directory, responses)` writes `directory/npu-smi` (a Python script) and a JSON
file it reads on every run, so a test can change the behaviour between two runs with
`stub.configure(...)`. Every run appends its arguments to `calls.log`. Unknown arguments exit 2,
like the real tool. `hang=True` starts a grandchild `sleep` and sleeps, for timeout tests: both
pids land in `pids.log`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "npu-smi"

_SCRIPT = """\
#!{python}
import json, os, subprocess, sys, time
here = os.path.dirname(os.path.abspath(__file__))
config = json.load(open(os.path.join(here, "npu-smi.json")))
command = " ".join(sys.argv[1:])
with open(os.path.join(here, "calls.log"), "a") as log:
    log.write(command + "\\n")
if config["hang"]:
    child = subprocess.Popen(["sleep", "300"])
    with open(os.path.join(here, "pids.log"), "a") as pids:
        pids.write(f"{{os.getpid()}} {{child.pid}}\\n")
    time.sleep(300)
if command not in config["responses"]:
    sys.stderr.write(f"Error: unknown command {{command!r}}\\n")
    sys.exit(2)
sys.stdout.write(config["responses"][command])
sys.stderr.write(config["stderr"])
sys.exit(config["exit_code"])
"""


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def recorded_responses(npus: range = range(8)) -> dict[str, str]:
    """`info` -> the 8 x 910B3 table; `info -t usages|common|power|temp -i N` -> the recordings."""
    responses = {"info": fixture("info_910B3_x8_idle.txt")}
    for npu in npus:
        responses[f"info -t usages -i {npu}"] = fixture("usages_910B_v23.0.rc2.txt")
        responses[f"info -t common -i {npu}"] = fixture("common_910B.txt")
        responses[f"info -t power -i {npu}"] = fixture("power_v25.5.1.txt")
        responses[f"info -t temp -i {npu}"] = fixture("temp_v25.5.1.txt")
    return responses


@dataclass(frozen=True)
class NpuSmiStub:
    directory: Path

    @property
    def path(self) -> Path:
        return self.directory / "npu-smi"

    def configure(
        self,
        responses: Mapping[str, str] | None = None,
        *,
        exit_code: int = 0,
        stderr: str = "",
        hang: bool = False,
    ) -> None:
        config = {
            "responses": dict(recorded_responses() if responses is None else responses),
            "exit_code": exit_code,
            "stderr": stderr,
            "hang": hang,
        }
        (self.directory / "npu-smi.json").write_text(json.dumps(config))

    def calls(self) -> list[str]:
        log = self.directory / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def hung_pids(self) -> list[int]:
        log = self.directory / "pids.log"
        text = log.read_text() if log.exists() else ""
        return [int(pid) for pid in text.split()]


def install_npu_smi(
    directory: Path,
    responses: Mapping[str, str] | None = None,
    *,
    exit_code: int = 0,
    stderr: str = "",
    hang: bool = False,
) -> NpuSmiStub:
    """Writes an executable `directory/npu-smi`; `responses` default to the recorded fixtures."""
    directory.mkdir(parents=True, exist_ok=True)
    stub = NpuSmiStub(directory)
    stub.path.write_text(_SCRIPT.format(python=sys.executable))
    stub.path.chmod(0o755)
    stub.configure(responses, exit_code=exit_code, stderr=stderr, hang=hang)
    return stub


def path_with(directory: Path) -> str:
    """PATH with `directory` first, for `monkeypatch.setenv("PATH", ...)`."""
    return os.pathsep.join([str(directory), os.environ.get("PATH", "")])


def process_alive(pid: int) -> bool:
    """False once `pid` is gone or a zombie (an orphan nobody reaps still counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Waits until `condition()` holds, polling; fails after `timeout_s`."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"condition not met in {timeout_s} s")
