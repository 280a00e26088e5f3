"""Log output as an operator reads it: one JSON object per line with the json format, whoever
logged (structlog or a library's standard `logging`), and no fields that say None."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROGRAM = """
import asyncio, logging, sys
import structlog
from mineru_gateway.entry.logs import configure_logging

configure_logging("info", sys.argv[1])
structlog.get_logger("mineru_gateway.registry").info(
    "worker_healthy", worker="http://w:1", error=None
)
logging.getLogger("aiohttp.client").warning("a library's warning: %s", "detail")
try:
    raise SystemExit(3)
except SystemExit:
    logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=True)
logging.getLogger("quiet").debug("below the level")
"""


def run(log_format: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, log_format],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout == ""
    return result.stderr.splitlines()


def test_json_format_writes_only_json_lines_for_structlog_and_standard_logging() -> None:
    events = [json.loads(line) for line in run("json")]  # fails on any line that is not JSON
    assert [event["event"] for event in events] == [
        "worker_healthy",
        "a library's warning: detail",
        "Task exception was never retrieved",
    ]
    healthy, warning, failure = events
    assert healthy == {
        "event": "worker_healthy",
        "worker": "http://w:1",
        "level": "info",
        "timestamp": healthy["timestamp"],
    }
    assert (warning["level"], warning["logger"]) == ("warning", "aiohttp.client")
    assert failure["level"] == "error" and "SystemExit: 3" in failure["exception"]


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_fields_that_hold_none_are_left_out(log_format: str) -> None:
    [healthy] = [line for line in run(log_format) if "worker_healthy" in line]
    assert "None" not in healthy and "null" not in healthy and "error" not in healthy
    assert "http://w:1" in healthy
