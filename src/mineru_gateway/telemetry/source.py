"""Running `npu-smi`: the one seam where NPU telemetry touches the operating system.

    NpuSmiError                 every failure of one `npu-smi` run, with its `kind`
    ├── NpuSmiNotFound          not_found  (not on PATH, or not executable)
    ├── NpuSmiTimeout           timeout    (killed, with its process group)
    ├── NpuSmiExitError         exit_code  (non-zero exit)
    └── NpuSmiParseError        parse      (output without an NPU table)

The binary runs with `loop.subprocess_exec` in a session of its own, so a timeout kills it
and anything it started, and no pipe held by a leftover child can keep a scrape waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from mineru_gateway.telemetry.npu_smi import (
    NpuChip,
    apply_readings,
    parse_info,
    parse_key_values,
    parse_version,
    readings_from_key_values,
)

ErrorKind = Literal["not_found", "timeout", "exit_code", "parse"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("not_found", "timeout", "exit_code", "parse")
DetailQuery = Literal["usages", "power", "temp"]

DEFAULT_TIMEOUT_S = 10.0
# Where Ascend's driver installs npu-smi (docs/vllm-ascend.md): looked at by `auto` after PATH,
# because a root shell's PATH on an NPU host has them but a service's may not.
NPU_SMI_LOCATIONS = ("/usr/local/bin/npu-smi", "/usr/local/sbin/npu-smi")
_REAP_TIMEOUT_S = 5.0  # after SIGKILL; only a process stuck in the kernel takes longer
_STDERR_LIMIT = 200
_OUTPUT_LIMIT = 4 * 1024 * 1024  # npu-smi prints a few kB; never hold more than this


class NpuSmiError(Exception):
    kind: ClassVar[ErrorKind]


class NpuSmiNotFound(NpuSmiError):
    kind = "not_found"


class NpuSmiTimeout(NpuSmiError):
    kind = "timeout"


class NpuSmiExitError(NpuSmiError):
    kind = "exit_code"

    def __init__(self, message: str, *, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class NpuSmiParseError(NpuSmiError):
    kind = "parse"


@dataclass(frozen=True, slots=True)
class NpuSnapshot:
    """One reading of every chip. `detail_errors`: failed `-t` queries that left values `None`."""

    chips: tuple[NpuChip, ...]
    version: str | None = None
    detail_errors: tuple[ErrorKind, ...] = ()


class NpuSource(Protocol):
    """Anything that reads every chip at once; raises an `NpuSmiError` when it cannot."""

    async def read(self) -> NpuSnapshot: ...


class NpuSmiSource:
    """Reads a snapshot from `npu-smi info`, filling missing values from `npu-smi info -t ...`.

    `path` is a file path or a command name looked up on PATH at each run (default `npu-smi`), so
    installing the driver after start works. With `fill_missing`, a chip whose table row lacks
    HBM or AI-core values gets `-t usages`, one without power `-t power`, one without a
    temperature `-t temp` (`-i NPU`, plus `-c CHIP` where an NPU has several chips).
    """

    def __init__(
        self,
        path: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        fill_missing: bool = True,
    ) -> None:
        self._path = path or "npu-smi"
        self._timeout_s = timeout_s
        self._fill_missing = fill_missing

    async def read(self) -> NpuSnapshot:
        """A snapshot of every chip; raises an `NpuSmiError` when `npu-smi info` fails."""
        text = await self.run("info")
        chips = parse_info(text)
        if not chips:
            raise NpuSmiParseError(f"no NPU table in the output of {self._path} info")
        if not self._fill_missing:
            return NpuSnapshot(tuple(chips), parse_version(text))
        filled: list[NpuChip] = []
        errors: list[ErrorKind] = []
        for chip in chips:
            filled.append(await self._fill(chip, _chip_arg(chip, chips), errors))
        return NpuSnapshot(tuple(filled), parse_version(text), tuple(errors))

    async def run(self, *args: str) -> str:
        """`npu-smi ARGS...`'s standard output; raises an `NpuSmiError` on any failure."""
        executable = shutil.which(self._path)
        if executable is None:
            raise NpuSmiNotFound(_not_found_message(self._path))
        returncode, stdout, stderr = await self._communicate([executable, *args])
        if returncode != 0:
            detail = stderr.decode(errors="replace").strip()[:_STDERR_LIMIT]
            message = f"{self._path} {' '.join(args)} exited with {returncode}: {detail}"
            raise NpuSmiExitError(message, returncode=returncode)
        return stdout.decode(errors="replace")

    async def _fill(
        self, chip: NpuChip, chip_arg: Sequence[str], errors: list[ErrorKind]
    ) -> NpuChip:
        for query in _missing_queries(chip):
            try:
                text = await self.run("info", "-t", query, "-i", str(chip.npu_id), *chip_arg)
            except NpuSmiError as exc:
                errors.append(exc.kind)
                continue
            chip = apply_readings(chip, readings_from_key_values(parse_key_values(text)))
        return chip

    async def _communicate(self, argv: list[str]) -> tuple[int, bytes, bytes]:
        output = _Output(asyncio.get_running_loop())
        # Spawned in a task of its own, shielded: a spawn cut short by cancellation would leave
        # uvloop a killed child that nobody reaps before the loop closes.
        spawning = asyncio.create_task(_spawn(argv, output))
        try:
            async with asyncio.timeout(self._timeout_s):
                transport = await asyncio.shield(spawning)
                await asyncio.shield(output.done)  # shielded: `_clean_up` may still wait for it
        except TimeoutError:
            raise NpuSmiTimeout(f"{argv[0]} did not answer in {self._timeout_s} s") from None
        finally:
            await _clean_up(spawning, output)
        return transport.get_returncode() or 0, bytes(output.stdout), bytes(output.stderr)


def find_npu_smi(setting: str) -> str | None:
    """The npu-smi to run for the `npu_smi` setting, or None for no NPU telemetry.

    `off` is None. `auto` is npu-smi on PATH or at `NPU_SMI_LOCATIONS`, looked up once, now:
    None where there is none, so a gateway on a machine without NPUs exports no NPU series and
    raises no NPU alert. Anything else is a path or command name, kept even if it is missing
    now: an explicit npu-smi that cannot run is an error to report (`npu_smi_up` 0), not hide.
    """
    if setting == "off":
        return None
    if setting != "auto":
        return setting
    found = shutil.which("npu-smi")
    candidates = [found] if found else []
    candidates += [path for path in NPU_SMI_LOCATIONS if shutil.which(path)]
    return candidates[0] if candidates else None


def _not_found_message(path: str) -> str:
    if os.path.isdir(path):
        # What a bind mount of a host file that does not exist leaves behind (Docker creates
        # an empty directory in its place): say so, it is otherwise hard to see.
        return (
            f"{path} is a directory, not npu-smi: nothing was at that path on the host when it "
            "was mounted (README, Troubleshooting)"
        )
    return f"{path} not found or not executable"


async def _spawn(argv: list[str], output: _Output) -> asyncio.SubprocessTransport:
    try:
        transport, _ = await asyncio.get_running_loop().subprocess_exec(
            lambda: output,
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:  # vanished since `which`, or not a valid executable
        raise NpuSmiNotFound(f"cannot run {argv[0]}: {exc}") from exc
    return transport


async def _clean_up(spawning: asyncio.Task[asyncio.SubprocessTransport], output: _Output) -> None:
    """Leaves no process running and no transport open, however the run ended."""
    try:
        transport = await asyncio.shield(spawning)
    except (NpuSmiError, asyncio.CancelledError):  # never started: nothing to clean
        return
    if not output.done.done():  # timed out or cancelled: nothing may outlive the scrape
        await _kill_group(transport.get_pid(), output.done)
    # Closed here, not by garbage collection: uvloop warns of handles open when the loop closes.
    transport.close()


class _Output(asyncio.SubprocessProtocol):
    """Collects a process's output; `done` once it has exited and its pipes are closed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.done: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        buffer = self.stdout if fd == 1 else self.stderr
        if len(buffer) < _OUTPUT_LIMIT:
            buffer.extend(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done.set_result(None)  # once: the process has exited and every pipe is closed


def _missing_queries(chip: NpuChip) -> list[DetailQuery]:
    queries: list[DetailQuery] = []
    if None in (chip.hbm_used_mb, chip.hbm_total_mb, chip.aicore_percent):
        queries.append("usages")
    if chip.power_w is None:
        queries.append("power")
    if chip.temperature_c is None:
        queries.append("temp")
    return queries


def _chip_arg(chip: NpuChip, chips: Sequence[NpuChip]) -> tuple[str, ...]:
    """`-c CHIP` only where an NPU has several chips; single-chip NPUs are asked by `-i` alone."""
    siblings = sum(1 for other in chips if other.npu_id == chip.npu_id)
    return ("-c", str(chip.chip_id)) if siblings > 1 and chip.chip_id is not None else ()


async def _kill_group(pid: int, done: asyncio.Future[None]) -> None:
    """SIGKILL to the process group (npu-smi and anything it started), then wait until it has
    exited and every holder of its pipes is gone (bounded: a child that left the group may not)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(_REAP_TIMEOUT_S):
            await asyncio.shield(done)
