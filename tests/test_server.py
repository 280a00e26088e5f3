"""The gateway's own server (entry/server.py), in processes of their own: what its startup
leaves for the garbage collector, its log lines in JSON mode, a stop on SIGTERM, and an address
it cannot bind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pydantic
import pytest

from mineru_gateway.api.connection import Timeouts
from mineru_gateway.config import GatewaySettings
from mineru_gateway.entry.server import edge_timeouts
from tests.support.servers import CliProcess, free_port, wait_until

SCRIPT = """
import asyncio, gc
from mineru_gateway.entry.logs import configure_logging
from mineru_gateway.entry.server import make_server

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

async def main():
    server = make_server(app, "127.0.0.1", 0)
    before = gc.get_freeze_count()
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(before, gc.get_freeze_count() > before, flush=True)
    server.should_exit = True
    await serving

configure_logging("warning", "json")
asyncio.run(main())
"""


def test_once_listening_what_startup_made_is_frozen_out_of_the_collectors_way() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"]


def _log_lines(path: Path) -> list[dict[str, object]]:
    """Every line of a JSON log, parsed: a line that is not JSON fails the test."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_in_json_mode_every_line_the_server_logs_is_json_and_sigterm_exits_0(
    tmp_path: Path,
) -> None:
    port = free_port()
    gateway = CliProcess.mineru_gateway(
        "serve", "--port", str(port), "--workers", "http://127.0.0.1:9", "--log-format", "json"
    )
    log = tmp_path / "gateway.log"
    proc = gateway.start(log_path=str(log))
    try:
        wait_until(lambda: _health(port), 30, "the gateway answering")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        gateway.stop()
    events = [line["event"] for line in _log_lines(log)]
    assert "server_listening" in events and events[-1] == "server_stopped"


def _health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_the_edges_clocks_come_from_the_settings_and_keep_alive_stays_above_5_s() -> None:
    settings = GatewaySettings(head_timeout_s=2, body_idle_timeout_s=3, keep_alive_timeout_s=6)
    assert edge_timeouts(settings) == Timeouts(head_s=2, body_idle_s=3, keep_alive_s=6)
    assert edge_timeouts(GatewaySettings()) == Timeouts(10, 30, 30)
    with pytest.raises(pydantic.ValidationError, match="keep_alive_timeout_s"):
        GatewaySettings(keep_alive_timeout_s=5)  # MinerU's client's own expiry
